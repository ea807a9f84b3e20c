"""Process groups, all-to-all and the expert-parameter tags shared by `moe` and `optim`."""

from parallel.all_to_all import all_to_all, exchange_counts
from parallel.distributed import init_distributed
from parallel.groups import ExpertGroups, expert_groups, expert_layout, expert_mesh, reset_groups
from parallel.tags import is_moe_param, tag_expert_parameters

__all__ = [
    "ExpertGroups", "all_to_all", "exchange_counts", "expert_groups", "expert_layout", "expert_mesh",
    "init_distributed", "is_moe_param", "reset_groups", "tag_expert_parameters",
]
