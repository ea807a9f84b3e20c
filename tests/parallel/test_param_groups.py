"""Optimizer param groups for MoE models (parallel.param_groups): an MoE layer's expert parameters are
tagged and move into groups of their own, flagged `moe`, split by size, with the input group's options;
a group already flagged `moe` and named keeps its name."""

import pytest
import torch
from torch import nn

from moe import MoE, is_moe_param, split_params_into_different_moe_groups_for_optimizer


def _mlp(m=8, h=12, act=nn.GELU, bias=True):
    return nn.Sequential(nn.Linear(m, h, bias=bias), act(), nn.Linear(h, m, bias=bias))


def test_expert_parameters_are_tagged_and_split_into_moe_groups():
    layer = MoE(8, _mlp(), num_experts=4, k=1, use_residual=True)
    expert_params = list(layer.deepspeed_moe.experts.parameters())
    assert all(is_moe_param(p) and p.group_name == "ep_size_1" for p in expert_params)
    assert not is_moe_param(layer.deepspeed_moe.gate.wg.weight)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(layer.parameters()), "name": "parameters", "lr": 0.1}, max_group_size=8 * 12 * 4 + 12 * 4
    )
    dense, moe_groups = groups[0], groups[1:]
    assert dense["name"] == "parameters" and not any(is_moe_param(p) for p in dense["params"])
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.1 for g in moe_groups)
    # weight1 (384), weight2 (384), bias1 (48), bias2 (32) packed greedily into groups of <= 432 elements
    assert [sum(p.numel() for p in g["params"]) for g in moe_groups] == [384, 432, 32]
    assert sum(len(g["params"]) for g in moe_groups) == len(expert_params)
    torch.optim.AdamW(groups)  # the groups are valid optimizer input


def test_a_group_already_flagged_moe_and_named_keeps_its_name():
    layer = MoE(8, _mlp(), num_experts=4, k=1)
    experts = list(layer.deepspeed_moe.experts.parameters())
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [layer.deepspeed_moe.gate.wg.weight], "name": "dense"},
         {"params": experts, "name": "my_experts", "moe": True, "lr": 0.5}], max_group_size=None)
    moe_groups = [g for g in groups if g["params"] and g.get("moe")]
    assert [(g["name"], g["lr"], len(g["params"])) for g in moe_groups] == [("my_experts", 0.5, len(experts))]


def test_groups_follow_each_expert_group_name_and_size_limit_in_order():
    dense, big, small, other = (nn.Parameter(torch.zeros(n)) for n in (3, 10, 4, 2))
    extra = nn.Parameter(torch.zeros(5))
    for param, name in ((big, "ep_size_2"), (small, "ep_size_2"), (extra, "ep_size_2"), (other, "ep_size_4")):
        param.allreduce, param.group_name = False, name
    groups = split_params_into_different_moe_groups_for_optimizer(
        ({"params": [dense, big, small, other, extra], "lr": 0.3}, {"params": [nn.Parameter(torch.zeros(1))]}),
        max_group_size=9)
    assert [g["name"] for g in groups] == ["group_0", "group_1", "ep_size_2", "ep_size_2", "ep_size_4"]
    assert groups[0]["params"] == [dense] and not groups[0].get("moe")
    # 10 elements exceed 9 and stand alone; 4 + 5 fit together; each expert group keeps the input group's lr
    assert [[p.numel() for p in g["params"]] for g in groups[2:]] == [[10], [4, 5], [2]]
    assert all(g["moe"] and g["lr"] == 0.3 for g in groups[2:])


def test_param_groups_of_another_type_are_refused():
    with pytest.raises(TypeError, match="param_groups must be a dict or a list/tuple of dicts with 'params', got set"):
        split_params_into_different_moe_groups_for_optimizer({nn.Parameter(torch.zeros(1))})
