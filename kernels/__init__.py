"""Dispatch ops for the MoE layer: each a torch reference beside the function the layer calls."""

from kernels.permute import permute, permute_reference
from kernels.slots import expert_positions, expert_positions_reference, route
from kernels.unpermute_combine import unpermute_combine, unpermute_combine_reference

__all__ = [
    "expert_positions", "expert_positions_reference", "permute", "permute_reference", "route",
    "unpermute_combine", "unpermute_combine_reference",
]
