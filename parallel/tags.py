"""Expert-parameter tags: the one place that marks parameters as expert parameters and reads the mark.

The optimizer side never imports MoE classes; it learns which parameters belong to experts, and to
which expert-data-parallel group, from two attributes set here (DeepSpeed's names):
`param.allreduce = False` and `param.group_name = "<group>"`.
"""

from collections.abc import Iterable

import torch

__all__ = ["tag_expert_parameters", "is_moe_param"]


def tag_expert_parameters(params: Iterable[torch.nn.Parameter], group_name: str) -> None:
    """Mark parameters as expert parameters reduced over the expert-data-parallel group `group_name`.

    Args:
        params: the expert parameters.
        group_name: name of their expert-data-parallel group, e.g. "ep_size_2".

    Raises:
        TypeError: if group_name is not a non-empty string.
    """
    if not isinstance(group_name, str) or not group_name:
        raise TypeError(f"group_name must be a non-empty string, got {group_name!r}")
    for param in params:
        param.allreduce = False
        param.group_name = group_name


def is_moe_param(param: torch.Tensor) -> bool:
    """True when `param` was tagged as an expert parameter."""
    return hasattr(param, "allreduce") and not param.allreduce
