"""unpermute_combine: bring expert outputs back to their tokens, weighted, summed over choices.

    out_SM[s] = sum_j weight_SK[s, j] * buffer_NM[row_SK[s, j]]      over choices with row_SK[s, j] >= 0

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
Accumulates in fp32 and returns the buffer's dtype. The backward gives the buffer gradient (the dual
op, permute scaled by the weights) and the weight gradient (one row dot product per choice). Every
step is a gather with a fixed summation order: no atomics, deterministic. On CUDA these are Triton
kernels; elsewhere torch index ops (see kernels.backend to force either).
"""

import functools

import torch

from kernels import workspace
from kernels.backend import block_size, use_triton
from kernels.permute import _gather_rows, _gather_rows_triton, _scatter_kept, _source_tokens

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


@functools.cache
def _triton_kernels():
    """The Triton kernels, built on first use so that CPU-only use never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _unpermute_combine_kernel(buffer_ptr, row_ptr, weight_ptr, out_ptr, n_cols, K, stride_bm, stride_om,
                                  BLOCK_M: tl.constexpr):
        # one program per (token, block of columns); choices summed in a fixed order, in fp32
        token = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = offsets < n_cols
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in range(K):
            row = tl.load(row_ptr + token * K + j)
            keep = row >= 0
            weight = tl.where(keep, tl.load(weight_ptr + token * K + j).to(tl.float32), 0.0)
            values = tl.load(buffer_ptr + tl.where(keep, row, 0) * stride_bm + offsets, mask=mask, other=0.0)
            acc += tl.where(keep, weight * values.to(tl.float32), 0.0)  # a dropped choice adds nothing, not 0 * nan
        tl.store(out_ptr + token * stride_om + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _row_dot_kernel(grad_ptr, buffer_ptr, row_ptr, out_ptr, n_cols, K, stride_gm, stride_bm,
                        BLOCK_M: tl.constexpr):
        # one program per (token, choice): <grad_out[token], buffer[row]> in fp32, 0 when dropped
        choice = tl.program_id(0).to(tl.int64)
        token = choice // K
        row = tl.load(row_ptr + choice)
        keep = row >= 0
        source = tl.where(keep, row, 0)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_M):
            offsets = start + tl.arange(0, BLOCK_M)
            mask = offsets < n_cols
            g = tl.load(grad_ptr + token * stride_gm + offsets, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(buffer_ptr + source * stride_bm + offsets, mask=mask, other=0.0).to(tl.float32)
            acc += tl.where(keep, g * b, 0.0)
        tl.store(out_ptr + choice, tl.sum(acc, axis=0))

    return _unpermute_combine_kernel, _row_dot_kernel


@torch.library.custom_op("exactmoe::combine_rows", mutates_args=())
def _combine_rows_triton(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """Launch: output allocation and the grid (tokens x column blocks); a custom op like the others."""
    S, K = row_SK.shape
    n_cols = buffer_NM.shape[1]
    out_SM = torch.empty(S, n_cols, dtype=buffer_NM.dtype, device=buffer_NM.device)
    if S == 0 or n_cols == 0:
        return out_SM
    if K == 0 or buffer_NM.shape[0] == 0:  # nothing to gather (and no row 0 to read)
        return out_SM.zero_()
    BLOCK_M = block_size(n_cols)
    _triton_kernels()[0][(S, -(-n_cols // BLOCK_M))](
        buffer_NM, row_SK.contiguous(), weight_SK.contiguous(), out_SM, n_cols, K, buffer_NM.stride(0),
        out_SM.stride(0), BLOCK_M=BLOCK_M,
    )
    return out_SM


@_combine_rows_triton.register_fake
def _(buffer_NM, row_SK, weight_SK):
    return buffer_NM.new_empty(row_SK.shape[0], buffer_NM.shape[1])


@torch.library.custom_op("exactmoe::row_dots", mutates_args=())
def _row_dots_triton(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor) -> torch.Tensor:
    """Launch: one program per (token, choice)."""
    S, K = row_SK.shape
    dots_SK = torch.zeros(S, K, dtype=torch.float32, device=buffer_NM.device)
    if S * K == 0 or buffer_NM.shape[0] == 0:
        return dots_SK
    n_cols = buffer_NM.shape[1]
    _triton_kernels()[1][(S * K,)](
        grad_SM, buffer_NM, row_SK.contiguous(), dots_SK, n_cols, K, grad_SM.stride(0), buffer_NM.stride(0),
        BLOCK_M=block_size(n_cols),
    )
    return dots_SK


@_row_dots_triton.register_fake
def _(grad_SM, buffer_NM, row_SK):
    return grad_SM.new_empty(row_SK.shape, dtype=torch.float32)


def _combine_rows(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """out[s] = sum_j w[s, j] * buffer[row[s, j]], fp32 accumulation (Triton, or one gather per choice)."""
    buffer_NM = buffer_NM.contiguous()
    if use_triton(buffer_NM):
        return _combine_rows_triton(buffer_NM, row_SK, weight_SK)
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
        # 1. the buffer gradient: grad_buffer[n] = weight(n) * grad_out[token(n)], a scaled gather
        # 2. the weight gradient: <grad_out[s], buffer[row(s, j)]> in fp32, 0 for dropped choices
        buffer_NM, row_SK, weight_SK = ctx.saved_tensors
        grad_SM = grad_SM.to(buffer_NM.dtype).contiguous()
        num_rows = buffer_NM.shape[0]
        acc_dtype = _accumulation_dtype(buffer_NM.dtype)
        token_N = _source_tokens(row_SK, num_rows)
        scale_N = _scatter_kept(row_SK, weight_SK.reshape(-1).to(acc_dtype), num_rows, 0.0)
        if use_triton(buffer_NM):
            grad_buffer = _gather_rows_triton(grad_SM, token_N, scale_N) if ctx.needs_input_grad[0] else None
            grad_weight = _row_dots_triton(grad_SM, buffer_NM, row_SK) if ctx.needs_input_grad[2] else None
            return grad_buffer, None, None if grad_weight is None else grad_weight.to(weight_SK.dtype)
        g_NM = _gather_rows(grad_SM, token_N, None)  # grad_out in buffer order, then scaled in place
        grad_weight = None
        if ctx.needs_input_grad[2]:
            # a batched product of rows, so no [N, M] temporary is allocated
            dots_N = torch.bmm(g_NM.to(acc_dtype).unsqueeze(1), buffer_NM.to(acc_dtype).unsqueeze(2)).view(-1)
            dots_N1 = torch.cat([dots_N, dots_N.new_zeros(1)])  # row N: the dropped choices' zero
            grad_SK = dots_N1[torch.where(row_SK >= 0, row_SK, num_rows)]
            grad_weight = grad_SK.to(weight_SK.dtype)
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
