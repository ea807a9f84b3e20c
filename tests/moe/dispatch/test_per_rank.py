"""The per-rank exchange (one row per token and destination rank) against the one-process reference.

World 4 on gloo, ep 2 and 4: outputs, l_aux, the gate's gradient (summed over ranks) and every expert
gradient (summed over the expert-data-parallel group) equal a one-process layer holding every expert
fed each rank's tokens in turn, fp32, 1e-5. The rows that cross are counted: one per (token, rank)
pair reached, fewer than the choices when a token picks several experts of one rank.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe.dispatch.per_rank
from moe import MoE
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E = 24, 8, 16, 8

CASES = {
    "top2-dropping": dict(k=2, capacity_factor=0.9, use_rts=False, top2_2nd_expert_sampling=False),
    "top4-groups-dropless": dict(k=4, dropless=True, scoring_func="sigmoid", n_group=4, topk_group=2),
    "top3-groups-grouped": dict(k=3, dropless=True, n_group=2, topk_group=1, expert_layout="grouped"),
    "expert-choice": dict(routing="expert_choice", capacity_factor=2.0),
}


def _layer(ep_size, case, exchange):
    torch.manual_seed(0)
    kwargs = dict(CASES[case])
    if exchange == "per_choice":
        kwargs.pop("expert_layout", None)
    return MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), num_experts=E, ep_size=ep_size,
               min_capacity=0, expert_init="per_expert_seed", seed=3, exchange=exchange, **kwargs)


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)


def _check(rank, world, ep_size, case):
    reset_groups()
    sent = []
    original = moe.dispatch.per_rank.all_to_all
    moe.dispatch.per_rank.all_to_all = lambda x, *args: (sent.append(x.shape[0]), original(x, *args))[1]
    try:
        layer = _layer(ep_size, case, "per_rank")
        x, grad = _inputs(rank)
        out, l_aux, _ = layer(x)
        ((out * grad).sum() + l_aux).backward()
    finally:
        moe.dispatch.per_rank.all_to_all = original
    routing = layer.deepspeed_moe.routing
    L = E // ep_size
    pairs = {(s, int(e) // L) for s, row in enumerate(routing.expert_idx_SK.tolist()) for e in row if e >= 0}
    choices = int(routing.kept_SK.sum())
    assert sent[0] == len(pairs) <= choices, (sent, len(pairs), choices)
    reference = _layer(1, case, "per_choice")
    for r in range(world):
        xr, gr = _inputs(r)
        out_r, l_aux_r, _ = reference(xr)
        if r == rank:
            torch.testing.assert_close(out, out_r, **FP32)
            torch.testing.assert_close(l_aux, l_aux_r, **FP32)
        ((out_r * gr).sum() + l_aux_r).backward()
    gate_grad = layer.deepspeed_moe.gate.wg.weight.grad.clone()
    dist.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, reference.deepspeed_moe.gate.wg.weight.grad, **FP32)
    groups = expert_groups(ep_size)
    first = groups.ep_rank * L
    for name, param in layer.deepspeed_moe.experts.named_parameters():
        grad_sum = param.grad.clone()
        dist.all_reduce(grad_sum, group=groups.edp_group)
        ref_param = dict(reference.deepspeed_moe.experts.named_parameters())[name]
        torch.testing.assert_close(grad_sum, ref_param.grad[first:first + L], **FP32, msg=name)
    return len(pairs) < choices


def _check_all(rank, world, configs):
    fewer = {}
    for ep_size, case in configs:
        try:
            fewer[(ep_size, case)] = _check(rank, world, ep_size, case)
        except AssertionError as error:
            raise AssertionError(f"world {world}, ep {ep_size}, {case}: {error}") from error
    assert fewer[(2, "top4-groups-dropless")], "top-4 over 2 ranks must share rows between a token's choices"


@pytest.mark.slow
def test_world_4_per_rank_exchange_equals_the_reference():
    run_distributed(_check_all, 4, [(ep, case) for ep in (2, 4) for case in CASES])


def test_per_rank_exchange_needs_a_layout_without_padding():
    with pytest.raises(ValueError, match="exchange='per_rank' sends variable rows per rank"):
        MoE(M, nn.Linear(M, M), num_experts=4, exchange="per_rank", expert_layout="padded")
    with pytest.raises(ValueError, match="exchange must be one of"):
        MoE(M, nn.Linear(M, M), num_experts=4, exchange="dedup")
