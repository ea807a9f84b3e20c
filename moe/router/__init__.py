"""The router: from tokens to a routing plan (which experts, which slots, which weights, which losses).

One concern per module, in the order a forward goes through them:

    gate.py           `TopKGate`, the router nn.Module, and `TopKGateConfig`: the fp32 linear map to
                      expert logits, the choice of policy, and the balancing state kept across
                      forwards (expert bias, step counts), advanced by `update_routing`.
    scoring.py        the logits' checks and dtype, and the scores: softmax over experts in SIMD order
                      (`expert_softmax`) or sigmoid.
    selection.py      DeepSpeed's policies `top1gating`, `top2gating`, `topkgating`: which experts each
                      token picks (noise, expert bias, group-limited routing) and which choices fit.
    expert_choice.py  `expert_choice_gating`: each expert picks its tokens.
    plan.py           `Routing`, the plan every policy returns; the capacity C and `assign_slots`.
    outputs.py        the plan's differentiable values (combine weights, l_aux, z_loss); for softmax
                      routing in one autograd node (`gate_outputs`).
    balancing.py      the balance losses, the auxiliary-loss-free expert bias update, MaxVio.

Imports point down this list's dependencies: balancing needs nothing here; plan needs balancing;
scoring nothing; outputs needs plan, scoring and balancing; the policies need those; gate needs them
all. Outside the package only gate.py imports from moe (moe.autocast); the layer uses the router,
never the reverse.

Adding a routing method (as expert_choice.py does): write one module with a function
`(logits [S, E], ..., *, used_token=None) -> Routing` that checks and scores the logits
(`scoring._check_logits`, `expert_softmax`), picks each kept choice's expert and slot (`assign_slots`,
or `kernels.expert_positions` for slots in token order), and builds the plan's weights with
`outputs._plan` (l_aux from `balancing`, z-loss from `outputs._z_loss`). Then name it in `gate.ROUTINGS`,
refuse the options it does not take in `TopKGateConfig._check_routing_options`, and call it from
`TopKGate.forward`. Its tests go in tests/moe/router/.
"""

from moe.router.balancing import balance_loss, max_violation, update_bias
from moe.router.expert_choice import expert_choice_gating
from moe.router.gate import TopKGate, TopKGateConfig, update_routing
from moe.router.outputs import gate_outputs
from moe.router.plan import Routing, assign_slots
from moe.router.scoring import expert_softmax
from moe.router.selection import top1gating, top2gating, topkgating

__all__ = [
    "Routing", "TopKGate", "TopKGateConfig", "assign_slots", "balance_loss", "expert_choice_gating", "expert_softmax",
    "gate_outputs", "max_violation", "top1gating", "top2gating", "topkgating", "update_bias", "update_routing",
]
