"""unpermute_combine: bring expert outputs back to their tokens, weighted, summed over choices.

    out_SM[s] = sum_j weight_SK[s, j] * buffer_NM[row_SK[s, j]]      over choices with row_SK[s, j] >= 0

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
Accumulates in fp32 and returns the buffer's dtype. The backward gives the buffer gradient (the dual
op, permute scaled by the weights) and the weight gradient (one row dot product per choice). No
atomics, so results are deterministic.
"""

import torch

from kernels.permute import _check, _gather_rows, _source_tokens

__all__ = ["unpermute_combine", "unpermute_combine_reference"]


def unpermute_combine_reference(
    buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor
) -> torch.Tensor:
    """The specification: gather, weight and sum in fp32 with plain autograd ops (any device).

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
    gathered_SKM = buffer_NM[rows_SK].float()
    w_SK = torch.where(kept_SK, weight_SK.float(), torch.zeros_like(weight_SK, dtype=torch.float32))
    return (gathered_SKM * w_SK.unsqueeze(2)).sum(1).to(buffer_NM.dtype)


def _check_combine(buffer_NM, row_SK, weight_SK) -> None:
    if buffer_NM.dim() != 2:
        raise ValueError(f"buffer must have shape [N, M], got {list(buffer_NM.shape)}")
    if row_SK.dim() != 2 or row_SK.dtype != torch.int64:
        raise ValueError(f"row_SK must be an int64 tensor of shape [S, K], got {row_SK.dtype} {list(row_SK.shape)}")
    if weight_SK.shape != row_SK.shape:
        raise ValueError(f"weight_SK must have shape {list(row_SK.shape)}, got {list(weight_SK.shape)}")


def _combine_rows(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """out[s] = sum_j w[s, j] * buffer[row[s, j]], one gather per choice, fp32 accumulation."""
    S, K = row_SK.shape
    acc_dtype = torch.float32 if buffer_NM.dtype in (torch.float16, torch.bfloat16) else buffer_NM.dtype
    if K == 0:
        return buffer_NM.new_zeros(S, buffer_NM.shape[1])
    kept_SK = row_SK >= 0
    rows_SK = row_SK.clamp(min=0)
    w_SK = torch.where(kept_SK, weight_SK, torch.zeros_like(weight_SK)).to(acc_dtype)
    out_SM = buffer_NM.index_select(0, rows_SK[:, 0]).to(acc_dtype)
    out_SM.mul_(w_SK[:, :1])
    for j in range(1, K):
        out_SM.addcmul_(buffer_NM.index_select(0, rows_SK[:, j]).to(acc_dtype), w_SK[:, j : j + 1])
    return out_SM.to(buffer_NM.dtype)


def _row_dots(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor) -> torch.Tensor:
    """grad_weight[s, j] = <grad_out[s], buffer[row[s, j]]> in fp32, zero for dropped choices."""
    kept_SK = row_SK >= 0
    rows_SK = row_SK.clamp(min=0)
    g_SM = grad_SM.float()
    cols = [(buffer_NM.index_select(0, rows_SK[:, j]).float() * g_SM).sum(1) for j in range(row_SK.shape[1])]
    dots_SK = torch.stack(cols, 1) if cols else g_SM.new_zeros(row_SK.shape)
    return dots_SK.masked_fill_(~kept_SK, 0.0)


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_NM, row_SK, weight_SK):
        ctx.save_for_backward(buffer_NM, row_SK, weight_SK)
        return _combine_rows(buffer_NM, row_SK, weight_SK)

    @staticmethod
    def backward(ctx, grad_SM):
        buffer_NM, row_SK, weight_SK = ctx.saved_tensors
        grad_buffer = grad_weight = None
        if ctx.needs_input_grad[0]:
            token_N = _source_tokens(row_SK, buffer_NM.shape[0])
            w_P = torch.where(row_SK >= 0, weight_SK, torch.zeros_like(weight_SK)).reshape(-1).float()
            scale_N = torch.zeros(buffer_NM.shape[0], dtype=torch.float32, device=w_P.device)
            rows_P = row_SK.reshape(-1)
            scale_N[rows_P[rows_P >= 0]] = w_P[rows_P >= 0]
            grad_buffer = _gather_rows(grad_SM.to(buffer_NM.dtype), token_N, scale_N)
        if ctx.needs_input_grad[2]:
            grad_weight = _row_dots(grad_SM, buffer_NM, row_SK).to(weight_SK.dtype)
        return grad_buffer, None, grad_weight


def unpermute_combine(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """Weighted gather-sum of expert outputs back to tokens; differentiable in buffer and weights.

    Args:
        buffer_NM: expert outputs, shape [N, M], any float dtype.
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped.
        weight_SK: combine weight per (token, choice), shape [S, K] (fp32 from the gate).

    Returns:
        out_SM: shape [S, M], dtype of buffer_NM, accumulated in fp32; dropped choices add nothing.

    Raises:
        ValueError: if the shapes do not match.
    """
    _check_combine(buffer_NM, row_SK, weight_SK)
    return _UnpermuteCombine.apply(buffer_NM, row_SK, weight_SK)
