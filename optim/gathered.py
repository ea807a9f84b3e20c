"""`GatheredParameters`: DeepSpeed's ZeRO-3 context manager for reading or writing whole parameters.

At stage 3 (torch's `fully_shard`) each rank holds a shard of a parameter. Inside the context the
module attribute of each parameter given is its whole value, gathered over the parameter's own mesh
(the data-parallel ranks for dense parameters, the expert-data-parallel ranks for experts). On exit,
with `modifier_rank` set, that rank's value is broadcast over the mesh and written into every rank's
shard, where the engine's optimizer steps on it; the sharded parameter is put back either way. At
stages 0-2, and without a process group, parameters are whole already and the context does nothing.
"""

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GatheredParameters", "register_sharded"]


def register_sharded(module: nn.Module) -> None:
    """Tag each parameter of `module` with its module and attribute name, after fully_shard replaced
    them (optim.fsdp), so the context can put whole parameters in their place."""
    for sub in module.modules():
        for name, param in sub._parameters.items():
            if param is not None:
                param.sharded_owner = (sub, name)


def _owner(param: torch.Tensor) -> tuple[nn.Module, str] | None:
    """The module and attribute name of a parameter `register_sharded` tagged, while it is still there."""
    owner = getattr(param, "sharded_owner", None)
    if owner is None or owner[0]._parameters.get(owner[1]) is not param:
        return None
    return owner


class GatheredParameters:
    """Whole parameters inside a `with` block (DeepSpeed's `deepspeed.zero.GatheredParameters`).

    Every rank of each parameter's mesh enters and leaves the block together (collective).

    Args:
        params: a parameter or an iterable of them (None entries are skipped).
        modifier_rank: the global rank whose changes are kept; None: the block only reads. For an
            expert parameter whose expert-data-parallel ranks do not include it, the first of them.
        fwd_module: DeepSpeed's, for parameters used outside their module; accepted without effect.
        enabled: False makes the context do nothing.

    Raises:
        ValueError: modifier_rank is not a rank of the world.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module: nn.Module | None = None,
                 enabled: bool = True):
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if modifier_rank is not None and not (isinstance(modifier_rank, int) and 0 <= modifier_rank < world):
            raise ValueError(f"modifier_rank must be None or a rank in [0, {world}), got {modifier_rank!r}")
        self.modifier_rank = modifier_rank
        self.params = [p for p in params if enabled and p is not None and _owner(p) is not None]
        self._whole = []

    def __enter__(self):
        for param in self.params:
            module, name = _owner(param)
            whole = nn.Parameter(param.detach().full_tensor(), requires_grad=param.requires_grad)
            module._parameters[name] = whole  # past nn.Module's checks: fully_shard swaps them the same way
            self._whole.append((module, name, whole))
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed.tensor import distribute_tensor

        for param, (module, name, whole) in zip(self.params, self._whole):
            module._parameters[name] = param
            if self.modifier_rank is None or exc[0] is not None:
                continue
            group = param.device_mesh.get_group()
            ranks = dist.get_process_group_ranks(group)
            source = self.modifier_rank if self.modifier_rank in ranks else ranks[0]
            value = whole.detach().to(param.dtype)
            dist.broadcast(value, src=source, group=group)
            shard = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
            with torch.no_grad():
                param.to_local().copy_(shard.to_local())
        self._whole = []
