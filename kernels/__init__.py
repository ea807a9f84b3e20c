"""Dispatch ops for the MoE layer: each a torch reference beside the function the layer calls."""

from kernels.backend import sync_checks
from kernels.grouped_gemm import (
    grouped_mm, grouped_mm_reference, grouped_mm_t, grouped_mm_t_reference, grouped_sum, grouped_sum_reference,
)
from kernels.permute import permute, permute_reference
from kernels.slots import buffer_rows, expert_positions, expert_positions_reference
from kernels.unpermute_combine import unpermute_combine, unpermute_combine_reference

__all__ = [
    "buffer_rows", "grouped_mm", "grouped_mm_reference", "grouped_mm_t", "grouped_mm_t_reference", "grouped_sum",
    "grouped_sum_reference", "expert_positions", "expert_positions_reference", "permute", "permute_reference",
    "sync_checks", "unpermute_combine", "unpermute_combine_reference",
]
