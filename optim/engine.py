"""The training engine: `initialize(model, config=...)` and the `Engine` it returns.

The engine coordinates pieces usable alone: the parsed config (`optim.config`), the ZeRO units that
hold parameters, gradients and master weights (`optim.zero`), a plain torch optimizer stepping on the
units' shards, DeepSpeed's schedules (`optim.schedulers`), the fp16 loss scaler (`optim.scaler`) and
checkpoints (`optim.checkpoint`). Stage 3 hands parameter sharding to torch's `fully_shard`: expert
modules on their expert-data-parallel mesh, the whole model on the data-parallel mesh.

Gradient scaling: every floating tensor the engine's forward returns passes through an identity
whose backward multiplies the incoming gradient by loss_scale / gradient_accumulation_steps. So a
plain `loss.backward()` (or `out.backward(grad)`) gets the same gradients as `engine.backward(loss)`,
which instead scales the loss itself (and so also covers loss terms that bypass the outputs).
"""

import contextlib
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from optim import checkpoint, fsdp, nonfinite
from optim.buckets import GradientBuckets, release_hooks
from optim.config import EngineConfig, parse_config
from optim.memory import model_state_bytes
from optim.monitor import Monitor, StepStats
from optim.nonfinite import NonfiniteGuard
from optim.optimizer import ZeroOptimizer, build_optimizer, check_client_optimizer, follow_split
from optim.scaler import LossScaler, LossScalerConfig
from optim.schedulers import build_scheduler
from optim.zero import FlatGroup, ShardedParam, describe_parameters, shard_placement
from parallel import (
    data_before_expert, groups_for_name, init_distributed, is_template_copy, local_device, split_group,
)
from parallel.distributed import TORCHRUN_VARIABLES

__all__ = ["Engine", "initialize"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by the engine's gradient factor (unless engine.backward runs)."""

    @staticmethod
    def forward(ctx, tensor, engine):
        ctx.engine = engine
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        engine = ctx.engine
        return (grad if engine._in_engine_backward else grad * engine._grad_factor()), None


_WIDE = (torch.float32, torch.float64)


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _param_groups(model: nn.Module, model_parameters, optimizer) -> list[dict]:
    """The user's param groups (dicts): the optimizer's when one was given, else from model_parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    elif model_parameters is None:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        items = list(model_parameters)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    return [dict(g, params=list(g["params"])) for g in groups]


def _split_expert_groups(groups: list[dict], infos: dict, model: nn.Module) -> tuple[list[dict], list[int]]:
    """Each group's trainable dense parameters (flagged moe=False), then its expert groups (parallel.split_group);
    and for each group made, the index of the user's group it came from.

    Raises:
        ValueError: a group holds a tensor that is not a parameter of the model.
    """
    known = {id(p) for p in model.parameters()}
    out, origins = [], []
    for index, group in enumerate(groups):
        stray = next((p for p in group["params"] if id(p) not in known), None)
        if stray is not None:
            raise ValueError(f"param group {index} holds a tensor of shape {list(stray.shape)} that is not a parameter "
                             "of the model; the engine trains the model's parameters only")
        dense, experts = split_group({**group, "params": [p for p in group["params"] if id(p) in infos]})
        made = ([{**dense, "moe": False}] if dense["params"] else []) + experts
        out += made
        origins += [index] * len(made)
    return out, origins


class Engine:
    """A model trained with ZeRO, mixed precision and checkpoints; built by `initialize`.

    Attributes:
        module: the wrapped model.
        optimizer: a `ZeroOptimizer` around the torch optimizer stepping on this rank's master-weight shards.
        lr_scheduler: the schedule, or None.
        global_steps: optimizer steps taken (skipped fp16 steps included, as in DeepSpeed).
        micro_steps: micro-batches seen.
        monitor: with `tensorboard.enabled`, rank 0's `optim.Monitor` (None elsewhere); each optimizer
            step writes loss, lr, loss scale, step time and the MoE layers' routing statistics, and
            callers may add their own scalars (validation loss, tokens/s) through it.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, model_parameters=None, optimizer=None,
                 lr_scheduler=None):
        self.config = config
        self.world_size, self.rank = _distributed()
        self.stage = config.zero_optimization.stage
        self.accumulation = config.gradient_accumulation_steps
        self.device = local_device()
        self.module = model.to(self.device)
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        self._grad_norm = None  # the last step's global gradient norm before clipping, on the device
        self._in_engine_backward = False
        self._skipped_last = False
        self.last_checkpoint: str | None = None  # the folder of the last checkpoint saved or loaded
        self._guard = NonfiniteGuard(self.world_size, self.device)  # inf and nan in losses, gradients and writes
        self._timers = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        low = config.low_precision
        self.compute_dtype = _DTYPES.get(low, torch.float32)
        bf16_master = low == "bf16" and config.bf16.bf16_master_weights_and_grads
        self.master_dtype = torch.bfloat16 if bf16_master else torch.float32
        self.state_dtype = torch.bfloat16 if bf16_master and config.bf16.bf16_optimizer_states else torch.float32
        self._warn_offload()
        release_hooks(self.module.parameters())  # an earlier engine's stage-2 hooks must not take our gradients
        self._broadcast_initial_state()
        infos = describe_parameters(
            self.module, lambda param: groups_for_name(param.group_name, data_before_expert(param)).ep_rank)
        if isinstance(optimizer, torch.optim.Optimizer):
            check_client_optimizer(optimizer, config.zero_allow_untested_optimizer)
        user_groups = _param_groups(self.module, model_parameters, optimizer)
        groups, origins = _split_expert_groups(user_groups, infos, self.module)
        groups = [dict(g, params=[infos[id(p)] for p in g["params"]]) for g in groups]
        client_state = {id(info): optimizer.state.get(info.param) for info in infos.values()} \
            if isinstance(optimizer, torch.optim.Optimizer) else None
        self._fully_shard = self.stage == 3 and dist.is_available() and dist.is_initialized()
        if self._fully_shard:
            fsdp.shard_model(self.module, infos, self.compute_dtype if low is not None else None, self.master_dtype,
                             self.offload, self.world_size, self.device)
        elif low is not None:
            self.module.to(self.compute_dtype)
        self.units = self._build_units(groups)
        self._buckets = self._build_buckets()
        self.optimizer = ZeroOptimizer(*build_optimizer(config, optimizer, groups, self._units_by_group, client_state),
                                       engine=self)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self._check_learning_rates()
        if isinstance(optimizer, torch.optim.Optimizer) and origins != list(range(len(user_groups))):
            follow_split(optimizer, self.lr_scheduler, origins, len(user_groups))
        self.scaler = LossScaler(LossScalerConfig(
            static_scale=config.fp16.loss_scale, initial_scale_power=config.fp16.initial_scale_power,
            loss_scale_window=config.fp16.loss_scale_window, hysteresis=config.fp16.hysteresis,
            consecutive_hysteresis=config.fp16.consecutive_hysteresis, min_loss_scale=config.fp16.min_loss_scale,
        )) if low == "fp16" or self._autocast_dtype() == torch.float16 else None  # fp16 autocast needs one too
        board = config.tensorboard
        # Statistics are summed on every rank (one all-reduce per step); rank 0 writes them.
        self._stats = StepStats(self.module, self.device) if board.enabled else None
        self.last_routing_stats = []  # the last optimizer step's per-layer routing (optim.LayerStats), with TensorBoard
        # Routers that keep state across steps (an expert bias, the step's counts) advance after each step:
        # any module with an update_routing(skipped=...) method (the MoE layer's gate has one).
        self._routers = [m for m in self.module.modules() if callable(getattr(m, "update_routing", None))]
        self.monitor = Monitor(os.path.join(board.output_path or "runs", board.job_name)) \
            if board.enabled and self.rank == 0 else None
        self._step_started = None

    # Set-up helpers.

    def _warn_offload(self) -> None:
        zero = self.config.zero_optimization
        offloads = [name for name, o in (("offload_optimizer", zero.offload_optimizer), ("offload_param", zero.offload_param))
                    if o.device == "cpu"]
        self.offload = bool(offloads) and self.device.type != "cpu"
        if offloads and not self.offload:
            warnings.warn(f"zero_optimization.{' and '.join(offloads)} has no effect: the model is already in host memory",
                          stacklevel=3)

    def _broadcast_initial_state(self) -> None:
        """Start every replica from the same values: dense parameters and buffers from rank 0, experts from
        their edp rank 0; then copies of a layer's expert template (expert_init="copy") from rank 0, so the
        model starts as it would at any other layout, unless some rank wrote into them (a loaded state
        dict). Decided on the device: no host read."""
        if self.world_size == 1:
            return
        params = list(self.module.parameters())
        copies = [p for p in params if hasattr(p, "template_copy")]  # built alike on every rank
        untouched = torch.tensor([all(is_template_copy(p) for p in copies)], dtype=torch.int32, device=self.device)
        if copies:
            dist.all_reduce(untouched, op=dist.ReduceOp.MIN)
        with torch.no_grad():
            for param in params:
                if hasattr(param, "allreduce") and not param.allreduce:
                    groups = groups_for_name(param.group_name, data_before_expert(param))
                    dist.broadcast(param.data, src=dist.get_global_rank(groups.edp_group, 0), group=groups.edp_group)
                else:
                    dist.broadcast(param.data, src=0)
            for param in copies:
                template = param.data.clone()
                dist.broadcast(template, src=0)
                param.data.copy_(torch.where(untouched.bool(), template, param.data))
            for buffer in self.module.buffers():
                dist.broadcast(buffer.data, src=0)

    def _build_units(self, groups: list[dict]) -> list:
        units, self._units_by_group = [], []
        master_device = torch.device("cpu") if self.offload and not self._fully_shard else self.device
        for group in groups:
            members = group["params"]
            if self._fully_shard:
                group_units = [ShardedParam(info, self.state_dtype) for info in members]
            else:  # without a process group there is nothing to shard: stage 3 holds what stage 2 does
                comm, size, rank = self._reduction_group(members[0])
                group_units = [FlatGroup(members, comm, size, rank, min(self.stage, 2), self.master_dtype,
                                         self.state_dtype, master_device, divisor=self.world_size)]
            units.extend(group_units)
            self._units_by_group.append(group_units)
        return units

    def _build_buckets(self) -> GradientBuckets | None:
        """One sending order of gradient buckets over every flat group (the same on every rank): stage 2
        reduces each micro-batch into the shards; stages 0/1 all-reduce in the window's last backward."""
        flats = [unit.flat_shard() for unit in self.units
                 if isinstance(unit, FlatGroup) and (unit.stage == 2 or unit.group is not None)]
        if not flats:
            return None
        zero = self.config.zero_optimization
        position = {id(param): i for i, param in enumerate(self.module.parameters())}
        self._reduce_every_micro_batch = any(flat.all_reduce is False for flat in flats)
        active = None if self._reduce_every_micro_batch else self.is_gradient_accumulation_boundary
        return GradientBuckets(flats, position, self.world_size, zero.reduce_bucket_size, zero.overlap_comm, active)

    def _reduction_group(self, info):
        """(group, size, this rank's position) over which this parameter's gradients are summed."""
        if self.world_size == 1:
            return None, 1, 0
        if info.expert:
            groups = groups_for_name(info.group_name, info.data_before_expert)
            return (groups.edp_group if groups.edp_size > 1 else None), groups.edp_size, groups.edp_rank
        return dist.group.WORLD, self.world_size, self.rank

    def _check_learning_rates(self) -> None:
        """Refuse a learning rate that is not finite or beyond the range of the model's dtype: every step
        would write inf into the weights."""
        largest, dtype = torch.finfo(self.compute_dtype).max, str(self.compute_dtype).removeprefix("torch.")
        # the groups' rates, those a schedule started from (base_lrs, initial_lr: the rate before its
        # warm-up), then its own (warmup_max_lr, max_lrs, ...), which it reaches later
        groups = self.optimizer.param_groups
        rates = [(f"param group {index}'s lr", group[key]) for index, group in enumerate(groups)
                 for key in ("initial_lr", "lr") if key in group]
        for name, value in (vars(self.lr_scheduler) if self.lr_scheduler is not None else {}).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if "lr" in name and name != "_last_lr":
                rates += [(f"param group {index}'s lr" if name == "base_lrs" else f"the schedule's {name}", lr)
                          for index, lr in enumerate(values)
                          if isinstance(lr, (int, float)) and not isinstance(lr, bool)]
        for what, lr in rates:
            if not math.isfinite(float(lr)) or abs(float(lr)) > largest:
                raise ValueError(f"{what} ({float(lr):g}) is beyond the range of the model's {dtype} "
                                 f"(largest {largest:.4g})")

    def _build_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
                else lr_scheduler
        if self.config.scheduler is None:
            return None
        return build_scheduler(self.config.scheduler.type, self.optimizer, dict(self.config.scheduler.params))

    # Training.

    def _grad_factor(self) -> float:
        return self.loss_scale / self.accumulation

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def _autocast_dtype(self) -> torch.dtype | None:
        autocast = self.config.torch_autocast
        return autocast.torch_dtype if autocast.enabled else None

    def _to_device(self, value):
        """Tensors to the model's device; floating ones to the fp16/bf16 compute dtype."""
        if not isinstance(value, torch.Tensor):
            return value
        dtype = self.compute_dtype if value.is_floating_point() and self.config.low_precision is not None else None
        return value.to(self.device, dtype, non_blocking=True)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the model on inputs moved to its device (floating ones cast to the fp16/bf16 compute dtype);
        outputs get the grad factor."""
        start = time.perf_counter()
        if self._step_started is None and self.module.training:
            self._step_started = start
        args, kwargs = tree_map(self._to_device, (args, kwargs))
        autocast = self._autocast_dtype()
        context = torch.autocast(self.device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
        with context:
            output = self.module(*args, **kwargs)
        if self._fully_shard and not (torch.is_grad_enabled() and self.module.training):
            fsdp.reshard(self.module)
        if self._stats is not None and self.module.training and torch.is_grad_enabled():
            self._stats.collect()
        if torch.is_grad_enabled():
            output = tree_map(lambda t: _ScaleGrad.apply(t, self) if isinstance(t, torch.Tensor) and t.requires_grad
                              and t.is_floating_point() else t, output)
        self._timers["forward"] += time.perf_counter() - start
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """loss.backward() with the loss scale and the 1 / gradient_accumulation_steps factor applied."""
        start = time.perf_counter()
        self._in_engine_backward = True
        try:
            (loss.float() * self._grad_factor()).backward(retain_graph=retain_graph)
        finally:
            self._in_engine_backward = False
        self._guard.add_loss(loss)
        if self._stats is not None and loss.numel() == 1:
            self._stats.add_loss(loss)
        self._timers["backward"] += time.perf_counter() - start

    # DeepSpeed's engine queries, so its scripts run unchanged.

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: LOCAL_RANK as an int, 0 without it."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole world (`rank`)."""
        return self.rank

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (the config's, resolved)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def get_global_grad_norm(self) -> float | None:
        """The last optimizer step's L2 norm of all gradients over all ranks, before clipping and unscaled.

        The norm is the one gradient clipping computes on the device; this reads it (a host sync when
        called, none in the step). Without gradient clipping the step computes no norm (it would cost a
        collective every step), so the answer is None, as DeepSpeed's is where its norm computation is off.

        Returns:
            The norm as a float; None before the first step, after a skipped step, or without clipping.
        """
        return None if self._grad_norm is None else float(self._grad_norm.item())

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation == 0

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary reduce, check, clip and step."""
        start = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        if self._buckets is not None and (self._reduce_every_micro_batch or boundary):  # the rest go out
            self._buckets.finish()
        for unit in self.units:
            unit.micro_step()
        self.micro_steps += 1
        if boundary:
            self._optimizer_step()
            self.global_steps += 1
            self._report()
        self._timers["step"] += time.perf_counter() - start

    def _optimizer_step(self) -> None:
        self._grad_norm = None
        for unit in self.units:
            unit.refresh(self.module)
            unit.reduce()
        grads = [unit.grad() for unit in self.units]
        watch = self.scaler is not None or self.config.nonfinite != "off"
        clipping = self.config.gradient_clipping > 0
        proxies = None
        if watch and clipping:
            # the global norm that clipping takes anyway is finite exactly when every gradient is (an inf
            # or nan makes it inf or nan), so it answers the overflow check without a pass of its own; a
            # norm that is not finite (also reached from huge finite values) is checked element by element
            proxies = self._prepare_proxies(grads)
            self._grad_norm = self._global_norm()
            self._skipped_last = bool(nonfinite.read_flag(~torch.isfinite(self._grad_norm))) \
                and self._guard.any_overflow(grads)
        else:
            self._skipped_last = watch and self._guard.any_overflow(grads)
        if self._skipped_last:
            self._grad_norm = None  # no norm is reported for a skipped step
            self._release_proxies()
            if self._guard.written_seen:  # the previous step's writes: they cannot be skipped
                self._stop_if_writes_went_bad(saving=False)
            if self.scaler is None and self.config.nonfinite == "stop":
                self._stop_on_nonfinite(grads)
            self.skipped_steps += 1
            if self.scaler is not None:
                self.scaler.update(True)
            else:
                warnings.warn(f"step {self.global_steps + 1} skipped: gradients hold inf or nan (nonfinite: skip)",
                              stacklevel=3)
            self.zero_grad()
            self._update_routers(skipped=True)
            return
        if proxies is None:
            proxies = self._prepare_proxies(grads)
        if clipping:  # on the device: min(1, clip / norm) scales every gradient, no host read
            if self._grad_norm is None:
                self._grad_norm = self._global_norm()
            coefficient = (self.config.gradient_clipping / (self._grad_norm + 1e-6)).clamp(max=1.0)
            # on the CPU reading it costs nothing, and a factor of exactly 1 (nothing clipped: most steps
            # once training settles) changes no bit, so that pass over every gradient is left out there
            # (a NaN factor, `nonfinite: off`, still multiplies)
            if coefficient.device.type != "cpu" or not float(coefficient) >= 1.0:
                for proxy in proxies:
                    proxy.grad.mul_(coefficient.to(proxy.grad.device, proxy.grad.dtype))
        self.optimizer._stepping = True
        try:
            self.optimizer.step()
        finally:
            self.optimizer._stepping = False
        for unit in self.units:
            if unit.steps_on_copy:
                unit.weights.copy_(unit.proxy.detach())
            unit.write_back()
        if watch:  # finite gradients can still overflow what the step writes (a learning rate far too large)
            self._guard.record_writes(self._written_tensors(), self.global_steps + 1)
        self._release_proxies()
        self.zero_grad()
        self._update_routers(skipped=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if self.scaler is not None:
            self.scaler.update(False)

    def _release_proxies(self) -> None:
        """Drop the proxies' gradients and the optimizer-dtype copies of `steps_on_copy` units (after a
        step, or when a step is skipped once they were prepared)."""
        for unit in self.units:
            if unit.steps_on_copy:
                unit.proxy.data = torch.empty(0, dtype=self.state_dtype, device=unit.weights.device)
            unit.proxy.grad = None

    def _update_routers(self, skipped: bool) -> None:
        """Advance every router's balancing state (the expert bias from the step's global counts): collective."""
        for router in self._routers:
            router.update_routing(skipped=skipped)

    def _stop_on_nonfinite(self, grads: list[torch.Tensor]) -> None:
        """Raise on every rank, naming the step, the ranks whose gradients are not finite and the last checkpoint."""
        try:
            self._guard.stop_on_nonfinite(grads, self.global_steps + 1, self.last_checkpoint)
        finally:  # the flags are read first; then the window's gradients and routing counts go
            self.zero_grad()
            self._update_routers(skipped=True)

    def _stop_if_writes_went_bad(self, saving: bool) -> None:
        """Raise on every rank when some rank's last step wrote inf or nan (collective)."""
        learning_rates = sorted({group["lr"] for group in self.optimizer.param_groups})
        try:
            self._guard.stop_if_writes_went_bad(learning_rates, self.last_checkpoint, saving)
        except FloatingPointError:
            self.zero_grad()
            raise

    def _written_tensors(self) -> list[torch.Tensor]:
        """What this rank's step wrote: its piece of the weights (in the model's dtype and as the master)
        and its optimizer states."""
        written = [t for unit in self.units for t in _own_writes(unit)]
        for unit in self.units:
            for _, state in self.optimizer.unit_states(unit):
                written += [value for value in state.values() if isinstance(value, torch.Tensor) and value.dim()]
        return written

    def _prepare_proxies(self, grads: list[torch.Tensor]) -> list[nn.Parameter]:
        """Give each proxy its gradient in the optimizer's dtype and device, unscaled."""
        proxies, inverse = [], 1.0 / self.loss_scale
        for unit, grad in zip(self.units, grads):
            proxy = unit.proxy
            if unit.steps_on_copy:  # bf16 master weights with fp32 optimizer states: step on an fp32 copy
                proxy.data = unit.weights.to(self.state_dtype)
            converted = grad.to(proxy.device, proxy.dtype)
            if inverse != 1.0:
                converted = converted * inverse if converted is grad else converted.mul_(inverse)
            proxy.grad = converted
            proxies.append(proxy)
        return proxies

    def _global_norm(self) -> torch.Tensor:
        """The L2 norm of all gradients over all ranks, counting each element once (on the device).

        Each slice's norm is taken in (at least) fp32 without a widened copy of the gradients; the
        squares add up in fp64."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for unit in self.units:
            grad = unit.proxy.grad
            if unit.counts_once() and grad.numel():
                norm = torch.linalg.vector_norm(grad, dtype=None if grad.dtype in _WIDE else torch.float32)
                total += norm.double().square().to(self.device)
        total = self._guard.with_writes(total)  # inf where the previous step wrote inf: one read for both
        if self.world_size > 1:
            dist.all_reduce(total)
        return total.sqrt()

    def zero_grad(self) -> None:
        """Clear accumulated gradients (buffers are kept and zeroed)."""
        self._guard.new_window()
        if self._buckets is not None:
            self._buckets.discard()
        for unit in self.units:
            unit.zero_grad()

    def was_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow, or non-finite gradients with nonfinite: skip)."""
        return self._skipped_last

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def _samples(self) -> int:
        return self.global_steps * self.config.train_batch_size

    def _report(self) -> None:
        if self._stats is not None:
            self._write_statistics()
        if self.rank == 0 and self.global_steps % self.config.steps_per_print == 0:
            line = f"step={self.global_steps} skipped={self.skipped_steps} lr={self.get_lr()} loss_scale={self.loss_scale}"
            if self.config.wall_clock_breakdown:
                line += " " + " ".join(f"{k}_ms={v * 1000:.1f}" for k, v in self._timers.items())
                self._timers = dict.fromkeys(self._timers, 0.0)
            print(line, flush=True)
        if self.config.memory_breakdown and self.global_steps % self.config.steps_per_print == 0:
            print(f"rank {self.rank} memory: {self.memory_breakdown()}", flush=True)

    def _write_statistics(self) -> None:
        """Sum this step's loss and routing over the ranks (a collective); rank 0's monitor writes them."""
        loss, layers = self._stats.reduce()
        self.last_routing_stats = layers
        now = time.perf_counter()
        seconds, self._step_started = now - (self._step_started or now), None
        if self.monitor is not None:
            self.monitor.train_step(self.global_steps, self._samples(), self.get_lr()[0], self.loss_scale, seconds,
                                    self.config.train_batch_size, loss, layers)

    # Memory and state.

    def memory_breakdown(self) -> dict:
        """This rank's bytes of model states: parameters, gradients and optimizer states (optim.memory).

        Returns:
            {"parameters", "gradients", "optimizer_states", "total"} in bytes, and the same three for
            "dense" and "expert" parameters separately.
        """
        return model_state_bytes(self.units, self.optimizer, self.module)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Save model, optimizer, scheduler, scaler, counters and RNG states atomically (collective).

        Returns:
            the checkpoint's directory.

        Raises:
            FloatingPointError: the last step wrote inf or nan into the weights or optimizer states
                (nothing is written; the message names the last checkpoint).
        """
        self._settle()
        if self._guard.written is not None:  # never a checkpoint of weights that are not finite
            self._stop_if_writes_went_bad(saving=True)
        self.last_checkpoint = checkpoint.save(self, save_dir, tag, client_state or {}, save_latest)
        return self.last_checkpoint

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Load a checkpoint saved at any world size, ep size and stage (collective; DeepSpeed's arguments).

        Args:
            load_dir, tag: the folder and the checkpoint's tag (default: the one `latest` names).
            load_module_strict: must be True: every parameter of the model is read, and a checkpoint of
                another model fails, naming the difference.
            load_optimizer_states, load_lr_scheduler_states: also read those (the step counters, loss
                scale and random states are read unless load_module_only).
            load_module_only: read the model's weights and buffers only (a warm start).
            custom_load_fn: DeepSpeed's hook for its own module loading; must be None here.

        Returns:
            (path, client_state).

        Raises:
            ValueError: load_module_strict=False or a custom_load_fn.
        """
        if load_module_strict is not True:
            raise ValueError(f"load_module_strict must be True, got {load_module_strict!r}; load a partial model "
                             "with engine.module.load_state_dict(..., strict=False)")
        if custom_load_fn is not None:
            raise ValueError("custom_load_fn is not supported: checkpoints are read through "
                             "torch.distributed.checkpoint; pass custom_load_fn=None")
        self._settle()
        path, client_state = checkpoint.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
        if self._guard.written is not None:  # the weights are the checkpoint's now (the states may not be)
            self._guard.record_writes(self._written_tensors(), self.global_steps)
        self.last_checkpoint = path
        return path, client_state

    def consolidated_state_dict(self) -> dict | None:
        """The full model state_dict, as a one-process model with every expert names it, on rank 0 (collective)."""
        self._settle()
        return checkpoint.consolidated_state_dict(self)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full model state_dict in the compute dtype (fp16, bf16 or fp32) to save_dir/save_filename.

        Every rank calls it (collective); rank 0 writes, atomically (a temporary name, then a rename),
        and every rank returns once the file is there. Stage 3 needs no extra config key: the state is
        always gathered (DeepSpeed wants stage3_gather_16bit_weights_on_model_save and returns False
        without it).

        Returns:
            True.
        """
        state = self.consolidated_state_dict()
        if state is not None:
            state = {name: value.to(self.compute_dtype) if value.is_floating_point() else value
                     for name, value in state.items()}
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, save_filename)
            temporary = f"{path}.tmp{os.getpid()}"
            torch.save(state, temporary)
            os.replace(temporary, path)
        if self.world_size > 1:
            dist.barrier()
        return True

    def empty_partition_cache(self) -> None:
        """Free gathered stage-3 parameters and cached device memory (DeepSpeed's, between training and
        generation, say): the parameters are sharded again and the allocator's cache is emptied."""
        if self._fully_shard:
            fsdp.reshard(self.module)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _settle(self) -> None:
        """Before collectives outside a training step: parameters sharded, units on the live storage."""
        if self._fully_shard:
            fsdp.reshard(self.module)
        for unit in self.units:
            unit.refresh(self.module)


def _own_writes(unit) -> list[torch.Tensor]:
    """What a unit's step writes on this rank: its weights, and its slice of the model's copy when the
    master is separate (a cast to fp16 can overflow where the fp32 master does not)."""
    if getattr(unit, "separate", False):
        return [unit.weights, unit.flat[unit.lo:unit.lo + unit.shard]]
    return [unit.weights]


def initialize(model: nn.Module = None, model_parameters=None, config=None, training_data=None, optimizer=None,
               lr_scheduler=None, config_params=None, args=None, **_ignored):
    """Wrap a model for training (DeepSpeed's `deepspeed.initialize`).

    As DeepSpeed's does, it joins the process group torchrun describes (unless
    `dist_init_required=False`) and makes the expert-parallel groups of MoE layers built before that.
    DeepSpeed's other keywords (`mpu`, `collate_fn`, `distributed_port`, ...) are accepted and ignored. Call it with keywords, as DeepSpeed scripts do: `initialize(args=args,
    model=model, model_parameters=params)`; `model` is the first positional argument here, where
    DeepSpeed's first is `args`.

    Args:
        model: the model; MoE layers' expert parameters carry `allreduce=False` and `group_name`.
        model_parameters: parameters or param groups to optimize (groups flagged `moe: True` are
            welcome; expert parameters are split out of unflagged groups); default all trainable ones.
        config: a DeepSpeed-style dict or JSON path (`config_params` is accepted as its alias).
        training_data: an optional Dataset; a DataLoader over this rank's share is returned.
        optimizer: a torch optimizer built over the model's parameters (kept, with its settings,
            state and hooks, its param groups re-pointed at the engine's shards; see optim.optimizer)
            or a callable taking param groups; else the config's `optimizer`.
        lr_scheduler: a schedule or a callable taking the optimizer; else the config's `scheduler`.
        config_params: DeepSpeed's older name of `config`, used when `config` is None.
        args: parsed command-line arguments (see `add_config_arguments`); their `deepspeed_config`
            (or the deprecated `deepscale_config`) is the config's path when `config` and
            `config_params` are None.

    Returns:
        (engine, optimizer, dataloader or None, lr_scheduler or None); the optimizer is
        `engine.optimizer`, an `optim.optimizer.ZeroOptimizer` around the torch optimizer.

    Raises:
        ValueError, TypeError: a bad config key or value, naming the key, before any training; no
            config or two of them (`config` and `args.deepspeed_config`, or both command-line spellings).
    """
    if model is None:
        raise TypeError("initialize needs model, an nn.Module, got None")
    config = _config_source(config if config is not None else config_params, args)
    join = _ignored.get("dist_init_required", True) is not False  # DeepSpeed's initialize joins the group too
    world_size = _distributed()[0]
    if join and world_size == 1 and all(name in os.environ for name in TORCHRUN_VARIABLES):
        world_size = int(os.environ["WORLD_SIZE"])  # the group to be joined: the config is checked before it is
    parsed = parse_config(config, world_size)
    if join:
        init_distributed()
    _make_expert_groups(model)
    world_size, rank = _distributed()
    engine = Engine(model, parsed, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, world_size, rank) if world_size > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=parsed.train_micro_batch_size_per_gpu,
                                             sampler=sampler, shuffle=sampler is None)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _make_expert_groups(model: nn.Module) -> None:
    """Let layers built before the process group existed make their expert-parallel groups (DeepSpeed's
    `set_deepspeed_parallelism`, called on every module that has it, as DeepSpeed's engine does)."""
    for module in model.modules():
        make = getattr(module, "set_deepspeed_parallelism", None)
        if callable(make):
            make()


def _config_source(config, args):
    """The config from the call or from `args.deepspeed_config` / `args.deepscale_config`, as DeepSpeed takes it."""
    from_args = getattr(args, "deepspeed_config", None)
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is not None:
        if from_args is not None:
            raise ValueError(f"args.deepscale_config ({deepscale!r}) and args.deepspeed_config ({from_args!r}) "
                             "are both set; pass one, --deepspeed_config")
        warnings.warn("--deepscale_config is deprecated; use --deepspeed_config", DeprecationWarning, stacklevel=3)
        from_args = deepscale
    if from_args is not None and config is not None:
        raise ValueError(f"initialize got config and args.deepspeed_config ({from_args!r}); pass one of them")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize needs a config: pass config= (a dict or JSON path), config_params=, or "
                         "args= with --deepspeed_config PATH parsed (see optim.add_config_arguments)")
    return config
