"""DeepSpeed's `deepspeed.comm` surface over torch.distributed, so `import deepspeed.comm as dist` becomes
`import parallel.comm as dist`.

Scripts, MoE integrations and DeepSpeed's own MoE tests call `dist.get_rank()`, `dist.barrier()`,
`dist.all_reduce(t)` and friends through that module. Here each is torch.distributed's function of
the same name, with one difference: without a process group (a one-process run, which this project
runs without torchrun) the queries answer for one process (rank 0, world size 1) and the collectives
act as they would on a group of one (all_reduce, broadcast and barrier leave the tensor as it is,
all_gather copies it) instead of raising. The collectives take DeepSpeed's profiling keywords
(`prof`, `log_name`, `debug`) without effect; any other name of torch.distributed (`all_gather_object`,
`broadcast_object_list`, `gather`, `scatter`, `isend`, ...) is torch's own, reached through this module.

The all-gather into one tensor and the reduce-scatter from one tensor have two names in torch:
`all_gather_into_tensor` / `reduce_scatter_tensor` (torch 2.11) and `all_gather_single` /
`reduce_scatter_single` (torch 2.13, where the older names warn and forward to these).
`ALL_GATHER_NAME` and `REDUCE_SCATTER_NAME` pick the one the running torch has, by feature detection,
here and nowhere else; this module answers to both spellings on every torch, and `optim` calls them
through it.
"""

import os

import torch
import torch.distributed as _dist

from parallel.distributed import init_distributed

__all__ = [
    "ALL_GATHER_NAME", "REDUCE_SCATTER_NAME", "ReduceOp", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "all_reduce", "all_to_all_single", "barrier", "broadcast", "destroy_process_group", "get_global_rank",
    "get_local_rank", "get_rank", "get_world_group", "get_world_size", "init_distributed", "is_available",
    "is_initialized", "new_group", "recv", "reduce", "reduce_scatter_single", "reduce_scatter_tensor", "send",
]

ReduceOp = _dist.ReduceOp

# torch.distributed's names for the two single-tensor collectives on the running torch (see the module docstring).
ALL_GATHER_NAME = "all_gather_single" if hasattr(_dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_NAME = "reduce_scatter_single" if hasattr(_dist, "reduce_scatter_single") else "reduce_scatter_tensor"


def is_available() -> bool:
    return _dist.is_available()


def is_initialized() -> bool:
    """Whether a process group exists."""
    return _dist.is_available() and _dist.is_initialized()


def get_rank(group=None) -> int:
    """This process's rank in `group` (the world by default); 0 without a process group."""
    return _dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    """The number of processes in `group` (the world by default); 1 without a process group."""
    return _dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's rank on its node: LOCAL_RANK, 0 without it."""
    return int(os.environ.get("LOCAL_RANK", 0))


def get_global_rank(group, group_rank: int) -> int:
    """The world rank of `group`'s rank `group_rank`; the rank itself without a process group."""
    return _dist.get_global_rank(group, group_rank) if is_initialized() else group_rank


def get_world_group():
    return _dist.group.WORLD if is_initialized() else None


def new_group(ranks=None, **kwargs):
    return _dist.new_group(ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    if is_initialized():
        _dist.destroy_process_group(group)


def barrier(group=None, async_op: bool = False, device_ids=None, **_profiling):
    if is_initialized():
        return _dist.barrier(group, async_op, device_ids)
    return None


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **_profiling):
    """Reduce `tensor` in place over `group`; alone, the tensor is already the result."""
    if is_initialized():
        return _dist.all_reduce(tensor, op, group, async_op)
    return None


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **_profiling):
    if is_initialized():
        return _dist.reduce(tensor, dst, op, group, async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_profiling):
    if is_initialized():
        return _dist.broadcast(tensor, src, group, async_op)
    return None


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False, **_profiling):
    """Gather `tensor` from every rank into `tensor_list`; alone, its one entry is a copy of `tensor`."""
    if is_initialized():
        return _dist.all_gather(tensor_list, tensor, group, async_op)
    _one_process("all_gather", len(tensor_list))
    tensor_list[0].copy_(tensor)
    return None


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group=None, async_op: bool = False, **_profiling):
    """Gather the equal-sized `tensor` of every rank of `group` into `output`, in rank order.

    Calls torch.distributed's ALL_GATHER_NAME, looked up at each call; alone, `output` is a copy of `tensor`.
    """
    if is_initialized():
        return getattr(_dist, ALL_GATHER_NAME)(output, tensor, group, async_op)
    output.copy_(tensor.reshape(output.shape))
    return None


def reduce_scatter_single(output: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, **_profiling):
    """Reduce `tensor` over `group` and leave this rank's equal part in `output`.

    Calls torch.distributed's REDUCE_SCATTER_NAME, looked up at each call; alone, `output` is a copy of `tensor`.
    """
    if is_initialized():
        return getattr(_dist, REDUCE_SCATTER_NAME)(output, tensor, op, group, async_op)
    output.copy_(tensor.reshape(output.shape))
    return None


all_gather_into_tensor = all_gather_single  # DeepSpeed's and torch 2.11's name
reduce_scatter_tensor = reduce_scatter_single


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op: bool = False, **_profiling):
    if is_initialized():
        return _dist.all_to_all_single(output, tensor, output_split_sizes, input_split_sizes, group, async_op)
    output.copy_(tensor)
    return None


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    return _dist.send(tensor, dst, group, tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0):
    return _dist.recv(tensor, src, group, tag)


def _one_process(name: str, entries: int) -> None:
    if entries != 1:
        raise ValueError(f"{name} without a process group gathers from one rank: tensor_list must have 1 entry, "
                         f"got {entries}")


def __getattr__(name: str):
    """torch.distributed's other names, as deepspeed.comm also offers them."""
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(_dist, name)
