"""parallel.tags, the expert-parameter marks `optim` reads instead of MoE classes: the expert flag and
group name (DeepSpeed's `allreduce = False`, `group_name`) with the group's rank layout, the global
expert ids a parameter holds, and the template-copy mark that any write clears."""

import pytest
import torch
from torch import nn

from parallel import (
    data_before_expert, expert_ids, is_moe_param, is_template_copy, tag_expert_ids, tag_expert_parameters,
    tag_template_copy,
)


def test_tagged_parameters_are_expert_parameters_of_their_group():
    expert, dense = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(3))
    assert not is_moe_param(expert) and not data_before_expert(expert)
    tag_expert_parameters([expert], "ep_size_2", use_data_before_expert_parallel=True)
    assert is_moe_param(expert) and expert.allreduce is False and expert.group_name == "ep_size_2"
    assert data_before_expert(expert)
    dense.allreduce = True  # DeepSpeed's flag on a dense parameter
    assert not is_moe_param(dense)
    tag_expert_parameters(iter([dense]), "ep_size_1")  # any iterable, as module.parameters() gives
    assert is_moe_param(dense) and dense.group_name == "ep_size_1" and not data_before_expert(dense)


@pytest.mark.parametrize("name", ["", None, 2])
def test_a_group_name_must_be_a_non_empty_string(name):
    param = nn.Parameter(torch.zeros(2))
    with pytest.raises(TypeError, match=rf"group_name must be a non-empty string, got {name!r}"):
        tag_expert_parameters([param], name)
    assert not is_moe_param(param)


def test_expert_ids_record_the_global_experts_a_parameter_holds():
    stacked, single = nn.Parameter(torch.zeros(2, 4)), nn.Parameter(torch.zeros(4))
    assert expert_ids(stacked) is None
    tag_expert_ids(stacked, (torch.tensor(2), 3), 0)
    assert expert_ids(stacked) == ((2, 3), 0, None, None) and all(type(i) is int for i in expert_ids(stacked)[0])
    tag_expert_ids(single, (5,), None, "deepspeed_experts.0.weight", "deepspeed_experts.5.weight")
    assert expert_ids(single) == ((5,), None, "deepspeed_experts.0.weight", "deepspeed_experts.5.weight")
    with pytest.raises(ValueError, match=r"a parameter of one expert must have one id, got \(1, 2\)"):
        tag_expert_ids(single, (1, 2), None)


def test_a_template_copy_stays_one_until_something_writes_into_it():
    untouched, stepped, loaded = (nn.Linear(2, 2) for _ in range(3))
    for module in (untouched, stepped, loaded):
        assert not is_template_copy(module.weight)
        tag_template_copy(module.weight)
        assert is_template_copy(module.weight)
    untouched.weight.sum().backward()  # reading, and gradients, are not writes
    assert is_template_copy(untouched.weight)
    stepped.weight.grad = torch.ones(2, 2)
    torch.optim.SGD([stepped.weight], lr=0.1).step()
    loaded.load_state_dict(nn.Linear(2, 2).state_dict())
    assert not is_template_copy(stepped.weight) and not is_template_copy(loaded.weight)
