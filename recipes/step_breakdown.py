"""Where a training step's time goes, layer by layer: wall-clock timers on the feed-forward blocks.

`StepBreakdown(model)` puts forward hooks on every block's feed-forward module (the MoE layer or the
dense MLP) and, for MoE layers, on the gate and the experts inside. Each forward is timed from its
pre-hook to its hook; each backward from the moment the gradient of the module's output exists
(a tensor hook) to the moment the gradient of its input does. For an MoE layer the rest of its
time, dispatch and combine (with the gate's plan and the layer's bookkeeping), is the layer's time
less the gate's and the experts'. The optimizer's step is timed by its own step hooks.

These are wall clocks on the calling thread, as `time.perf_counter` reads them, with no host sync: on
the CPU they are the time spent; on a GPU they would time the launches only. A backward window holds
whatever autograd runs between the two gradients; in a plain stack of blocks that is the module's
own backward. `recipes.bench_gpt --breakdown` prints them for the MoE model and its dense twin.
"""

import statistics
import time
from collections import defaultdict

import torch
from torch import nn

from moe import MoE

__all__ = ["StepBreakdown"]


class StepBreakdown:
    """Timers on a GPT's feed-forward blocks (and its MoE layers' gate and experts) and its optimizer.

    Args:
        model: a module with a `blocks` list whose items have an `ffn` module (recipes.gpt_model.GPT).
        optimizer: the optimizer whose `step` is timed, or None.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.seconds = defaultdict(list)  # "<part> forward" / "<part> backward" -> one time per call
        self._started = {}
        self._handles = []
        self._layers = []  # (name, is an MoE layer), in model order
        for i, block in enumerate(model.blocks):
            ffn = block.ffn
            name = f"block {i} {'MoE' if isinstance(ffn, MoE) else 'MLP'}"
            self._layers.append((name, isinstance(ffn, MoE)))
            self._time(ffn, name)
            if isinstance(ffn, MoE):
                self._time(ffn.deepspeed_moe.gate, f"{name} gate", backward=False)
                self._time(ffn.deepspeed_moe.experts, f"{name} experts")
        if isinstance(optimizer, torch.optim.Optimizer):
            self._handles.append(optimizer.register_step_pre_hook(lambda *_: self._start("optimizer step")))
            self._handles.append(optimizer.register_step_post_hook(lambda *_: self._stop("optimizer step")))

    def _start(self, part: str) -> None:
        self._started[part] = time.perf_counter()

    def _stop(self, part: str) -> None:
        start = self._started.pop(part, None)
        if start is not None:
            self.seconds[part].append(time.perf_counter() - start)

    def _time(self, module: nn.Module, name: str, backward: bool = True) -> None:
        """Forward of `module` from its pre-hook to its hook; backward from its output's gradient to its input's."""

        def before(_, args):
            self._start(f"{name} forward")
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if backward and x is not None and x.requires_grad:
                x.register_hook(lambda grad: self._stop(f"{name} backward"))

        def after(_, args, output):
            self._stop(f"{name} forward")
            y = output[0] if isinstance(output, tuple) else output
            if backward and isinstance(y, torch.Tensor) and y.requires_grad:
                y.register_hook(lambda grad: self._start(f"{name} backward"))

        self._handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def clear(self) -> None:
        """Forget the times so far (the untimed steps')."""
        self.seconds.clear()
        self._started.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def medians(self) -> dict[str, float]:
        """Median ms per call of each part; for MoE layers also "dispatch and combine" (the layer less
        its gate and experts) in the forward, and in the backward the layer less its experts."""
        ms = {part: 1e3 * statistics.median(times) for part, times in self.seconds.items() if times}
        for part in list(ms):
            if part.endswith(" MoE forward") and f"{part[:-8]} gate forward" in ms:
                layer = part[:-8]
                ms[f"{layer} rest forward"] = ms[part] - ms[f"{layer} gate forward"] - ms.get(f"{layer} experts forward", 0.0)
            if part.endswith(" MoE backward") and f"{part[:-9]} experts backward" in ms:
                layer = part[:-9]
                ms[f"{layer} rest backward"] = ms[part] - ms[f"{layer} experts backward"]
        return ms

    def lines(self) -> list[str]:
        """A table in model order, median ms per step of each part, forward and backward."""
        ms = self.medians()

        def cell(key: str) -> str:
            return f"{ms[key]:9.2f}" if key in ms else f"{'-':>9}"

        out = [f"{'part':<36} {'forward':>9} {'backward':>9}  (median ms)"]
        for name, is_moe in self._layers:
            parts = [(name, name)]
            if is_moe:
                parts += [("  gate (router, plan)", f"{name} gate"), ("  experts", f"{name} experts"),
                          ("  dispatch, combine, the rest", f"{name} rest")]
            out += [f"{label:<36} {cell(key + ' forward')} {cell(key + ' backward')}" for label, key in parts]
        if "optimizer step" in self.seconds:
            out.append(f"{'optimizer step':<36} {ms['optimizer step']:9.2f}")
        return out
