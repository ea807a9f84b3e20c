"""Each dispatcher of moe.dispatch against the one-process, plain-torch reference.

The reference runs every kept (token, choice) through its expert's MLP one token at a time and sums
the weighted outputs per token. A dispatcher, given the same routing plan, must give the same
outputs, and the same gradients for the tokens, the combine weights and every expert weight: fp32,
1e-5. The expert-parallel dispatchers run on gloo at world 2 and 4 (ep 2 and 4), each rank with its
own tokens; expert gradients are summed over the ranks of the expert-parallel group, which share the
expert's rows.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe import Experts, TopKGate
from moe.dispatch import (
    Dispatcher, Grouped, Packed, PackedExpertParallel, Padded, PaddedExpertParallel, PerRankExchange, make_dispatcher,
)
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E = 20, 8, 12, 8

# routing plans: dropping (capacity) and dropless, top-1 to top-3
GATES = {
    "top1-dropping": dict(k=1, capacity_factor=0.75, use_rts=False),
    "top2-dropping": dict(k=2, capacity_factor=0.8, top2_2nd_expert_sampling=False),
    "top3-dropless": dict(k=3, drop_tokens=False),
}


def _experts(first: int, count: int) -> Experts:
    """Stacked MLP experts holding global experts first ... first + count - 1, each seeded by its global id."""
    return Experts(nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), count, seed=(7, first))


def _plan(case: str, rank: int, ep_group=None):
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


def _reference(x_SM, routing, experts: Experts) -> torch.Tensor:
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


def _run(dispatcher: Dispatcher, x_SM, routing, experts: Experts) -> torch.Tensor:
    dispatched = dispatcher.dispatch(x_SM, routing)
    y_NM = experts(dispatched.rows_NM, dispatched.counts, grouped_gemm=dispatcher.grouped_gemm)
    return dispatcher.combine(y_NM, dispatched)


def _grads(out_SM, grad_SM, tensors):
    return torch.autograd.grad((out_SM * grad_SM).sum(), tensors)


@pytest.mark.parametrize("case", list(GATES))
@pytest.mark.parametrize("dispatcher", [Padded(), Packed(False), Packed(None), Grouped()],
                         ids=["padded", "packed", "packed-measured", "grouped"])
def test_one_process_dispatcher_equals_the_reference(dispatcher, case):
    x, routing, grad = _plan(case, 0)
    experts = _experts(0, E)
    out = _run(dispatcher, x, routing, experts)
    expected = _reference(x, routing, experts)
    torch.testing.assert_close(out, expected, **FP32)
    inputs = [x, routing.weight_SK, *experts.parameters()]
    for got, want in zip(_grads(out, grad, inputs), _grads(expected, grad, inputs)):
        torch.testing.assert_close(got, want, **FP32)
    if case != "top3-dropless":
        assert int((routing.expert_idx_SK < 0).sum()) > 0, "the dropping plans should drop some choices"


def test_make_dispatcher_picks_one_class_per_way():
    assert type(make_dispatcher("padded")) is Padded
    assert type(make_dispatcher("packed")) is Packed and make_dispatcher("packed").grouped_gemm is False
    assert make_dispatcher("packed", measured=True).grouped_gemm is None
    assert type(make_dispatcher("grouped")) is Grouped
    assert type(make_dispatcher("grouped", stacked=False)) is Packed  # module experts: products per expert
    assert type(make_dispatcher("padded", ep_size=2)) is PaddedExpertParallel
    assert type(make_dispatcher("grouped", ep_size=2)) is PackedExpertParallel
    assert make_dispatcher("grouped", ep_size=2).grouped_gemm is True
    assert type(make_dispatcher("packed", "per_rank", ep_size=2)) is PerRankExchange
    assert type(make_dispatcher("packed", "per_rank", ep_size=1)) is Packed  # one process: nothing to exchange


EP_DISPATCHERS = {
    "padded": lambda ep, group, case: PaddedExpertParallel(ep, group, equal_tokens=GATES[case].get("drop_tokens", True)),
    "packed": lambda ep, group, case: PackedExpertParallel(ep, group),
    "grouped": lambda ep, group, case: PackedExpertParallel(ep, group, grouped_gemm=True),
    "per-rank": lambda ep, group, case: PerRankExchange(ep, group),
}


def _check_expert_parallel(rank, world, ep_size, name, case):
    reset_groups()
    groups = expert_groups(ep_size)
    L = E // ep_size
    x, routing, grad = _plan(case, rank, groups.ep_group)
    experts, every = _experts(groups.ep_rank * L, L), _experts(0, E)
    out = _run(EP_DISPATCHERS[name](ep_size, groups.ep_group, case), x, routing, experts)
    expected = _reference(x, routing, every)
    torch.testing.assert_close(out, expected, **FP32)
    got = _grads(out, grad, [x, routing.weight_SK, *experts.parameters()])
    want = _grads(expected, grad, [x, routing.weight_SK, *every.parameters()])
    for g, w in zip(got[:2], want[:2]):  # this rank's tokens and combine weights
        torch.testing.assert_close(g, w, **FP32)
    for g, w in zip(got[2:], want[2:]):  # the experts saw rows from every rank of the group
        w = w.clone()
        dist.all_reduce(w, group=groups.ep_group)
        torch.testing.assert_close(g, w[groups.ep_rank * L:groups.ep_rank * L + L], **FP32)


def _check_every_dispatcher(rank, world, ep_size):
    for name in EP_DISPATCHERS:
        for case in GATES:
            _check_expert_parallel(rank, world, ep_size, name, case)


@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_dispatchers_equal_the_reference(world, ep_size):
    run_distributed(_check_every_dispatcher, world, ep_size)
