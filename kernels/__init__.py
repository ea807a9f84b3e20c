"""Dispatch ops for the MoE layer: each a torch reference beside the function the layer calls."""

from kernels.permute import permute, permute_reference
from kernels.unpermute_combine import unpermute_combine, unpermute_combine_reference

__all__ = ["permute", "permute_reference", "unpermute_combine", "unpermute_combine_reference"]
