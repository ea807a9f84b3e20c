"""The dispatcher interface: how tokens travel to their experts and back.

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer, L local
experts.

A dispatcher turns the router's plan into rows for the local experts and brings the experts' outputs
back to their tokens:

    dispatched = dispatcher.dispatch(x_SM, routing)     # rows sorted by local expert, and how to return
    y_NM = experts(dispatched.rows_NM, dispatched.counts, grouped_gemm=dispatcher.grouped_gemm)
    out_SM = dispatcher.combine(y_NM, dispatched)       # weighted, summed over choices, in fp32

`dispatch` runs three steps (each choice's row; tokens copied into their rows; under expert
parallelism the exchange and the regrouping by local expert) and `combine` their inverses. A
dispatcher never builds an [S, E, C] tensor, and it holds no tensors between calls: what `combine`
needs travels in `Dispatched`.
"""

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import permute, unpermute_combine
from kernels.rows import source_tokens

__all__ = ["Dispatched", "Dispatcher", "TokenRows", "read_counts"]


@dataclass(frozen=True, eq=False)
class TokenRows:
    """Where each (token, choice) sits in this rank's dispatch buffer.

    Args:
        row_SK: int64 buffer row per (token, choice), shape [S, K], -1 where dropped (the per-rank
            exchange keeps its send row per (token, destination rank) here, [S, R]).
        weight_SK: the combine weight per (token, choice), shape [S, K].
        token_N: int64 source token per buffer row, -1 for empty rows; made once for the permute and
            reused by the combine's backward (None: the combine finds its own).
    """

    row_SK: torch.Tensor
    weight_SK: torch.Tensor
    token_N: torch.Tensor | None


@dataclass(frozen=True, eq=False)
class Dispatched:
    """What `dispatch` hands to the experts, and what `combine` needs to bring their outputs back.

    Args:
        rows_NM: the local experts' rows, sorted by local expert.
        counts: rows per local expert: None for the padded capacity buffer (equal rows per expert), a
            list of L ints (known on the host), or an int64 tensor [L] on the device (grouped rows:
            the rows after the counted ones are padding).
        tokens: the buffer rows of this rank's tokens.
        state: the dispatcher's own record of the exchange (None in one process).
    """

    rows_NM: torch.Tensor
    counts: list[int] | torch.Tensor | None
    tokens: TokenRows
    state: Any = field(default=None)


class Dispatcher(abc.ABC):
    """One way for tokens to travel to their experts and back; subclasses implement both directions.

    Attributes:
        grouped_gemm: how the experts run packed rows: one grouped GEMM (True), products per expert
            (False), or on the CPU whichever was measured faster (None).
        reads_counts: a forward reads its row counts on the host (one sync, and buffers sized by the
            routing), which a CUDA graph cannot capture.
    """

    grouped_gemm: bool | None = False
    reads_counts: bool = True

    @abc.abstractmethod
    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        """Rows for the local experts from tokens x_SM [S, M] and the router's plan."""

    @abc.abstractmethod
    def combine(self, y_NM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """out_SM: the experts' outputs y_NM brought back to their tokens, weighted and summed over choices."""


def permute_tokens(x_SM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor, num_rows: int
                   ) -> tuple[torch.Tensor, TokenRows]:
    """Copy each kept (token, choice) into its row of a buffer of num_rows rows."""
    token_N = source_tokens(row_SK, num_rows)
    return permute(x_SM, row_SK, num_rows, token_N), TokenRows(row_SK, weight_SK, token_N)


def combine_tokens(y_NM: torch.Tensor, tokens: TokenRows) -> torch.Tensor:
    """Bring buffer rows back to their tokens, weighted, summed over choices (fp32 accumulation).

    When y_NM has as many rows as the buffer the tokens were permuted into, the permute's source tokens
    serve the combine's backward.
    """
    shared_N = tokens.token_N if tokens.token_N is not None and len(tokens.token_N) == len(y_NM) else None
    return unpermute_combine(y_NM, tokens.row_SK, tokens.weight_SK, shared_N)


def read_counts(counts: torch.Tensor) -> list[int]:
    """Counts on the host, as sizes: the one host read of a layout whose row counts vary."""
    return sizes(counts.tolist())


def sizes(counts: list) -> list:
    """Counts known to be sizes: compiled with capture_scalar_outputs they are symbolic, and shapes need >= 0."""
    if torch.compiler.is_compiling():
        for count in counts:
            torch._check(count >= 0)
    return counts
