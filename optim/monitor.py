"""Training statistics for TensorBoard: per-step scalars and the MoE layers' routing statistics.

Layers publish routing statistics as data. Any module with `routing_stats` and `num_experts`
attributes (the MoE layer has both) holds in `routing_stats`, after each forward, a dict of detached
tensors:
    l_aux, z_loss:  scalars of that forward;
    exp_counts:     int64 [E], choices per expert before dropping (this rank's tokens);
    kept_counts:    int64 [E], choices per expert after dropping.
A module may also have an `expert_bias` attribute ([E] tensor or None, the same on every rank): its
range after the step is reported.
`StepStats` sums them over the micro-batches of an optimizer step and then over all ranks in one
all-reduce; `Monitor` writes the result on rank 0: scalars, an expert-load histogram per layer and
an experts x layers figure (`optim.figure`), and each expert's load as a scalar, charted per layer in
TensorBoard's custom scalars. `StepReport` is what the engine reports of its steps through
them, beside its progress line.
"""

import functools
import os
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import repeat
from torch import nn

from optim.figure import expert_load_figure, load_colours

__all__ = ["LayerStats", "Monitor", "StepReport", "StepStats"]

PICTURE_INTERVAL = 10  # steps between expert-load histograms and figures (scalars: every step)


@dataclass(frozen=True)
class LayerStats:
    """One MoE layer's routing over a whole step (all micro-batches, all ranks).

    Args:
        name: the layer's module name.
        l_aux: mean load-balancing loss.
        z_loss: mean router z-loss.
        exp_counts: float64 [E], choices per expert before dropping.
        kept_counts: float64 [E], choices per expert after dropping.
        bias_range: (min, max) of the layer's expert bias after the step, None without one.
    """

    name: str
    l_aux: float
    z_loss: float
    exp_counts: torch.Tensor
    kept_counts: torch.Tensor
    bias_range: tuple[float, float] | None = None

    @functools.cached_property
    def _counts(self) -> tuple[list[float], list[float]]:
        """The counts as Python floats, read once: the scalars below are a few operations on E numbers,
        which cost less in Python than as tensor operations (whole counts: their sums are exact in
        any order, so the values are the tensors' own)."""
        return self.exp_counts.tolist(), self.kept_counts.tolist()

    @property
    def max_vio(self) -> float:
        """MaxVio (Wang et al. 2024): max_i c_i / mean_j c_j - 1 over the step's routed choices; 0 when even."""
        counts = self._counts[0]
        mean = sum(counts) / len(counts) if counts else 0.0
        return max(counts) / mean - 1.0 if mean > 0 else 0.0

    @property
    def dropped_fraction(self) -> float:
        routed = sum(self._counts[0])
        return 1.0 - sum(self._counts[1]) / routed if routed else 0.0

    @functools.cached_property
    def loads(self) -> list[float]:
        """`load` as Python floats (the same values)."""
        counts = self._counts[0]
        routed = sum(counts)
        return [c * (len(counts) / routed) for c in counts] if routed else [1.0] * len(counts)

    @property
    def max_load(self) -> float:
        """The largest of `load`: 1.0 when balanced."""
        return max(self.loads, default=1.0)

    @property
    def load(self) -> torch.Tensor:
        """Each expert's share of the routed choices times E: 1.0 everywhere when balanced."""
        routed = self.exp_counts.sum()
        return self.exp_counts * (len(self.exp_counts) / routed) if routed else torch.ones_like(self.exp_counts)


class StepStats:
    """Sums training loss and routing statistics over one optimizer step, then over ranks.

    Args:
        model: the model whose modules with a `routing_stats` attribute are read.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu"):
        self.layers = [(name, module) for name, module in model.named_modules() if hasattr(module, "routing_stats")]
        self.device = torch.device(device)  # the model's: the all-reduce runs there (NCCL takes no CPU tensors)
        self._reset()

    def _reset(self) -> None:
        # Sums stay on the model's device until the step ends: no host sync per forward.
        self._loss = None  # [sum of the losses, how many], float64 on the device
        self._routing = [None] * len(self.layers)  # per layer: [forwards, l_aux, z_loss, *exp_counts, *kept_counts]

    def add_loss(self, loss: torch.Tensor) -> None:
        loss = loss.detach().double().reshape(1)
        pair = torch.cat([loss, torch.ones_like(loss)])  # counted on the device: a captured step adds it too
        self._loss = pair if self._loss is None else self._loss + pair

    def collect(self) -> None:
        """Read every MoE layer's statistics of the forward that just ran."""
        for i, (_, module) in enumerate(self.layers):
            stats = module.routing_stats
            if stats is None:
                continue
            l_aux = stats["l_aux"].double()
            row = torch.cat([torch.stack([torch.ones_like(l_aux), l_aux, stats["z_loss"].double()]),
                             stats["exp_counts"].double(), stats["kept_counts"].double()])
            self._routing[i] = row if self._routing[i] is None else self._routing[i] + row

    def reduce(self, group=None) -> tuple[float | None, list[LayerStats]]:
        """Mean loss and each layer's statistics over the step and all ranks (a collective when distributed).

        Every rank must call it at the same step; layers that did not run on any rank are left out.
        """
        return self.unpack(read_stats(self.step_vector(group)))

    def step_vector(self, group=None) -> torch.Tensor:
        """The step's sums over all ranks as one float64 vector on the device, and the expert biases'
        ranges (the same on every rank: not summed); no host read. Starts the next step's sums."""
        distributed = dist.is_available() and dist.is_initialized()
        device = self.device
        sizes = [module.num_experts for _, module in self.layers]
        loss = self._loss.to(device) if self._loss is not None else torch.zeros(2, dtype=torch.float64, device=device)
        rows = [r.to(device) if r is not None else torch.zeros(3 + 2 * e, dtype=torch.float64, device=device)
                for r, e in zip(self._routing, sizes)]
        flat = torch.cat([loss, *rows])
        self._reset()
        if distributed:
            dist.all_reduce(flat, group=group)
        biases = [getattr(module, "expert_bias", None) for _, module in self.layers]
        ranges = [torch.stack([b.min(), b.max()]).to(device, torch.float64) for b in biases if b is not None and b.numel()]
        return torch.cat([flat, *ranges])

    def unpack(self, flat: torch.Tensor) -> tuple[float | None, list[LayerStats]]:
        """Mean loss and each layer's statistics from `step_vector`'s values, read on the host."""
        sizes = [module.num_experts for _, module in self.layers]
        biases = [getattr(module, "expert_bias", None) for _, module in self.layers]
        ranges = [b for b in biases if b is not None and b.numel()]
        values = flat.tolist()  # scalars in Python: a few divisions, cheaper than tensor operations
        ranges = iter(zip(values[len(values) - 2 * len(ranges)::2], values[len(values) - 2 * len(ranges) + 1::2]))
        loss = values[0] / values[1] if values[1] else None
        layers, offset = [], 2
        for (name, _), e, bias in zip(self.layers, sizes, biases):
            forwards, l_aux, z_loss = values[offset:offset + 3]
            bias_range = tuple(next(ranges)) if bias is not None and bias.numel() else None
            if forwards > 0:
                layers.append(LayerStats(name, l_aux / forwards, z_loss / forwards, flat[offset + 3:offset + 3 + e].clone(),
                                         flat[offset + 3 + e:offset + 3 + 2 * e].clone(), bias_range))
            offset += 3 + 2 * e
        return loss, layers


def read_stats(flat: torch.Tensor) -> torch.Tensor:
    """The step's summed statistics on the host: one read per optimizer step, only with TensorBoard on."""
    return flat.cpu()


class Monitor:
    """A TensorBoard writer for training runs (create it on one rank only).

    Args:
        log_dir: the folder for the event files.
    """

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=log_dir)
        self._charted = False  # the per-expert load charts are laid out once per writer

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One scalar per tag, e.g. {"Val/loss": 1.9, "Train/tokens_per_s": 5e4}, all in one event.

        What `add_scalar` writes per tag (a simple value), as one summary with a value per tag: TensorBoard
        reads each tag as before, and a step's dozen MoE statistics cost one event instead of twelve
        (each `add_scalar` pays for the writer's queue and thread).
        """
        if not values:
            return
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=float(value)) for tag, value in values.items()])
        self.writer._get_file_writer().add_summary(summary, step)

    def train_step(self, step: int, samples: int, lr: float, loss_scale: float, seconds: float, batch_size: int,
                   loss: float | None, layers: list[LayerStats]) -> None:
        """One optimizer step: loss, lr, loss scale, step time and samples/s by step, DeepSpeed's
        `Train/Samples/*` tags by samples seen, and the routing (pictures every `PICTURE_INTERVAL` steps)."""
        scalars = {"Train/lr": lr, "Train/loss_scale": loss_scale, "Train/step_time_ms": seconds * 1000}
        if seconds > 0:
            scalars["Train/samples_per_s"] = batch_size / seconds
        deepspeed = {"Train/Samples/lr": lr, "Train/Samples/loss_scale": loss_scale}
        if loss is not None:
            scalars["Train/loss"] = deepspeed["Train/Samples/train_loss"] = loss
        self.scalars(step, {**scalars, **self._routing_scalars(layers)})
        self._chart_loads(layers)
        self.scalars(samples, deepspeed)
        if layers and (step == 1 or step % PICTURE_INTERVAL == 0):
            self._pictures(step, layers)

    def routing(self, step: int, layers: list[LayerStats], pictures: bool = True) -> None:
        """l_aux, z-loss, dropped fraction and MaxVio (mean over layers and per layer), each expert's load,
        the expert bias's range where there is one; with `pictures`, also
        each layer's load histogram and the experts x layers figure."""
        if not layers:
            return
        self.scalars(step, self._routing_scalars(layers))
        self._chart_loads(layers)
        if pictures:
            self._pictures(step, layers)

    @staticmethod
    def _routing_scalars(layers: list[LayerStats]) -> dict[str, float]:
        if not layers:
            return {}
        dropped = [s.dropped_fraction for s in layers]
        max_vio = [s.max_vio for s in layers]
        values = {"MoE/l_aux": sum(s.l_aux for s in layers) / len(layers),
                  "MoE/z_loss": sum(s.z_loss for s in layers) / len(layers),
                  "MoE/dropped_fraction": sum(dropped) / len(layers),
                  "MoE/max_vio": sum(max_vio) / len(layers)}
        for s, dropped_fraction, vio in zip(layers, dropped, max_vio):
            values.update({f"MoE/{s.name}/l_aux": s.l_aux, f"MoE/{s.name}/dropped_fraction": dropped_fraction,
                           f"MoE/{s.name}/max_load": s.max_load, f"MoE/{s.name}/max_vio": vio})
            if s.bias_range is not None:
                values[f"MoE/{s.name}/bias_min"], values[f"MoE/{s.name}/bias_max"] = s.bias_range
            values.update({f"MoE/{s.name}/expert_load/{e}": load for e, load in enumerate(s.loads)})
        return values

    def _chart_loads(self, layers: list[LayerStats]) -> None:
        """One multi-line chart per layer of its experts' loads (TensorBoard's custom scalars): a collapse
        shows as lines leaving 1.0. The layout is metadata, written once with the first routing."""
        if self._charted or not layers:
            return
        self._charted = True
        charts = {s.name or "(model)": ["Multiline", [rf"^MoE/{re.escape(s.name)}/expert_load/\d+$"]] for s in layers}
        self.writer.add_custom_scalars({"MoE expert load (fraction of the mean)": charts})

    def _pictures(self, step: int, layers: list[LayerStats]) -> None:
        for s in layers:
            self._load_histogram(step, s)
        figure = expert_load_figure([s.name for s in layers], [s.loads for s in layers], step)
        self.writer.add_image("MoE/expert_load", figure, step, dataformats="HWC")

    def _load_histogram(self, step: int, s: LayerStats) -> None:
        """The distribution of routed choices over expert ids: one bucket per expert."""
        counts = s.exp_counts
        ids = torch.arange(len(counts), dtype=torch.float64)
        total = float(counts.sum())
        if total == 0:
            return
        self.writer.add_histogram_raw(
            f"MoE/{s.name}/expert_load", min=0.0, max=float(len(counts) - 1), num=total,
            sum=float((ids * counts).sum()), sum_squares=float((ids * ids * counts).sum()),
            bucket_limits=[i + 0.5 for i in range(len(counts))], bucket_counts=counts.tolist(), global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class StepReport:
    """What the engine reports of its training steps.

    After each optimizer step: with TensorBoard, the step's loss and routing statistics summed over the
    ranks (`StepStats`, one collective) and written by rank 0's `Monitor` with the lr, loss scale and
    step time; every `steps_per_print` steps, rank 0's progress line (with `wall_clock_breakdown`, the
    time spent in forward, backward and step since the last line) and, with `memory_breakdown`, each
    rank's memory line.

    Args:
        config: the engine config (optim.config.EngineConfig): tensorboard, steps_per_print,
            wall_clock_breakdown, memory_breakdown, train_batch_size.
        model: the model whose MoE layers' statistics are read.
        device: the model's device.
        rank: this process's rank (rank 0 writes and prints).

    Attributes:
        monitor: rank 0's Monitor with TensorBoard, else None.
        last_routing_stats: the last optimizer step's per-layer routing (LayerStats), with TensorBoard.
        timers: seconds spent in forward, backward and step since the last progress line.
    """

    def __init__(self, config, model: nn.Module, device: torch.device, rank: int):
        board = config.tensorboard
        self.config, self.rank = config, rank
        # Statistics are summed on every rank (one all-reduce per step); rank 0 writes them.
        self.stats = StepStats(model, device) if board.enabled else None
        self.monitor = Monitor(os.path.join(board.output_path or "runs", board.job_name)) \
            if board.enabled and rank == 0 else None
        self.last_routing_stats = []
        self.timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.step_started = None  # when the step's first training forward began
        self.every = 0  # with `defer`: statistics read every this many steps
        self._queued, self._vector, self._flushed_at = [], None, None

    def defer(self, every: int) -> None:
        """Keep each step's statistics on the device and read them every `every` steps (a capturable
        step reads nothing on the host)."""
        if every < 1:
            raise ValueError(f"the report interval must be at least 1 step, got {every}")
        self.flush()
        self.every, self._flushed_at = every, time.perf_counter()

    def sum_step(self) -> None:
        """In a capturable step: the step's sums over the ranks, left on the device (a collective)."""
        if self.stats is not None:
            self._vector = self.stats.step_vector()

    def step_queued(self, step: int, lrs: list[float], scale: torch.Tensor | None) -> None:
        """After a deferred step: a copy of its sums and loss scale stays on the device; every `every`
        steps they are read at once and written, one TensorBoard step each."""
        if self.stats is not None:
            scale = self._vector.new_ones(1) if scale is None else scale.reshape(1).to(self._vector)
            self._queued.append((step, lrs[0], torch.cat([self._vector, scale])))
        if step % self.every == 0:
            self.flush()

    def flush(self) -> None:
        """Write the queued steps' statistics (one host read for all of them)."""
        queued, self._queued = self._queued, []
        if not queued:
            return
        rows = read_stats(torch.stack([row for _, _, row in queued]))
        now = time.perf_counter()
        seconds, self._flushed_at = (now - self._flushed_at) / len(queued), now
        for (step, lr, _), row in zip(queued, rows):
            loss, layers = self.stats.unpack(row[:-1])
            self.last_routing_stats = layers
            if self.monitor is not None:
                batch_size = self.config.train_batch_size
                self.monitor.train_step(step, step * batch_size, lr, float(row[-1]), seconds, batch_size, loss, layers)

    def forward_started(self, start: float, training: bool) -> None:
        if self.step_started is None and training:
            self.step_started = start

    def forward_ran(self, training: bool) -> None:
        """Read the MoE layers' statistics of a training forward (with TensorBoard)."""
        if self.stats is not None and training and torch.is_grad_enabled():
            self.stats.collect()

    def add_loss(self, loss: torch.Tensor) -> None:
        if self.stats is not None and loss.numel() == 1:
            self.stats.add_loss(loss)

    def add_time(self, phase: str, start: float) -> None:
        """The time since `start` (time.perf_counter) spent in `phase`: forward, backward or step."""
        self.timers[phase] += time.perf_counter() - start

    def step_done(self, step: int, skipped: int, lrs: list[float], loss_scale: float, memory) -> None:
        """After optimizer step `step` (`skipped` of them skipped); `memory()` gives this rank's memory
        breakdown. Collective with TensorBoard."""
        config = self.config
        if self.stats is not None:
            self._write_statistics(step, lrs[0], loss_scale)
        if self.rank == 0 and step % config.steps_per_print == 0:
            line = f"step={step} skipped={skipped} lr={lrs} loss_scale={loss_scale}"
            if config.wall_clock_breakdown:
                line += " " + " ".join(f"{k}_ms={v * 1000:.1f}" for k, v in self.timers.items())
                self.timers = dict.fromkeys(self.timers, 0.0)
            print(line, flush=True)
        if config.memory_breakdown and step % config.steps_per_print == 0:
            print(f"rank {self.rank} memory: {memory()}", flush=True)

    def _write_statistics(self, step: int, lr: float, loss_scale: float) -> None:
        """Sum this step's loss and routing over the ranks (a collective); rank 0's monitor writes them."""
        loss, layers = self.stats.reduce()
        self.last_routing_stats = layers
        now = time.perf_counter()
        seconds, self.step_started = now - (self.step_started or now), None
        if self.monitor is not None:
            batch_size = self.config.train_batch_size
            self.monitor.train_step(step, step * batch_size, lr, loss_scale, seconds, batch_size, loss, layers)


def load_heatmap(loads: list[torch.Tensor], cell: int | None = None) -> torch.Tensor:
    """An RGB uint8 image [layers * cell, max E * cell, 3] of expert loads (1.0 = balanced).

    White is balanced, red up to twice the mean load or more, blue down to no load; grey pads layers
    with fewer experts. Cells default to 4-32 pixels, about 512 pixels across. The bare grid: TensorBoard
    gets it labelled, with a colour bar, from `optim.figure.expert_load_figure`.
    """
    width = max(len(load) for load in loads)
    cell = cell or max(4, min(32, 512 // width))
    image = torch.full((len(loads), width, 3), 128, dtype=torch.uint8)
    for row, load in enumerate(loads):
        image[row, :len(load)] = torch.from_numpy(load_colours(load.double().numpy()))
    return repeat(image, "h w rgb -> (h dh) (w dw) rgb", dh=cell, dw=cell)  # each load a cell x cell square

