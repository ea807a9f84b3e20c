"""Differentiable all-to-all: the backward is the reverse exchange.

Rows of the input are cut into consecutive chunks, chunk i going to rank i of the group; equal
chunks when no split sizes are given (the capacity layout), variable chunks otherwise (the dropless
layout, with the counts exchanged first by `exchange_counts`).
"""

import torch
import torch.distributed as dist

__all__ = ["all_to_all", "exchange_counts"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits), None, None, None


def all_to_all(
    x: torch.Tensor, group, output_splits: list[int] | None = None, input_splits: list[int] | None = None
) -> torch.Tensor:
    """Exchange row chunks within `group`; differentiable.

    Args:
        x: rows to send, chunk i (input_splits[i] rows, or an equal share) to rank i of the group.
        group: the process group.
        output_splits: rows received from each rank (None: equal chunks).
        input_splits: rows sent to each rank (None: equal chunks).

    Returns:
        the received rows, chunk i from rank i.
    """
    return _AllToAll.apply(x, group, output_splits, input_splits)


def exchange_counts(counts: torch.Tensor, group) -> torch.Tensor:
    """counts [ranks, ...]: row i goes to rank i; returns the rows every rank sent to this one."""
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out
