"""unpermute_combine: bring expert outputs back to their tokens, weighted, summed over choices.

    out_SM[s] = sum_j weight_SK[s, j] * buffer_NM[row_SK[s, j]]      over choices with row_SK[s, j] >= 0

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
Accumulates in fp32 and returns the buffer's dtype. The backward gives the buffer gradient (the dual
op, permute scaled by the weights) and the weight gradient (one row dot product per choice). Every
step is a gather with a fixed summation order: no atomics, deterministic. The row primitives (Triton on
CUDA, torch index ops elsewhere) live in kernels.rows.
"""

import torch

from kernels.backend import use_triton
from kernels.rows import (accumulation_dtype, combine_rows, fused_dots, gather_rows, row_dots, scatter_kept,
                          source_tokens)

__all__ = ["unpermute_combine", "unpermute_combine_reference"]


def unpermute_combine_reference(
    buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor
) -> torch.Tensor:
    """The specification: gather, weight and sum in fp32 (float64 for float64) with plain autograd ops.

    Args:
        buffer_NM: expert outputs, shape [N, M].
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped.
        weight_SK: combine weight per (token, choice), shape [S, K].

    Returns:
        out_SM: shape [S, M], dtype of buffer_NM.
    """
    _check_combine(buffer_NM, row_SK, weight_SK)
    kept_SK = row_SK >= 0
    rows_SK = row_SK.clamp(min=0)
    acc_dtype = torch.promote_types(buffer_NM.dtype, torch.float32)
    gathered_SKM = buffer_NM[rows_SK].to(acc_dtype)
    w_SK = torch.where(kept_SK, weight_SK, torch.zeros_like(weight_SK)).to(acc_dtype)
    return (gathered_SKM * w_SK.unsqueeze(2)).sum(1).to(buffer_NM.dtype)


def _check_combine(buffer_NM, row_SK, weight_SK) -> None:
    if buffer_NM.dim() != 2:
        raise ValueError(f"buffer must have shape [N, M], got {list(buffer_NM.shape)}")
    if row_SK.dim() != 2 or row_SK.dtype != torch.int64:
        raise ValueError(f"row_SK must be an int64 tensor of shape [S, K], got {row_SK.dtype} {list(row_SK.shape)}")
    if weight_SK.shape != row_SK.shape:
        raise ValueError(f"weight_SK must have shape {list(row_SK.shape)}, got {list(weight_SK.shape)}")


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_NM, row_SK, weight_SK, token_N):
        ctx.save_for_backward(buffer_NM, row_SK, weight_SK, token_N)
        return combine_rows(buffer_NM, row_SK, weight_SK)

    @staticmethod
    def backward(ctx, grad_SM):
        # 1. the buffer gradient: grad_buffer[n] = weight(n) * grad_out[token(n)], a scaled gather
        # 2. the weight gradient: <grad_out[s], buffer[row(s, j)]> in fp32, 0 for dropped choices
        buffer_NM, row_SK, weight_SK, token_N = ctx.saved_tensors
        grad_SM = grad_SM.to(buffer_NM.dtype).contiguous()
        num_rows = buffer_NM.shape[0]
        token_N = source_tokens(row_SK, num_rows) if token_N is None else token_N
        scale_N = scatter_kept(row_SK, weight_SK.reshape(-1).to(accumulation_dtype(buffer_NM.dtype)), num_rows, 0.0)
        if use_triton(buffer_NM) or fused_dots(grad_SM, buffer_NM, row_SK):
            grad_buffer = gather_rows(grad_SM, token_N, scale_N) if ctx.needs_input_grad[0] else None
            dots_SK = row_dots(grad_SM, buffer_NM, row_SK) if ctx.needs_input_grad[2] else None
        else:
            g_NM = gather_rows(grad_SM, token_N, None)  # grad_out in buffer order: the dots' rows, then scaled in place
            dots_SK = row_dots(grad_SM, buffer_NM, row_SK, g_NM) if ctx.needs_input_grad[2] else None
            grad_buffer = g_NM.mul_(scale_N.to(g_NM.dtype).unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_buffer, None, None if dots_SK is None else dots_SK.to(weight_SK.dtype), None


def unpermute_combine(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor,
                      token_N: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted gather-sum of expert outputs back to tokens; differentiable in buffer and weights.

    Args:
        buffer_NM: expert outputs, shape [N, M], any float dtype.
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped.
        weight_SK: combine weight per (token, choice), shape [S, K] (fp32 from the gate).
        token_N: `kernels.rows.source_tokens(row_SK, N)` when the caller has it (the permute's); else
            the backward makes it.

    Returns:
        out_SM: shape [S, M], dtype of buffer_NM, accumulated in fp32; dropped choices add nothing.

    Raises:
        ValueError: if the shapes do not match.
    """
    _check_combine(buffer_NM, row_SK, weight_SK)
    if token_N is not None and token_N.shape != buffer_NM.shape[:1]:
        raise ValueError(f"token_N must have shape [{buffer_NM.shape[0]}], got {list(token_N.shape)}")
    return _UnpermuteCombine.apply(buffer_NM, row_SK, weight_SK, token_N)
