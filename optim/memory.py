"""Memory: the accounting of model states (`model_state_bytes`, the engine's `memory_breakdown()`) and
the bytes a stretch of work really allocates (`LiveBytes`).

`model_state_bytes` counts what the ZeRO units hold by kind, as the ZeRO paper's accounting does:
master weights kept apart from the model's parameters (fp32 copies of fp16/bf16 weights) count as
optimizer states.

`LiveBytes` is a TorchDispatchMode that watches every tensor storage created under it until it is
freed (as a caching allocator would hold it): `live` is what those storages hold now, `peak` the
most they held at once. It runs on any device, meta included (a simulated GPU), and costs a
dictionary update per new storage, so it is for measuring, not for every step. On CUDA,
`torch.cuda.max_memory_allocated` gives the allocator's own figure for the same stretch.
"""

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveBytes", "model_state_bytes"]


def model_state_bytes(units, optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict:
    """This rank's bytes of parameters, gradients and optimizer states.

    Args:
        units: the engine's ZeRO units (optim.zero.Unit).
        optimizer: the optimizer stepping on the units' proxies.
        module: the model (its frozen parameters count as dense parameters).

    Returns:
        {"parameters", "gradients", "optimizer_states", "total"} in bytes, and the same three for
        "dense" and "expert" parameters separately.
    """
    parts = {kind: {"parameters": 0, "gradients": 0, "optimizer_states": 0} for kind in ("dense", "expert")}
    managed = set()
    for unit in units:
        kind = parts["expert" if unit.expert else "dense"]
        held = unit.tensors()
        kind["parameters"] += sum(_nbytes(t) for t in held["parameters"])
        kind["gradients"] += sum(_nbytes(t) for t in held["gradients"])
        kind["optimizer_states"] += sum(_nbytes(t) for t in held["master"])
        states = optimizer.unit_states(unit) if hasattr(optimizer, "unit_states") else \
            [(unit.infos, optimizer.state.get(unit.proxy, {}))]
        for _, state in states:
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    kind["optimizer_states"] += _nbytes(value)
        managed.update(id(info.param) for info in unit.infos)
    for param in module.parameters():
        if id(param) not in managed:  # frozen parameters
            parts["dense"]["parameters"] += _nbytes(param.to_local() if hasattr(param, "to_local") else param)
    report = {key: parts["dense"][key] + parts["expert"][key] for key in parts["dense"]}
    report["total"] = sum(report.values())
    return {**report, **parts}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created under it that are still alive (`live`), and their `peak`.

    Views and in-place results share their storage and count once; DTensors count through their
    local tensors. Storages created before the mode was entered are not counted, even when they are
    freed under it.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the inputs' storages before the op: `set_` (how torch.load builds tensors) gives its input a new one
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and not hasattr(t, "to_local")}
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and not hasattr(tensor, "to_local"):
                storage = tensor.untyped_storage()
                key = storage._cdata
                # a new storage: views and in-place results share an input's (possibly made before the mode)
                if key not in self._seen and key not in inputs:
                    self._seen.add(key)
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, key, storage.nbytes())
        return out
