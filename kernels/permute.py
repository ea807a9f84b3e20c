"""permute: copy each routed (token, choice) into its row of the expert-sorted dispatch buffer.

    buffer_NM[row_SK[s, j]] = x_SM[s]            for every choice with row_SK[s, j] >= 0
    buffer_NM[n]            = 0                  for rows no choice points at

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer.
`row_SK` is -1 for dropped choices; every other value is distinct and in [0, N). The backward is the
dual op, a gather-sum: grad_x[s] = sum_j grad_buffer[row_SK[s, j]], computed by unpermute_combine with
unit weights. Both directions are gathers (the row-to-token map is inverted first), so there are no
atomics and results are deterministic. The row primitives (Triton on CUDA, torch index ops elsewhere)
live in kernels.rows.
"""

import torch

from kernels.rows import combine_rows, gather_rows, source_tokens

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


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SM, row_SK, num_rows, token_N):
        ctx.save_for_backward(row_SK)
        return gather_rows(x_SM, source_tokens(row_SK, num_rows) if token_N is None else token_N, None)

    @staticmethod
    def backward(ctx, grad_NM):
        (row_SK,) = ctx.saved_tensors
        return combine_rows(grad_NM, row_SK, None), None, None, None


def permute(x_SM: torch.Tensor, row_SK: torch.Tensor, num_rows: int, token_N: torch.Tensor | None = None
            ) -> torch.Tensor:
    """Scatter tokens into the dispatch buffer by index; differentiable with respect to x_SM.

    Args:
        x_SM: tokens, shape [S, M], any float dtype.
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped; kept rows distinct.
        num_rows: N, the number of rows of the buffer.
        token_N: `kernels.rows.source_tokens(row_SK, num_rows)` when the caller has it (a layer makes it
            once for this and for unpermute_combine's backward); else made here.

    Returns:
        buffer_NM: shape [N, M], dtype of x_SM; rows no choice points at are zero.

    Raises:
        ValueError: if the shapes do not match or num_rows is negative.
        TypeError: if row_SK is not int64.
    """
    _check(x_SM, row_SK, num_rows)
    if token_N is not None and token_N.shape != (num_rows,):
        raise ValueError(f"token_N must have shape [{num_rows}], got {list(token_N.shape)}")
    return _Permute.apply(x_SM, row_SK, num_rows, token_N)
