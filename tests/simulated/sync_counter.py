"""Count host syncs: the operations that make a GPU wait until the host has read a device value."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that read device values on the host; repeat_interleave and bincount size their output from the data.
_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
          "aten.bincount.default", "aten.unique_dim.default", "aten._unique2.default"}


def _has_bool_index(args) -> bool:
    for arg in args:
        if isinstance(arg, (list, tuple)) and any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in arg):
            return True
    return False


class SyncCounter(TorchDispatchMode):
    """Records every host sync under it: scalar reads (`.item()`, `bool()`, `int()`), `tolist`, `nonzero`,
    boolean-mask indexing, and repeat_interleave without `output_size`."""

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name in _READS:
            self.syncs.append(name)
        elif name.startswith(("aten.index.", "aten.index_put")) and _has_bool_index(args):
            self.syncs.append(name + " (boolean mask)")
        elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None \
                and not (len(args) > 3 and args[3] is not None):
            self.syncs.append(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_syncs():
    """A SyncCounter that also sees Tensor.tolist (which reads CPU memory without dispatching an op)."""
    counter = SyncCounter()
    original = torch.Tensor.tolist

    def tolist(tensor):
        counter.syncs.append("tolist")
        return original(tensor)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original
