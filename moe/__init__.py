"""Mixture-of-Experts layer with DeepSpeed-MoE's surface: `from moe import MoE`."""

from moe.expert_choice import expert_choice_gating
from moe.experts import Experts
from moe.gate import TopKGate, TopKGateConfig, update_routing
from moe.gating import top1gating, top2gating, topkgating
from moe.layer import MOELayer, MoE
from moe.routing import Routing
from parallel import is_moe_param, split_params_into_different_moe_groups_for_optimizer

__all__ = [
    "Experts", "MOELayer", "MoE", "Routing", "TopKGate", "TopKGateConfig", "expert_choice_gating", "is_moe_param",
    "split_params_into_different_moe_groups_for_optimizer", "top1gating", "top2gating", "topkgating",
    "update_routing",
]
