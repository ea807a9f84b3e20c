"""Process groups, all-to-all and the expert-parameter tags shared by `moe` and `optim`."""

from parallel.tags import is_moe_param, tag_expert_parameters

__all__ = ["is_moe_param", "tag_expert_parameters"]
