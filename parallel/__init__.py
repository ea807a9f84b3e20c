"""Process groups, all-to-all and the expert-parameter tags shared by `moe` and `optim`."""

from parallel.accelerator import accelerator_name, get_accelerator
from parallel.all_to_all import all_to_all, exchange_counts
from parallel.distributed import init_distributed, local_device
from parallel.groups import (
    ExpertGroups, data_meshes, expert_groups, expert_layout, expert_mesh, groups_for_name, reset_groups,
)
from parallel.param_groups import split_group, split_params_into_different_moe_groups_for_optimizer
from parallel.tags import (
    data_before_expert, expert_ids, is_moe_param, is_template_copy, tag_expert_ids, tag_expert_parameters, tag_template_copy,
)

__all__ = [
    "ExpertGroups", "accelerator_name", "all_to_all", "data_before_expert", "data_meshes", "exchange_counts", "expert_groups", "expert_ids",
    "expert_layout", "expert_mesh", "get_accelerator", "groups_for_name", "init_distributed", "is_moe_param",
    "is_template_copy", "local_device", "reset_groups", "split_group",
    "split_params_into_different_moe_groups_for_optimizer", "tag_expert_ids", "tag_expert_parameters",
    "tag_template_copy",
]
