"""Dispatchers for one process (or one rank's own experts): the padded, packed and grouped layouts.

Shape legend: S tokens, K choices per token, E experts, C capacity, M model dim, N buffer rows.

- Padded: the [E, C, M] capacity buffer, row = expert * C + slot; fixed size, no host sync. Empty
  slots are multiplied like full ones.
- Packed: kept rows sorted by expert with no padding; the row counts are read on the host (one sync)
  to size the buffer and the experts' slices.
- Grouped: the packed rows in a buffer of fixed size (a bound known without a sync), the counts left
  on the device for one grouped GEMM; the rows after the counted ones are padding.
"""

import torch

from kernels import buffer_rows
from moe.dispatch.base import Dispatched, Dispatcher, combine_tokens, permute_tokens, read_counts

__all__ = ["Grouped", "Packed", "Padded"]


class Padded(Dispatcher):
    """The capacity buffer: every expert gets C rows, filled by slot, the empty ones zero."""

    reads_counts = False

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        row_SK = buffer_rows(routing.expert_idx_SK, routing.slot_SK, capacity=routing.capacity)
        buffer_NM, tokens = permute_tokens(x_SM, row_SK, routing.weight_SK, routing.num_experts * routing.capacity)
        return Dispatched(buffer_NM, None, tokens)

    def combine(self, y_NM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return combine_tokens(y_NM, dispatched.tokens)


class Packed(Dispatcher):
    """Kept rows sorted by expert, no padding; the counts read on the host size the buffer.

    Args:
        grouped_gemm: how the experts run the rows (see `Dispatcher.grouped_gemm`).
    """

    def __init__(self, grouped_gemm: bool | None = False):
        self.grouped_gemm = grouped_gemm

    @staticmethod
    def rows(routing) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept choices per expert [E] (on the device) and each choice's row, sorted by expert."""
        counts_E = routing.kept_counts()
        return buffer_rows(routing.expert_idx_SK, routing.slot_SK, counts_E=counts_E), counts_E

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        row_SK, counts_E = self.rows(routing)
        counts = read_counts(counts_E)  # the one host sync: slice sizes
        buffer_NM, tokens = permute_tokens(x_SM, row_SK, routing.weight_SK, sum(counts))
        return Dispatched(buffer_NM, counts, tokens)

    def combine(self, y_NM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        return combine_tokens(y_NM, dispatched.tokens)


class Grouped(Packed):
    """Packed rows in a buffer of fixed size, the counts on the device: no host sync.

    The experts must be stacked (one grouped GEMM for all of them). Compiled on the CPU, the grouped
    GEMM cannot be traced in fp32 (its meta function takes bf16 only), so there the packed dispatch
    runs, with its one host read.
    """

    reads_counts = False  # but compiled on the CPU, where the packed dispatch runs

    def __init__(self):
        super().__init__(grouped_gemm=True)

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        if torch.compiler.is_compiling() and x_SM.device.type == "cpu":
            return Packed.dispatch(self, x_SM, routing)  # (named: dynamo cannot resume a break inside super())
        row_SK, counts_E = self.rows(routing)
        max_rows = routing.max_rows if routing.max_rows is not None else row_SK.numel()
        buffer_NM, tokens = permute_tokens(x_SM, row_SK, routing.weight_SK, max_rows)  # kept rows, then zero rows
        return Dispatched(buffer_NM, counts_E, tokens)
