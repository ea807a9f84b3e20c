"""Memory as it is: the bytes a stretch of work really allocates, beside `memory_breakdown()`'s accounting.

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

__all__ = ["LiveBytes"]


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
