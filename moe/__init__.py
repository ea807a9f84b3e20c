"""Mixture-of-Experts layer with DeepSpeed-MoE's surface: `from moe import MoE`."""

from moe.experts import Experts
from moe.gating import TopKGate, TopKGateConfig, top1gating, top2gating, topkgating
from moe.layer import MOELayer, MoE
from moe.param_groups import split_params_into_different_moe_groups_for_optimizer
from moe.routing import Routing
from parallel.tags import is_moe_param

__all__ = [
    "Experts", "MOELayer", "MoE", "Routing", "TopKGate", "TopKGateConfig", "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer", "top1gating", "top2gating", "topkgating",
]
