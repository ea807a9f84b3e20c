"""Expert parallelism on gloo processes against a one-process reference holding every expert.

Each rank feeds its own tokens; the reference feeds every rank's tokens in turn. Outputs and l_aux
must match per rank, and gradients after summing over the ranks that share a parameter (the gate over
everyone, each expert over its expert-data-parallel group), experts gathered by global id. fp32,
1e-5 relative.

The expert-parallel dispatchers of moe.dispatch (padded, packed, grouped, per-rank) are also checked
alone at world 2 and 4 (ep 2 and 4), given a gate's plan: outputs and the gradients of the tokens and
combine weights equal the one-process reference of tests/moe/dispatch/reference.py, and each expert's
gradient equals the reference's summed over the ranks of the expert-parallel group, which share the
expert's rows.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe import MoE
from moe.dispatch import PackedExpertParallel, PaddedExpertParallel, PerRankExchange
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed
from tests.moe.dispatch import reference as dispatch_reference  # its E: the plans' experts, beside this file's E
from tests.moe.dispatch.reference import GATES, grads, reference_output, run, stacked_experts, tokens_and_plan

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E = 24, 8, 16, 8


def _layer(ep_size, k, layout):
    kwargs = dict(num_experts=E, ep_size=ep_size, k=k, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False,
                  expert_init="per_expert_seed", seed=3)
    if layout == "dropless":
        kwargs.update(dropless=True)
    else:
        kwargs.update(capacity_factor=0.9, expert_layout=layout)
    torch.manual_seed(0)
    return MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), **kwargs)


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)


def _check_layout(rank, world, ep_size, k, layout):
    reset_groups()
    layer, reference = _layer(ep_size, k, layout), _layer(1, k, layout)
    x, grad = _inputs(rank)
    out, l_aux, _ = layer(x)
    ((out * grad).sum() + l_aux).backward()
    for r in range(world):  # the reference sees every rank's tokens in turn
        xr, gr = _inputs(r)
        out_r, l_aux_r, _ = reference(xr)
        if r == rank:
            torch.testing.assert_close(out, out_r, **FP32)
            torch.testing.assert_close(l_aux, l_aux_r, **FP32)
            dropped = int((layer.deepspeed_moe.routing.expert_idx_SK < 0).sum())
        ((out_r * gr).sum() + l_aux_r).backward()
    assert layout == "dropless" or dropped > 0 or k == 2, "capacity layouts should drop some choices here"
    gate_grad = layer.deepspeed_moe.gate.wg.weight.grad.clone()
    dist.all_reduce(gate_grad)
    torch.testing.assert_close(gate_grad, reference.deepspeed_moe.gate.wg.weight.grad, **FP32)
    groups = expert_groups(ep_size) if ep_size > 1 else None
    L = E // ep_size
    first = (groups.ep_rank if groups else 0) * L
    for name, param in layer.deepspeed_moe.experts.named_parameters():
        grad_sum = param.grad.clone()
        dist.all_reduce(grad_sum, group=groups.edp_group if groups else None)
        ref_param = dict(reference.deepspeed_moe.experts.named_parameters())[name]
        torch.testing.assert_close(param.detach(), ref_param.detach()[first : first + L], **FP32)
        torch.testing.assert_close(grad_sum, ref_param.grad[first : first + L], **FP32, msg=name)


def _check_all(rank, world, configs):
    for ep_size, k, layout in configs:
        try:
            _check_layout(rank, world, ep_size, k, layout)
        except AssertionError as error:
            raise AssertionError(f"world {world}, ep {ep_size}, top-{k}, {layout}: {error}") from error


@pytest.mark.slow
def test_world_4_every_ep_size_top1_top2_capacity_and_dropless():
    configs = [(ep, k, layout) for ep in (1, 2, 4) for k in (1, 2) for layout in ("padded", "packed", "dropless")]
    run_distributed(_check_all, 4, configs)


@pytest.mark.slow
def test_world_2_ep_2():
    run_distributed(_check_all, 2, [(2, k, layout) for k in (1, 2) for layout in ("padded", "dropless")])


def _few_tokens_in_eval(rank, world):
    """Eval with fewer tokens than min_capacity on every rank: nothing dropped, as the one-process dropless layer."""
    for layout in ("padded", "packed"):
        reset_groups()
        kwargs = dict(num_experts=E, k=2, min_capacity=4, expert_init="per_expert_seed", seed=3)
        torch.manual_seed(0)  # the same router on every rank
        layer = MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), ep_size=2, expert_layout=layout,
                    **kwargs).eval()
        reference = MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), dropless=True, **kwargs).eval()
        reference.deepspeed_moe.gate.load_state_dict(layer.deepspeed_moe.gate.state_dict())
        x = _inputs(rank)[0][:3]
        out = layer(x)[0]
        assert int((layer.deepspeed_moe.routing.expert_idx_SK < 0).sum()) == 0, layout
        torch.testing.assert_close(out, reference(x)[0], **FP32, msg=layout)


def test_eval_with_fewer_tokens_than_min_capacity_drops_nothing_under_expert_parallelism():
    run_distributed(_few_tokens_in_eval, 2)


EXPERTS = {"stacked MLP": lambda: nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)),
           "Linear modules": lambda: nn.Linear(M, M)}


def _per_expert(experts):
    """Each local expert's tensors, in one order for both ways of holding experts."""
    if experts.stacked:
        return [[p[local] for p in (experts.weight1, experts.bias1, experts.weight2, experts.bias2)]
                for local in range(experts.num_local_experts)]
    return [[p.detach() for p in module.parameters()] for module in experts.deepspeed_experts]


def _weights_at_every_ep_size(rank, world):
    for kind, make_expert in EXPERTS.items():
        by_ep = {}
        for ep_size in (1, 2, 4):
            reset_groups()
            torch.manual_seed(1000 * ep_size + rank)  # the global RNG differs by layout and rank: it must not matter
            layer = MoE(M, make_expert(), num_experts=E, ep_size=ep_size, min_capacity=0,
                        expert_init="per_expert_seed", seed=3)
            assert layer.deepspeed_moe.experts.stacked == (kind == "stacked MLP"), kind
            by_ep[ep_size] = _per_expert(layer.deepspeed_moe.experts)
        full = by_ep[1]
        assert len(full) == E and not torch.equal(full[0][0], full[1][0]), f"{kind}: experts get distinct weights"
        flat = torch.cat([t.reshape(-1) for tensors in full for t in tensors])
        from_rank0 = flat.clone()
        dist.broadcast(from_rank0, src=0)
        assert torch.equal(flat, from_rank0), f"{kind}: ep 1 weights differ between rank 0 and rank {rank}"
        for ep_size in (2, 4):
            L = E // ep_size
            first = expert_groups(ep_size).ep_rank * L
            assert len(by_ep[ep_size]) == L
            for local, tensors in enumerate(by_ep[ep_size]):
                for a, b in zip(tensors, full[first + local], strict=True):
                    assert torch.equal(a, b), \
                        f"{kind}: ep {ep_size} rank {rank} expert {first + local} differs from ep 1"


@pytest.mark.slow
def test_per_expert_seed_weights_are_the_same_at_ep_1_2_and_4():
    run_distributed(_weights_at_every_ep_size, 4, timeout_s=90)


def test_ep_size_1_runs_no_collectives(monkeypatch):
    calls = []
    for name in ("all_to_all_single", "all_reduce", "all_gather", "broadcast"):
        monkeypatch.setattr(dist, name, lambda *a, _name=name, **kw: calls.append(_name))
    for layout in ("padded", "packed", "dropless"):
        layer = _layer(1, 2, layout)
        out, l_aux, _ = layer(torch.randn(S, M))
        (out.sum() + l_aux).backward()
    assert calls == []


EP_DISPATCHERS = {
    "padded": lambda ep, group, case: PaddedExpertParallel(ep, group, equal_tokens=GATES[case].get("drop_tokens", True)),
    "packed": lambda ep, group, case: PackedExpertParallel(ep, group),
    "grouped": lambda ep, group, case: PackedExpertParallel(ep, group, grouped_gemm=True),
    "per-rank": lambda ep, group, case: PerRankExchange(ep, group),
}


def _check_expert_parallel(rank, world, ep_size, name, case):
    reset_groups()
    groups = expert_groups(ep_size)
    L = dispatch_reference.E // ep_size
    x, routing, grad = tokens_and_plan(case, rank, groups.ep_group)
    experts, every = stacked_experts(groups.ep_rank * L, L), stacked_experts(0, dispatch_reference.E)
    out = run(EP_DISPATCHERS[name](ep_size, groups.ep_group, case), x, routing, experts)
    expected = reference_output(x, routing, every)
    torch.testing.assert_close(out, expected, **FP32)
    got = grads(out, grad, [x, routing.weight_SK, *experts.parameters()])
    want = grads(expected, grad, [x, routing.weight_SK, *every.parameters()])
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


@pytest.mark.slow
@pytest.mark.parametrize("world, ep_size", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_dispatchers_equal_the_reference(world, ep_size):
    run_distributed(_check_every_dispatcher, world, ep_size)
