"""Process groups for expert parallelism: data-parallel, expert-parallel, expert-data-parallel.

With world size W and expert-parallel size e (e divides W), the default layout puts expert-parallel
groups on blocks of e consecutive ranks and expert-data-parallel groups on the ranks with the same
position in their block (W / e ranks each); the data-parallel group is everyone. With
`use_data_before_expert_parallel=True` (DeepSpeed's `use_data_before_expert_parallel_`) the two are
swapped: expert-data-parallel groups are blocks of W / e consecutive ranks and expert-parallel groups
stride across them. Groups are built once per layout and cached; `reset_groups` forgets them (tests).
"""

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["ExpertGroups", "expert_groups", "expert_layout", "expert_mesh", "groups_for_name", "data_meshes", "reset_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's groups for one expert-parallel size."""

    ep_size: int
    ep_rank: int
    ep_group: object
    edp_size: int
    edp_rank: int
    edp_group: object
    dp_group: object
    dp_rank: int
    dp_size: int
    use_data_before_expert_parallel: bool = False


_CACHE: dict[tuple[int, bool], ExpertGroups] = {}
_BY_NAME: dict[str, ExpertGroups] = {}
_MESHES: dict[tuple, tuple[DeviceMesh, DeviceMesh]] = {}


def expert_layout(world_size: int, ep_size: int, use_data_before_expert_parallel: bool = False):
    """The rank lists of every expert-parallel group and every expert-data-parallel group.

    Raises:
        ValueError: ep_size does not divide world_size.
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size:
        raise ValueError(f"ep_size ({ep_size}) must be a positive divisor of the world size ({world_size})")
    edp_size = world_size // ep_size
    if use_data_before_expert_parallel:
        edp_groups = [list(range(b * edp_size, (b + 1) * edp_size)) for b in range(ep_size)]
        ep_groups = [list(range(i, world_size, edp_size)) for i in range(edp_size)]
    else:
        ep_groups = [list(range(b * ep_size, (b + 1) * ep_size)) for b in range(edp_size)]
        edp_groups = [list(range(i, world_size, ep_size)) for i in range(ep_size)]
    return ep_groups, edp_groups


def expert_groups(ep_size: int, use_data_before_expert_parallel: bool = False) -> ExpertGroups:
    """This rank's groups for `ep_size`, built on first call (by every rank, in the same order).

    Raises:
        RuntimeError: torch.distributed is not initialised (call parallel.init_distributed under torchrun).
        ValueError: ep_size does not divide the world size.
    """
    key = (ep_size, use_data_before_expert_parallel)
    if key in _CACHE:
        return _CACHE[key]
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"ep_size ({ep_size}) > 1 needs torch.distributed: launch with torchrun (optim.initialize, or an "
            "MoE layer's first forward, then joins the process group) or call parallel.init_distributed()"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    ep_lists, edp_lists = expert_layout(world, ep_size, use_data_before_expert_parallel)
    mine_ep = mine_edp = None
    for ranks in ep_lists:  # every rank creates every group, in the same order
        group = dist.new_group(ranks)
        if rank in ranks:
            mine_ep, ep_rank = group, ranks.index(rank)
    for ranks in edp_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine_edp, edp_rank = group, ranks.index(rank)
    groups = ExpertGroups(ep_size, ep_rank, mine_ep, world // ep_size, edp_rank, mine_edp, dist.group.WORLD, rank, world,
                          use_data_before_expert_parallel)
    _CACHE[key] = _BY_NAME[f"ep_size_{ep_size}"] = groups
    return groups


def groups_for_name(group_name: str, use_data_before_expert_parallel: bool | None = None) -> ExpertGroups:
    """The groups behind an expert group name ("ep_size_<e>", as MoE layers tag their parameters).

    Args:
        group_name: the name.
        use_data_before_expert_parallel: the layout the parameters were tagged with (None: the cached
            groups of that name, else the default layout). Given, it also rebuilds the right groups
            after `reset_groups`.

    Raises:
        ValueError: the name is not of the form ep_size_<e>, or names groups built with the other layout.
    """
    cached = _BY_NAME.get(group_name)
    if cached is not None and use_data_before_expert_parallel in (None, cached.use_data_before_expert_parallel):
        return cached
    size = group_name.removeprefix("ep_size_")
    if not size.isdigit():
        raise ValueError(f"expert group name must look like 'ep_size_<e>', got {group_name!r}")
    if cached is not None:
        raise ValueError(
            f"expert group {group_name!r} exists with use_data_before_expert_parallel="
            f"{cached.use_data_before_expert_parallel}; one ep size takes one layout in a process"
        )
    return expert_groups(int(size), bool(use_data_before_expert_parallel))


def data_meshes(ep_size: int, use_data_before_expert_parallel: bool = False,
                device_type: str = "cpu") -> tuple[DeviceMesh, DeviceMesh]:
    """(the 1-D data-parallel mesh, this rank's 1-D expert-data-parallel mesh), built once per layout."""
    key = (ep_size, use_data_before_expert_parallel, device_type)
    if key not in _MESHES:
        world = dist.get_world_size()
        expert_layout(world, ep_size)
        dp_mesh = init_device_mesh(device_type, (world,), mesh_dim_names=("dp",))
        if use_data_before_expert_parallel:
            mesh = init_device_mesh(device_type, (ep_size, world // ep_size), mesh_dim_names=("ep", "edp"))
        else:
            mesh = init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
        _MESHES[key] = (dp_mesh, mesh["edp"])
    return _MESHES[key]


def expert_mesh(ep_size: int, device_type: str = "cpu") -> DeviceMesh:
    """The default layout as a 2-D DeviceMesh with dimensions ("edp", "ep")."""
    world = dist.get_world_size()
    expert_layout(world, ep_size)
    return init_device_mesh(device_type, (world // ep_size, ep_size), mesh_dim_names=("edp", "ep"))


def reset_groups() -> None:
    """Forget cached groups (the process group itself is left alone)."""
    _CACHE.clear()
    _BY_NAME.clear()
    _MESHES.clear()
