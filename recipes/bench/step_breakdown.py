"""Where a training step's time goes, layer by layer: wall-clock timers on the feed-forward blocks.

`StepBreakdown(model)` puts forward hooks on every block's feed-forward module (the MoE layer, ours or
DeepSpeed's, or the dense MLP) and, for MoE layers, on the gate and the experts inside. Each training
forward (grad enabled; evaluation forwards are not timed) is timed from its pre-hook to its hook; its
backward from the moment the gradient of the module's output exists (a tensor hook) to the moment the
gradient of its input does, paired call by call. For an MoE layer the rest of its time is, per call, the
layer's time less the gate's and the experts' in the forward (dispatch, combine, the layer's
bookkeeping), and less the experts' in the backward (dispatch, combine and the router's backward). The
optimizer's step is timed by its own step hooks.

These are wall clocks on the calling thread, as `time.perf_counter` reads them, with no host sync: on
the CPU they are the time spent; on a GPU they would time the launches only. A backward window holds
whatever autograd runs between the two gradients: the module's own backward, the accumulation of its
weights' gradients, and any other node autograd takes first. `recipes.bench.gpt --breakdown` prints
them for each model it times: the MoE model, its dense twin and, with DeepSpeed, the model with its
layer.
"""

import statistics
import time
from collections import defaultdict

import torch
from torch import nn

__all__ = ["StepBreakdown"]


class StepBreakdown:
    """Timers on a GPT's feed-forward blocks (and its MoE layers' gate and experts) and its optimizer.

    Attributes:
        seconds: "<part> forward" / "<part> backward" / "optimizer step" -> the seconds of each call,
            in call order (a part is "block <i> MoE", "block <i> MLP", or "block <i> MoE gate" / "experts").

    Args:
        model: a module with a `blocks` list whose items have an `ffn` module (recipes.gpt_model.GPT).
        optimizer: the torch optimizer whose `step` is timed, or None.

    Raises:
        TypeError: if optimizer is neither None nor a torch.optim.Optimizer.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        self.seconds = defaultdict(list)
        self._started = {}  # a call's key -> its start time
        self._calls = defaultdict(list)  # part -> keys of its forwards under way (pre-hook to hook)
        self._handles = []
        self._layers = []  # (name, is an MoE layer), in model order
        for i, block in enumerate(model.blocks):
            ffn = block.ffn
            is_moe = hasattr(ffn, "deepspeed_moe")  # ours, or DeepSpeed's MoE layer (recipes.bench.gpt's third model)
            name = f"block {i} {'MoE' if is_moe else 'MLP'}"
            self._layers.append((name, is_moe))
            self._time(ffn, name)
            if is_moe:
                self._time(ffn.deepspeed_moe.gate, f"{name} gate", backward=False)
                self._time(ffn.deepspeed_moe.experts, f"{name} experts")
        if optimizer is not None:
            step = "optimizer step"
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._start(step)))
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self._stop(step, step)))

    def _start(self, key) -> None:
        self._started[key] = time.perf_counter()

    def _stop(self, key, part: str) -> None:
        start = self._started.pop(key, None)
        if start is not None:
            self.seconds[part].append(time.perf_counter() - start)

    def _time(self, module: nn.Module, name: str, backward: bool = True) -> None:
        """Training forwards of `module` from its pre-hook to its hook; their backward from the output's
        gradient to the input's (a key per call pairs the two gradient hooks of one call)."""

        def before(_, args):
            if not torch.is_grad_enabled():
                return
            key = object()
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            timed = backward and x is not None and x.requires_grad
            if timed:
                x.register_hook(lambda grad: self._stop(("backward", key), f"{name} backward"))
            self._calls[name].append((key, timed))
            self._start(("forward", key))

        def after(_, args, output):
            if not torch.is_grad_enabled() or not self._calls[name]:
                return
            key, timed = self._calls[name].pop()
            self._stop(("forward", key), f"{name} forward")
            y = output[0] if isinstance(output, tuple) else output
            if timed and isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(lambda grad: self._start(("backward", key)))

        self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def clear(self) -> None:
        """Forget the times so far (the untimed steps')."""
        self.seconds.clear()
        self._started.clear()
        self._calls.clear()

    def remove(self) -> None:
        """Take every hook off the model and the optimizer; the times so far stay."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def medians(self) -> dict[str, float]:
        """Median ms per call of each part.

        Returns:
            "<part> forward" / "<part> backward" / "optimizer step" -> ms; for each MoE layer also
            "<layer> rest forward" (the layer less its gate and experts) and "<layer> rest backward"
            (less its experts), each the median of the per-call differences.
        """
        ms = {part: 1e3 * statistics.median(times) for part, times in self.seconds.items() if times}
        for name in (name for name, is_moe in self._layers if is_moe):
            parts = {"forward": (f"{name} gate forward", f"{name} experts forward"),
                     "backward": (f"{name} experts backward",)}
            for direction, inner in parts.items():
                whole = self.seconds.get(f"{name} {direction}")
                if not whole or not all(len(self.seconds.get(p, ())) == len(whole) for p in inner):
                    continue
                rest = [total - sum(self.seconds[p][i] for p in inner) for i, total in enumerate(whole)]
                ms[f"{name} rest {direction}"] = 1e3 * statistics.median(rest)
        return ms

    def lines(self) -> list[str]:
        """The table of `medians` in model order, forward and backward side by side.

        Returns:
            one string per line: a header, then "block <i> MLP|MoE", and under an MoE layer its gate,
            experts and rest, then the optimizer step; "-" where a part has no time.
        """
        ms = self.medians()

        def cell(key: str) -> str:
            return f"{ms[key]:9.2f}" if key in ms else f"{'-':>9}"

        calls = len(self.seconds.get(f"{self._layers[0][0]} forward", ())) if self._layers else 0
        out = [f"{'part':<36} {'forward':>9} {'backward':>9}  (median ms of {calls} calls)"]
        for name, is_moe in self._layers:
            parts = [(name, name)]
            if is_moe:
                parts += [("  gate (router, plan)", f"{name} gate"), ("  experts", f"{name} experts"),
                          ("  dispatch, combine, the rest", f"{name} rest")]
            out += [f"{label:<36} {cell(key + ' forward')} {cell(key + ' backward')}" for label, key in parts]
        if "optimizer step" in ms:
            out.append(f"{'optimizer step':<36} {ms['optimizer step']:9.2f}")
        return out
