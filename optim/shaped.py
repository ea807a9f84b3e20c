"""Per-parameter views of the ZeRO shards, for optimizers whose update reads each parameter's shape.

The engine's optimizer steps on one flat proxy per unit (`optim.zero`), which suits elementwise
updates. Adafactor factors each parameter's second moment by its rows and columns and scales by its
RMS, and Muon orthogonalises each 2-D parameter: on a flat proxy their updates would change. So for
them the optimizer steps on one view per parameter, shaped like it, of the unit's proxy and of its
gradient: a hook before each step points the views at the proxy as it is then (a step on a copy
replaces it), and one after lets go of them. The updates land in the proxy's storage.

A view is only possible where this rank holds each parameter whole: ZeRO stage 0, or any stage in
one process (or on a group of one); stages that cut parameters across ranks are refused, naming why.
"""

import torch
from torch import nn

__all__ = ["SHAPED", "ShapedViews"]

SHAPED = ("Adafactor", "Muon")  # torch.optim classes whose update reads each parameter's shape


def shaped(optimizer) -> bool:
    """Whether `optimizer` is (or derives from) a torch.optim class whose update reads parameter shapes."""
    return any(cls.__module__.startswith("torch.optim") and cls.__name__ in SHAPED for cls in type(optimizer).__mro__)


class ShapedViews:
    """One view per parameter of each unit's proxy, for a shape-reading optimizer.

    Args:
        units: the engine's units.
        name: the optimizer's class name, for messages.

    Raises:
        ValueError: a unit holds only a slice of some parameter on this rank (ZeRO stages 1-3 across ranks).
    """

    def __init__(self, units: list, name: str):
        self.by_unit = {}
        for unit in units:
            spans = _spans(unit)
            if spans is None:
                raise ValueError(f"optimizer {name} reads each parameter's shape, but ZeRO stage {getattr(unit, 'stage', 3)} "
                                 "cuts parameters across ranks here; use stage 0 (or one process), or an "
                                 "elementwise optimizer (AdamW, Adam, SGD, ...)")
            dtype, device = unit.proxy.dtype, unit.weights.device
            self.by_unit[id(unit)] = (unit, [(info, start, stop, nn.Parameter(torch.empty(0, dtype=dtype, device=device)))
                                             for info, start, stop in spans])

    def of(self, unit) -> list[tuple[object, nn.Parameter]]:
        """(ParamInfo, view) for each parameter of `unit`."""
        return [(info, view) for info, _, _, view in self.by_unit[id(unit)][1]]

    def point(self, *_) -> None:
        """Before a step: each view is its parameter's piece of the proxy, and of the proxy's gradient."""
        for unit, entries in self.by_unit.values():
            data, grad = unit.proxy.data.view(-1), unit.proxy.grad  # views: the step must update the proxy
            grad = None if grad is None else grad.view(-1)
            for info, start, stop, view in entries:
                shape = info.param.shape
                view.data = data[start:stop].view(shape)
                view.grad = None if grad is None else grad[start:stop].view(shape)

    def release(self, *_) -> None:
        """After a step: the views hold nothing (the proxy's copy and gradient are freed with it)."""
        for _, entries in self.by_unit.values():
            for _, _, _, view in entries:
                view.data, view.grad = torch.empty(0, dtype=view.dtype, device=view.device), None

    def hook(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self.point)
        optimizer.register_step_post_hook(self.release)


def _spans(unit) -> list[tuple[object, int, int]] | None:
    """(info, start, stop) of each parameter in the unit's proxy, or None where this rank holds a slice."""
    offsets = getattr(unit, "offsets", None)
    if offsets is None:  # a stage-3 shard: whole only on a mesh of one rank
        info = unit.infos[0]
        whole = tuple(unit.weights.shape) == tuple(info.param.shape)
        return [(info, 0, unit.weights.numel())] if whole else None
    if unit.lo != 0 or unit.shard < unit.total:
        return None
    return [(info, offset, offset + numel) for info, offset, numel in zip(unit.infos, offsets, unit.numels)]
