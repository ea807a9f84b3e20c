"""Expert-parallel process groups: the rank layout of the ep and edp groups, the DeviceMesh over them,
DeepSpeed's data-before-expert ordering, and layouts that cannot be built, on 4 gloo ranks."""

import pytest
import torch.distributed as dist
from torch import nn

from moe import MoE
from parallel import expert_groups, expert_layout, expert_mesh, reset_groups
from tests.distributed import run_distributed

M = 8


def _bad_layouts(rank, world):
    reset_groups()
    groups = expert_groups(2)
    assert (groups.ep_size, groups.edp_size, groups.dp_size, groups.dp_rank) == (2, 2, 4, rank)
    assert dist.get_process_group_ranks(groups.ep_group) == expert_layout(4, 2)[0][rank // 2]
    assert dist.get_process_group_ranks(groups.edp_group) == expert_layout(4, 2)[1][rank % 2]
    assert expert_groups(2) is groups, "groups are built once per size"
    mesh = expert_mesh(2)
    assert dist.get_process_group_ranks(mesh.get_group("ep")) == dist.get_process_group_ranks(groups.ep_group)
    assert dist.get_process_group_ranks(mesh.get_group("edp")) == dist.get_process_group_ranks(groups.edp_group)
    with pytest.raises(ValueError, match=r"ep_size \(3\) must be a positive divisor of the world size \(4\)"):
        MoE(M, nn.Linear(M, M), num_experts=6, ep_size=3)
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by ep_size \(4\)"):
        MoE(M, nn.Linear(M, M), num_experts=6, ep_size=4)


def test_groups_mesh_and_bad_layouts_on_every_rank():
    run_distributed(_bad_layouts, 4)


def test_layouts_and_data_before_expert_ordering():
    assert expert_layout(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert expert_layout(4, 2, True) == ([[0, 2], [1, 3]], [[0, 1], [2, 3]])
    assert expert_layout(8, 4)[1] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="must be a positive divisor"):
        expert_layout(6, 4)
