"""unpermute_combine: bring expert outputs back to their tokens, weighted, summed over choices.

    out_SM[s] = sum_j weight_SK[s, j] * buffer_NM[row_SK[s, j]]      over choices with row_SK[s, j] >= 0

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
Accumulates in fp32 and returns the buffer's dtype. The backward gives the buffer gradient (the dual
op, permute scaled by the weights) and the weight gradient (one row dot product per choice). No
atomics, so results are deterministic.
"""

import torch

from kernels import workspace
from kernels.permute import _check, _gather_rows, _source_tokens

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


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types; fp32 and float64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def _combine_rows(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """out[s] = sum_j w[s, j] * buffer[row[s, j]], one gather per choice, fp32 accumulation."""
    S, K = row_SK.shape
    acc_dtype = _accumulation_dtype(buffer_NM.dtype)
    if K == 0:
        return buffer_NM.new_zeros(S, buffer_NM.shape[1])
    kept_SK = row_SK >= 0
    rows_SK = row_SK.clamp(min=0)
    w_SK = torch.where(kept_SK, weight_SK, torch.zeros_like(weight_SK)).to(acc_dtype)
    shape = (S, buffer_NM.shape[1])
    out_SM = _select(buffer_NM, rows_SK[:, 0], workspace.empty(shape, buffer_NM.dtype, buffer_NM.device)).to(acc_dtype)
    out_SM.mul_(w_SK[:, :1])
    if K > 1:
        rows_SM = workspace.empty(shape, buffer_NM.dtype, buffer_NM.device)
        for j in range(1, K):
            out_SM.addcmul_(_select(buffer_NM, rows_SK[:, j], rows_SM).to(acc_dtype), w_SK[:, j : j + 1])
    return out_SM.to(buffer_NM.dtype)


def _select(buffer_NM, rows, out):
    return torch.index_select(buffer_NM, 0, rows, out=out)


class _UnpermuteCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buffer_NM, row_SK, weight_SK):
        ctx.save_for_backward(buffer_NM, row_SK, weight_SK)
        return _combine_rows(buffer_NM, row_SK, weight_SK)

    @staticmethod
    def backward(ctx, grad_SM):
        # 1. gather each row's token gradient into buffer order: g_NM[n] = grad_out[token(n)]
        # 2. weight gradient per row: <g_NM[n], buffer[n]> (fp32), scattered back to (token, choice)
        # 3. buffer gradient: g_NM[n] * weight(n), in place
        buffer_NM, row_SK, weight_SK = ctx.saved_tensors
        rows_P = row_SK.reshape(-1)
        kept_P = rows_P >= 0
        token_N = _source_tokens(row_SK, buffer_NM.shape[0])
        g_NM = _gather_rows(grad_SM.to(buffer_NM.dtype), token_N, None)
        acc_dtype = _accumulation_dtype(buffer_NM.dtype)
        grad_weight = None
        if ctx.needs_input_grad[2]:
            # a batched product of rows, so no [N, M] temporary is allocated
            dots_N = torch.bmm(g_NM.to(acc_dtype).unsqueeze(1), buffer_NM.to(acc_dtype).unsqueeze(2)).view(-1)
            grad_P = torch.zeros(rows_P.shape, dtype=acc_dtype, device=rows_P.device)
            grad_P[kept_P] = dots_N[rows_P[kept_P]]
            grad_weight = grad_P.view(row_SK.shape).to(weight_SK.dtype)
        scale_N = torch.zeros(buffer_NM.shape[0], dtype=acc_dtype, device=rows_P.device)
        scale_N[rows_P[kept_P]] = weight_SK.reshape(-1)[kept_P].to(acc_dtype)
        grad_buffer = g_NM.mul_(scale_N.to(g_NM.dtype).unsqueeze(1)) if ctx.needs_input_grad[0] else None
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
