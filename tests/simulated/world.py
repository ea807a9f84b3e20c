"""The simulated GPU world for tests: `recipes.common.simulated` plus a log of every collective.

`simulated_world(monkeypatch, world_size, rank)` yields a CollectiveLog whose `reads` are the
HostReads of recipes.common.simulated; every collective's tensors must be on the model's device (meta).
"""

import contextlib
import functools

import torch
import torch.distributed as dist

from recipes.common.simulated import META, simulated_world as _simulated_world

__all__ = ["META", "CollectiveLog", "simulated_world"]

# Both spellings of the single-tensor collectives: each torch has one or both (parallel.comm.ALL_GATHER_NAME).
COLLECTIVES = ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
               "all_gather", "reduce_scatter", "all_gather_single", "reduce_scatter_single", "all_to_all", "reduce")


class CollectiveLog:
    """Wraps torch.distributed's collectives: checks each tensor's device and counts the calls."""

    def __init__(self, device: torch.device):
        self.device, self.calls, self.reads = device, [], None

    def _check(self, name, value):
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                assert local.device.type == self.device.type, \
                    f"{name} got a tensor on {local.device}, the model is on {self.device} (NCCL refuses it)"

    def wrap(self, name, function):
        @functools.wraps(function)
        def recorded(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                self._check(name, value)
            self.calls.append(name)
            return function(*args, **kwargs)

        return recorded

    def count(self, name: str) -> int:
        return self.calls.count(name)


@contextlib.contextmanager
def simulated_world(monkeypatch, world_size: int, rank: int, rows_per_rank: int = 0):
    log = CollectiveLog(META)
    with _simulated_world(world_size, rank, rows_per_rank) as reads:
        log.reads = reads
        for name in COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, log.wrap(name, getattr(dist, name)))
        yield log
