"""Dispatch ops for the MoE layer: each a torch reference beside the function the layer calls.

The CPU-only performance machinery (product backends, worker threads, workspace) is `kernels.cpu`.
"""

import sys

from kernels import cpu
from kernels.backend import sync_checks
from kernels.grouped_gemm import (
    grouped_mm, grouped_mm_reference, grouped_mm_t, grouped_mm_t_reference, grouped_sum, grouped_sum_reference,
)
from kernels.permute import permute, permute_reference
from kernels.slots import buffer_rows, expert_positions, expert_positions_reference
from kernels.unpermute_combine import unpermute_combine, unpermute_combine_reference

# short module names that scripts import (kernels.gemm, ...), each the same module as in kernels.cpu
# (`import kernels.gemm` then `kernels.gemm.linear` needs the attribute as well as the module entry)
for _old, _new in {"gemm": cpu.gemm, "threads": cpu.threads, "workspace": cpu.workspace}.items():
    sys.modules[f"{__name__}.{_old}"] = _new
    globals()[_old] = _new

__all__ = [
    "buffer_rows", "grouped_mm", "grouped_mm_reference", "grouped_mm_t", "grouped_mm_t_reference", "grouped_sum",
    "grouped_sum_reference", "expert_positions", "expert_positions_reference", "permute", "permute_reference",
    "sync_checks", "unpermute_combine", "unpermute_combine_reference",
]
