"""Optimizer parameter groups for MoE models (DeepSpeed's `split_params_into_different_moe_groups_for_optimizer`).

One rule for users and the engine alike: a group's expert parameters move into groups of their own,
one per expert group name, flagged `moe: True`; a group the user already flagged `moe` and named
keeps its name.
"""

from collections.abc import Iterable

import torch

from parallel.tags import is_moe_param

__all__ = ["split_group", "split_params_into_different_moe_groups_for_optimizer"]


def _chunks(params: list[torch.nn.Parameter], max_group_size: int | float | None) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of parameters with at most max_group_size elements each (one oversized parameter alone)."""
    if max_group_size is None:
        return [params]
    chunks, current, size = [], [], 0
    for param in params:
        if current and size + param.numel() > max_group_size:
            chunks.append(current)
            current, size = [], 0
        current.append(param)
        size += param.numel()
    return chunks + [current] if current else chunks


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict | list[dict] | tuple[dict, ...], max_group_size: int | float | None = 178956971
) -> list[dict]:
    """Move expert parameters out of their groups into groups flagged `moe: True`.

    Each input group keeps its dense parameters; for every (input group, expert group name) pair, new
    groups with the same options, `name` = the expert group name (or the input group's own name when
    it was already flagged `moe` and named) and `moe` = True hold the expert parameters, split so that
    none holds more than max_group_size elements.

    Args:
        param_groups: a param group dict, or a list or tuple of them; each has "params" and
            optionally "name".
        max_group_size: most elements per expert group, or None for no limit.

    Returns:
        the list of groups: the input groups (dense parameters only), then the expert groups.

    Raises:
        TypeError: if param_groups is not a dict, list or tuple of dicts with "params".
    """
    if isinstance(param_groups, dict):
        param_groups = [param_groups]
    if not isinstance(param_groups, (list, tuple)) or not all(
        isinstance(g, dict) and "params" in g for g in param_groups
    ):
        raise TypeError(f"param_groups must be a dict or a list/tuple of dicts with 'params', got {type(param_groups).__name__}")
    dense_groups, moe_groups = [], []
    for index, group in enumerate(param_groups):
        params = list(group["params"]) if isinstance(group["params"], Iterable) else [group["params"]]
        dense, experts = split_group({**group, "params": params}, max_group_size)
        dense.setdefault("name", f"group_{index}")
        dense_groups.append(dense)
        moe_groups += experts
    return dense_groups + moe_groups


def split_group(group: dict, max_group_size: int | float | None = None) -> tuple[dict, list[dict]]:
    """One param group cut into its dense parameters and its expert parameters by expert group name.

    Args:
        group: a param group dict whose "params" is a list.
        max_group_size: most elements per expert group, or None for no limit.

    Returns:
        (the group with its dense parameters only, [the expert groups]); each expert group has the
        group's options, `moe` = True and `name` = its expert group name, or the group's own name
        when the group was already flagged `moe` and named.
    """
    by_name: dict[str, list] = {}
    for param in group["params"]:
        if is_moe_param(param):
            by_name.setdefault(param.group_name, []).append(param)
    dense = {**group, "params": [p for p in group["params"] if not is_moe_param(p)]}
    experts = []
    for name, expert_params in by_name.items():
        label = group["name"] if group.get("moe") and "name" in group else name
        experts += [{**group, "name": label, "moe": True, "params": chunk} for chunk in _chunks(expert_params, max_group_size)]
    return dense, experts
