"""permute: copy each routed (token, choice) into its row of the expert-sorted dispatch buffer.

    buffer_NM[row_SK[s, j]] = x_SM[s]            for every choice with row_SK[s, j] >= 0
    buffer_NM[n]            = 0                  for rows no choice points at

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
`row_SK` is -1 for dropped choices; every other value is distinct and in [0, N). The backward is the
dual op, a gather-sum: grad_x[s] = sum_j grad_buffer[row_SK[s, j]], computed by unpermute_combine with
unit weights. Both directions are gathers (the row-to-token map is inverted first), so there are no
atomics and results are deterministic. On CUDA the copy is a Triton kernel; elsewhere torch's
index_select into the CPU workspace (see kernels.backend to force either).
"""

import functools

import torch

from kernels import workspace
from kernels.backend import block_size, use_triton

__all__ = ["permute", "permute_reference"]


def permute_reference(x_SM: torch.Tensor, row_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The specification: a plain, autograd-differentiable index copy (any device, any dtype).

    Args:
        x_SM: tokens, shape [S, M].
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where the choice was dropped.
        num_rows: N, the number of rows of the buffer.

    Returns:
        buffer_NM: shape [N, M], dtype of x_SM; rows no choice points at are zero.
    """
    _check(x_SM, row_SK, num_rows)
    K = row_SK.shape[1]
    rows_P = row_SK.reshape(-1)
    kept_P = rows_P >= 0
    token_P = torch.arange(rows_P.numel(), device=x_SM.device) // K
    buffer_NM = x_SM.new_zeros(num_rows, x_SM.shape[1])
    return buffer_NM.index_put((rows_P[kept_P],), x_SM[token_P[kept_P]])


def _check(x_SM: torch.Tensor, row_SK: torch.Tensor, num_rows: int) -> None:
    if x_SM.dim() != 2:
        raise ValueError(f"x must have shape [S, M], got {list(x_SM.shape)}")
    if row_SK.dim() != 2 or row_SK.shape[0] != x_SM.shape[0]:
        raise ValueError(f"row_SK must have shape [{x_SM.shape[0]}, K], got {list(row_SK.shape)}")
    if row_SK.dtype != torch.int64:
        raise TypeError(f"row_SK must be int64, got {row_SK.dtype}")
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")


def _scatter_kept(row_SK: torch.Tensor, values_P: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """out[row_SK[p]] = values_P[p] for kept choices, `fill` elsewhere; shape [N].

    Dropped choices write to a spare row N that is cut off: a scatter of fixed size, where boolean
    indexing would sync with the host to learn how many choices were kept.
    """
    rows_P = row_SK.reshape(-1)
    out = torch.full((num_rows + 1,), fill, dtype=values_P.dtype, device=row_SK.device)
    return out.scatter_(0, torch.where(rows_P >= 0, rows_P, num_rows), values_P).narrow(0, 0, num_rows)


def _source_tokens(row_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse map: the token each buffer row comes from, -1 for empty rows; shape [N]."""
    token_P = torch.arange(row_SK.numel(), device=row_SK.device) // max(row_SK.shape[1], 1)
    return _scatter_kept(row_SK, token_P, num_rows, -1)


@functools.cache
def _permute_kernel():
    """The Triton kernel, built on first use so that CPU-only use never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _permute_kernel(x_ptr, token_ptr, scale_ptr, out_ptr, n_cols, stride_xm, stride_om,
                        HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
        # one program per (buffer row, block of columns): a gather, so no two programs write one place
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = offsets < n_cols
        token = tl.load(token_ptr + row)
        keep = token >= 0
        source = tl.where(keep, token, 0)
        values = tl.load(x_ptr + source * stride_xm + offsets, mask=mask, other=0.0).to(tl.float32)
        values = tl.where(keep, values, 0.0)  # empty rows read token 0 (so S > 0) and write zeros
        if HAS_SCALE:
            values = values * tl.load(scale_ptr + row).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)

    return _permute_kernel


@torch.library.custom_op("exactmoe::gather_rows", mutates_args=())
def _gather_rows_triton(x_SM: torch.Tensor, token_N: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """Launch: checks, output allocation and the grid (rows x column blocks).

    A torch custom op (as are the other launchers), so fake and meta tensors and torch.compile see a
    shape-only implementation instead of tracing into Triton.
    """
    assert x_SM.stride(1) == 1 and token_N.is_contiguous()
    num_rows, n_cols = token_N.shape[0], x_SM.shape[1]
    out_NM = torch.empty(num_rows, n_cols, dtype=x_SM.dtype, device=x_SM.device)
    if num_rows == 0 or n_cols == 0:
        return out_NM
    if x_SM.shape[0] == 0:
        return out_NM.zero_()
    BLOCK_M = block_size(n_cols)
    grid = (num_rows, -(-n_cols // BLOCK_M))
    scale = scale_N.contiguous() if scale_N is not None else token_N
    _permute_kernel()[grid](x_SM, token_N, scale, out_NM, n_cols, x_SM.stride(0), out_NM.stride(0),
                            HAS_SCALE=scale_N is not None, BLOCK_M=BLOCK_M)
    return out_NM


@_gather_rows_triton.register_fake
def _(x_SM, token_N, scale_N):
    return x_SM.new_empty(token_N.shape[0], x_SM.shape[1])


def _gather_rows(x_SM: torch.Tensor, token_N: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """buffer[n] = scale[n] * x[token[n]], zero where token[n] == -1 (Triton or torch)."""
    x_SM = x_SM.contiguous()
    if use_triton(x_SM):
        return _gather_rows_triton(x_SM, token_N, scale_N)
    out = workspace.empty((token_N.shape[0], x_SM.shape[1]), x_SM.dtype, x_SM.device)
    if x_SM.shape[0] == 0:
        return out.zero_()
    buffer_NM = torch.index_select(x_SM, 0, token_N.clamp(min=0), out=out)
    if scale_N is not None:
        buffer_NM.mul_(scale_N.to(buffer_NM.dtype).unsqueeze(1))
    if buffer_NM.device.type != "cpu" or torch.compiler.is_compiling():
        # rows no choice points at are zero: a mask, no host sync (a compiled graph cannot read one)
        return buffer_NM.masked_fill_((token_N < 0).unsqueeze(1), 0)
    empty_N = (token_N < 0).nonzero().squeeze(1)  # eager on the CPU a host read costs nothing and skips a pass
    if empty_N.numel():
        buffer_NM.index_fill_(0, empty_N, 0)
    return buffer_NM


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SM, row_SK, num_rows):
        ctx.save_for_backward(row_SK)
        return _gather_rows(x_SM, _source_tokens(row_SK, num_rows), None)

    @staticmethod
    def backward(ctx, grad_NM):
        from kernels.unpermute_combine import _combine_rows

        (row_SK,) = ctx.saved_tensors
        ones_SK = torch.ones(row_SK.shape, dtype=torch.float32, device=row_SK.device)
        return _combine_rows(grad_NM, row_SK, ones_SK), None, None


def permute(x_SM: torch.Tensor, row_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Scatter tokens into the dispatch buffer by index; differentiable with respect to x_SM.

    Args:
        x_SM: tokens, shape [S, M], any float dtype.
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped; kept rows distinct.
        num_rows: N, the number of rows of the buffer.

    Returns:
        buffer_NM: shape [N, M], dtype of x_SM; rows no choice points at are zero.

    Raises:
        ValueError: if the shapes do not match or num_rows is negative.
        TypeError: if row_SK is not int64.
    """
    _check(x_SM, row_SK, num_rows)
    return _Permute.apply(x_SM, row_SK, num_rows)
