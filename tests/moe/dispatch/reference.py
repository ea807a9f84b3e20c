"""Routing plans and a plain-torch reference shared by the dispatcher tests.

Each rank's tokens and their plan from a real gate (dropping and dropless, top-1 to top-3), stacked
MLP experts seeded by global id, and the reference: every kept (token, choice) run through its
expert's MLP one token at a time, weighted and summed per token.
"""

import dataclasses

import torch
from torch import nn

from moe import Experts, TopKGate
from moe.dispatch import Dispatcher

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E = 20, 8, 12, 8


# routing plans: dropping (capacity) and dropless, top-1 to top-3
GATES = {
    "top1-dropping": dict(k=1, capacity_factor=0.75, use_rts=False),
    "top2-dropping": dict(k=2, capacity_factor=0.8, top2_2nd_expert_sampling=False),
    "top3-dropless": dict(k=3, drop_tokens=False),
}


def stacked_experts(first: int, count: int) -> Experts:
    """Stacked MLP experts holding global experts first ... first + count - 1, each seeded by its global id."""
    return Experts(nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), count, seed=(7, first))


def tokens_and_plan(case: str, rank: int, ep_group=None):
    """This rank's tokens and their routing plan, with leaf tensors for the gradients."""
    torch.manual_seed(0)
    gate = TopKGate(M, E, min_capacity=0, **GATES[case])
    gate.ep_group = ep_group
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(S, M, generator=g, requires_grad=True)
    routing = gate(x.detach())
    # the plan's weights as a leaf: the dispatcher's gradients stop at them
    routing = dataclasses.replace(routing, weight_SK=routing.weight_SK.detach().requires_grad_())
    return x, routing, torch.randn(S, M, generator=g)


def reference_output(x_SM, routing, experts: Experts) -> torch.Tensor:
    """Token by token: sum over kept choices of weight * MLP_e(x)."""
    out = []
    for s in range(x_SM.shape[0]):
        row = torch.zeros(M)
        for e, w in zip(routing.expert_idx_SK[s].tolist(), routing.weight_SK[s]):
            if e >= 0:
                h = torch.nn.functional.gelu(experts.weight1[e] @ x_SM[s] + experts.bias1[e])
                row = row + w * (experts.weight2[e] @ h + experts.bias2[e])
        out.append(row)
    return torch.stack(out)


def run(dispatcher: Dispatcher, x_SM, routing, experts: Experts) -> torch.Tensor:
    """Dispatch, the experts, combine: what the layer does with a plan."""
    dispatched = dispatcher.dispatch(x_SM, routing)
    y_NM = experts(dispatched.rows_NM, dispatched.counts, grouped_gemm=dispatcher.grouped_gemm)
    return dispatcher.combine(y_NM, dispatched)


def grads(out_SM, grad_SM, tensors):
    """The gradients of `tensors` for the output gradient grad_SM."""
    return torch.autograd.grad((out_SM * grad_SM).sum(), tensors)
