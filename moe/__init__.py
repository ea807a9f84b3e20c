"""Mixture-of-Experts layer with DeepSpeed-MoE's surface: `from moe import MoE`."""

import sys

from moe import dispatch
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

# import paths the package had before its modules moved
for _old, _new in {"expert_parallel": dispatch.expert_parallel, "rank_exchange": dispatch.per_rank}.items():
    sys.modules[f"{__name__}.{_old}"] = globals()[_old] = _new
