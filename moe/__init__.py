"""Mixture-of-Experts layer with DeepSpeed-MoE's surface: `from moe import MoE`."""

import sys

from moe import dispatch, router

# short module names that scripts import (moe.gating, moe.expert_parallel, ...), each the same module as
# its place in router/ or dispatch/ (moe.gating: see router/selection.py); registered before the layer is
# imported, so every module of moe may use them
for _old, _new in {
    "balancing": router.balancing, "expert_choice": router.expert_choice, "gate": router.gate,
    "gate_outputs": router.outputs, "gating": router.selection, "routing": router.plan,
    "expert_parallel": dispatch.expert_parallel, "rank_exchange": dispatch.per_rank,
}.items():
    sys.modules[f"{__name__}.{_old}"] = _new
    globals()[_old] = _new  # `import moe.gating` binds `moe`, then reads moe.gating from here

from moe.experts import Experts, SwiGLU  # noqa: E402
from moe.layer import MOELayer, MoE  # noqa: E402
from moe.router import (  # noqa: E402
    Routing, TopKGate, TopKGateConfig, expert_choice_gating, top1gating, top2gating, topkgating, update_routing,
)
from moe.upcycling import upcycle  # noqa: E402
from parallel import is_moe_param, split_params_into_different_moe_groups_for_optimizer  # noqa: E402

__all__ = [
    "Experts", "MOELayer", "MoE", "Routing", "SwiGLU", "TopKGate", "TopKGateConfig", "expert_choice_gating",
    "is_moe_param", "split_params_into_different_moe_groups_for_optimizer", "top1gating", "top2gating", "topkgating",
    "update_routing", "upcycle",
]
