"""Expert-parameter tags: the one place that marks parameters as expert parameters and reads the mark.

The optimizer side never imports MoE classes; it learns which parameters belong to experts, and to
which expert-data-parallel group, from two attributes set here (DeepSpeed's names):
`param.allreduce = False` and `param.group_name = "<group>"`. So that checkpoints can store experts
by global id whatever the expert-parallel layout, a third attribute says which global experts a
parameter holds: `param.expert_ids = (ids, axis, local_suffix, global_suffix)`, where axis is the
dimension that stacks several experts (None for a parameter of one expert), and the two suffixes
rename the parameter from this layout's module path to the one-process path (None when equal).
A fourth, `param.template_copy`, marks an expert parameter built as a copy of the layer's expert
template (expert_init="copy") with the version counter it had then: while nothing has written into
it, `initialize` may start every rank's experts from rank 0's template, whatever the layout.
"""

from collections.abc import Iterable

import torch

__all__ = ["data_before_expert", "expert_ids", "is_moe_param", "is_template_copy", "tag_expert_ids", "tag_expert_parameters",
           "tag_template_copy"]


def tag_expert_parameters(params: Iterable[torch.nn.Parameter], group_name: str,
                          use_data_before_expert_parallel: bool = False) -> None:
    """Mark parameters as expert parameters reduced over the expert-data-parallel group `group_name`.

    Args:
        params: the expert parameters.
        group_name: name of their expert-data-parallel group, e.g. "ep_size_2".
        use_data_before_expert_parallel: the rank layout of that group (see parallel.groups), kept
            on the parameter so the group can be rebuilt from the tags alone.

    Raises:
        TypeError: if group_name is not a non-empty string.
    """
    if not isinstance(group_name, str) or not group_name:
        raise TypeError(f"group_name must be a non-empty string, got {group_name!r}")
    for param in params:
        param.allreduce = False
        param.group_name = group_name
        param.use_data_before_expert_parallel = bool(use_data_before_expert_parallel)


def data_before_expert(param: torch.Tensor) -> bool:
    """The rank layout an expert parameter's group was built with (False when untagged)."""
    return bool(getattr(param, "use_data_before_expert_parallel", False))


def is_moe_param(param: torch.Tensor) -> bool:
    """True when `param` was tagged as an expert parameter."""
    return hasattr(param, "allreduce") and not param.allreduce


def tag_expert_ids(param: torch.nn.Parameter, ids: tuple[int, ...], axis: int | None,
                   local_suffix: str | None = None, global_suffix: str | None = None) -> None:
    """Record the global expert ids a parameter holds (stacked along `axis`, or one expert when None)."""
    if axis is None and len(ids) != 1:
        raise ValueError(f"a parameter of one expert must have one id, got {ids}")
    param.expert_ids = (tuple(int(i) for i in ids), axis, local_suffix, global_suffix)


def expert_ids(param: torch.Tensor):
    """(ids, axis, local_suffix, global_suffix) for a tagged expert parameter, else None."""
    return getattr(param, "expert_ids", None)


def tag_template_copy(param: torch.nn.Parameter) -> None:
    """Mark an expert parameter as a copy of the expert template, as it is now (its version counter)."""
    param.template_copy = param._version


def is_template_copy(param: torch.Tensor) -> bool:
    """True for a template copy nothing has written into since it was tagged (load_state_dict, an
    in-place update or an optimizer step all count as writes)."""
    return getattr(param, "template_copy", None) == param._version
