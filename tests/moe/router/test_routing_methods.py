"""The routers of current MoE models against definitions written here from the papers' formulas.

Sigmoid scoring and the expert bias (DeepSeek-V3; Wang et al. 2024), the gate's global-batch counts,
group-limited routing (DeepSeek-V2/V3) and shared experts (DeepSeekMoE, Qwen-MoE), with the options'
bad combinations and every method in every layout. Each reference loops over tokens or groups in plain
torch; chosen experts are compared exactly, weights, losses and gradients within fp32 tolerance
(float64 where a gradient is compared). The balance losses and the bias update have their tests in
test_balancing.py, expert-choice routing in test_expert_choice.py.
"""

import pytest
import torch
from torch import nn

import moe
from moe import MoE, TopKGate, topkgating
from tests.moe.router.references import reference_switch_loss, weights_by_expert

RTOL, ATOL = 1e-5, 1e-6
F64 = {"rtol": 1e-10, "atol": 1e-12}


# References, one token at a time.

def _reference_topk(logits, k, scoring="softmax", bias=None, n_group=None, topk_group=None, norm=True, scale=1.0):
    """Per token: scores, selection on scores + bias within the best groups, weights from the scores."""
    experts, weights = [], []
    E = logits.shape[1]
    for row in logits:
        s = torch.softmax(row, 0) if scoring == "softmax" else torch.sigmoid(row)
        select = s.detach() + (bias if bias is not None else 0.0)
        allowed = list(range(E))
        if n_group:
            size = E // n_group
            group_score = [sorted(select[g * size:(g + 1) * size].tolist(), reverse=True)[:2] for g in range(n_group)]
            ranked = sorted(range(n_group), key=lambda g: (-sum(group_score[g]), g))[:topk_group]
            allowed = [e for g in ranked for e in range(g * size, (g + 1) * size)]
        chosen = sorted(allowed, key=lambda e: (-select[e].item(), e))[:k]
        w = torch.stack([s[e] for e in chosen])
        if norm:
            w = w / w.sum()
        experts.append(chosen)
        weights.append(w * scale)
    return torch.tensor(experts), torch.stack(weights)


def _same_choices(plan_SK, reference_SK):
    """The same set of experts per token (the column order of a top-k is not part of the contract)."""
    assert sorted(map(sorted, plan_SK.tolist())) == sorted(map(sorted, reference_SK.tolist()))
    assert [sorted(r) for r in plan_SK.tolist()] == [sorted(r) for r in reference_SK.tolist()]


def _reference_dense_weights(experts, weights, E):
    dense = torch.zeros(len(experts), E, dtype=weights.dtype)
    for s in range(len(experts)):
        for j, e in enumerate(experts[s].tolist()):
            dense[s, e] = weights[s, j]
    return dense


# Sigmoid scoring and the expert bias.

def test_sigmoid_hand_made_weights_are_normalised_selected_scores():
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.0], [-3.0, 1.0, 0.5, 0.0]])
    plan = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid")
    assert [sorted(r) for r in plan.expert_idx_SK.tolist()] == [[0, 3], [1, 2]]
    s = torch.sigmoid(logits)
    w0 = torch.tensor([s[0, 0] / (s[0, 0] + s[0, 3]), s[0, 3] / (s[0, 0] + s[0, 3])])
    torch.testing.assert_close(plan.weight_SK[0].sort().values, w0.sort().values, rtol=RTOL, atol=ATOL)
    scaled = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid", norm_topk_prob=False,
                        routed_scaling_factor=2.5)
    torch.testing.assert_close(scaled.weight_SK.sum(1), 2.5 * torch.stack([s[0, 0] + s[0, 3], s[1, 1] + s[1, 2]]),
                               rtol=RTOL, atol=ATOL)


def test_bias_steers_selection_but_not_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.9])  # sigmoid(2) - sigmoid(-1) = 0.61 < 0.9: expert 3 ranks first, then 0
    plan = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid", expert_bias=bias)
    assert sorted(plan.expert_idx_SK[0].tolist()) == [0, 3]
    s = torch.sigmoid(logits[0])
    expected = {0: s[0] / (s[0] + s[3]), 3: s[3] / (s[0] + s[3])}
    for e, w in zip(plan.expert_idx_SK[0].tolist(), plan.weight_SK[0]):
        torch.testing.assert_close(w, expected[e], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_random_logits_choices_weights_and_gradients(scoring, k):
    torch.manual_seed(k)
    S, E = 40, 8
    logits = torch.randn(S, E, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, dtype=torch.float64) * 0.05
    plan = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, expert_bias=bias,
                      routed_scaling_factor=1.5)
    experts, weights = _reference_topk(logits, k, scoring, bias, scale=1.5)
    _same_choices(plan.expert_idx_SK, experts)
    got, want = weights_by_expert(plan, S, E), _reference_dense_weights(experts, weights, E)
    torch.testing.assert_close(got, want, **F64)
    probe = torch.randn(S, E, dtype=torch.float64)
    (grad,) = torch.autograd.grad((got * probe).sum(), logits)
    (grad_ref,) = torch.autograd.grad((want * probe).sum(), logits)
    torch.testing.assert_close(grad, grad_ref, **F64)


def test_gate_bias_moves_against_the_load_and_only_after_update_routing():
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=1, drop_tokens=False, scoring_func="sigmoid", bias_update_speed=0.1)
    with torch.no_grad():
        gate.wg.weight.zero_()
        gate.wg.weight[0, 0] = 5.0  # expert 0 takes every token with a positive first feature
    x = torch.randn(64, 6).abs()
    plan = gate(x)
    counts = plan.exp_counts
    assert int(counts[0]) == 64 and torch.equal(gate.expert_bias, torch.zeros(4)), "the bias moves only on update"
    gate(x)
    assert torch.equal(gate.step_counts, 2 * counts), "the step's counts cover every training forward"
    moe.update_routing(gate)
    mean = counts.double().mean()
    torch.testing.assert_close(gate.expert_bias, 0.1 * torch.sign(mean - counts.double()).float())
    assert int(gate.step_counts.sum()) == 0
    gate.eval()
    gate(x)
    assert int(gate.step_counts.sum()) == 0, "eval forwards do not count"
    gate.train()
    moe.update_routing(gate, skipped=True)
    torch.testing.assert_close(gate.expert_bias, 0.1 * torch.sign(mean - counts.double()).float())


def test_bias_stays_fp32_is_saved_and_step_counts_are_not():
    layer = MoE(8, nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), num_experts=4, k=2,
                scoring_func="sigmoid", bias_update_speed=1e-3)
    layer.deepspeed_moe.gate.expert_bias.fill_(1e-3)
    layer.to(torch.bfloat16)
    assert layer.expert_bias.dtype == torch.float32 and bool((layer.expert_bias == 1e-3).all())
    keys = layer.state_dict().keys()
    assert "deepspeed_moe.gate.expert_bias" in keys
    assert not any("step_counts" in key or "global_counts" in key for key in keys)


# The global-batch balance loss's counts, kept by the gate.

def test_gate_accumulates_global_counts_over_micro_batches():
    torch.manual_seed(3)
    gate = TopKGate(6, 4, k=2, drop_tokens=False, load_balancing_type="global_aux_loss").double()
    x1, x2 = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    first = gate(x1)
    second = gate(x2)
    total = first.exp_counts + second.exp_counts
    assert torch.equal(gate.global_counts, total)
    logits2 = x2 @ gate.wg.weight.t()
    torch.testing.assert_close(second.l_aux, reference_switch_loss(logits2, total, "softmax"), **F64)
    moe.update_routing(gate)
    assert int(gate.global_counts.sum()) == 0


# Group-limited routing.

def test_group_limited_hand_made():
    # E = 6 in 3 groups of 2; the best single expert (5) sits in a group whose pair sum is lowest
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.7, -4.0, 2.0]])
    plan = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid", n_group=3, topk_group=1)
    assert sorted(plan.expert_idx_SK[0].tolist()) == [0, 1]
    free = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid")
    assert sorted(free.expert_idx_SK[0].tolist()) == [0, 5]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("n_group,topk_group,k", [(4, 2, 2), (4, 1, 2), (2, 1, 3), (8, 3, 3)])
def test_group_limited_random_equals_reference(scoring, n_group, topk_group, k):
    torch.manual_seed(n_group * 10 + k)
    S, E = 32, 8
    logits = torch.randn(S, E, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(E, dtype=torch.float64) * 0.1
    plan = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, expert_bias=bias, n_group=n_group,
                      topk_group=topk_group)
    experts, weights = _reference_topk(logits, k, scoring, bias, n_group, topk_group)
    _same_choices(plan.expert_idx_SK, experts)
    got, want = weights_by_expert(plan, S, E), _reference_dense_weights(experts, weights, E)
    torch.testing.assert_close(got, want, **F64)
    size = E // n_group
    groups_reached = (plan.expert_idx_SK // size).tolist()
    assert max(len(set(r)) for r in groups_reached) <= topk_group


# Shared experts.

@pytest.mark.parametrize("gated", [False, True])
def test_shared_expert_adds_a_dense_mlp(gated):
    torch.manual_seed(8)
    M, H = 8, 6
    expert = nn.Sequential(nn.Linear(M, H), nn.SiLU(), nn.Linear(H, M))
    layer = MoE(M, expert, num_experts=4, k=2, n_shared_experts=2, shared_expert_gate=gated, drop_tokens=False)
    shared = layer.shared_expert
    assert shared[0].out_features == 2 * H and isinstance(shared[1], nn.SiLU)
    assert all(getattr(p, "allreduce", True) for p in shared.parameters()), "shared experts are dense"
    x = torch.randn(2, 5, M)
    out, _, _ = layer(x)
    routed = layer.deepspeed_moe(x.reshape(-1, M)).view_as(x)
    plain = shared(x) * (torch.sigmoid(layer.shared_expert_gate(x)) if gated else 1.0)
    torch.testing.assert_close(out, routed + plain, rtol=RTOL, atol=1e-6)
    out.sum().backward()
    assert shared[0].weight.grad is not None and (not gated or layer.shared_expert_gate.weight.grad is not None)


def test_shared_expert_module_is_used_as_given():
    block = nn.Linear(8, 8)
    layer = MoE(8, nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 8)), num_experts=2, shared_expert=block)
    assert layer.shared_expert is block


# Bad combinations fail at construction with one message.

EXPERT = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 8))


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_experts=6, k=2, n_group=4, topk_group=2), ValueError, r"n_group \(4\) must divide num_experts \(6\)"),
    (dict(num_experts=8, k=4, n_group=4, topk_group=1), ValueError, r"topk_group \* \(num_experts / n_group\) = 1 \* 2"),
    (dict(num_experts=8, k=2, n_group=4), ValueError, "needs both n_group and topk_group"),
    (dict(num_experts=8, k=2, n_group=4, topk_group=5), ValueError, r"topk_group \(5\) must be between 1 and n_group"),
    (dict(num_experts=4, scoring_func="relu"), ValueError, "scoring_func must be one of"),
    (dict(num_experts=4, load_balancing_type="z"), ValueError, "load_balancing_type must be one of"),
    (dict(num_experts=4, routing="random"), ValueError, "routing must be one of"),
    (dict(num_experts=4, bias_update_speed=-1.0), ValueError, "bias_update_speed must be a number >= 0"),
    (dict(num_experts=4, routing="expert_choice", dropless=True), ValueError, "dropless must be False"),
    (dict(num_experts=4, routing="expert_choice", scoring_func="sigmoid"), ValueError, "does not take scoring_func"),
    (dict(num_experts=4, routing="expert_choice", bias_update_speed=0.1), ValueError, "bias_update_speed"),
    (dict(num_experts=4, noisy_gate_policy="RSample", scoring_func="sigmoid"), ValueError, "RSample"),
    (dict(num_experts=4, routed_scaling_factor=0.0), ValueError, "routed_scaling_factor must be a number > 0"),
    (dict(num_experts=4, n_shared_experts=-1), ValueError, "n_shared_experts must be an int >= 0"),
    (dict(num_experts=4, shared_expert_gate=True), ValueError, "shared_expert_gate=True needs a shared expert"),
    (dict(num_experts=4, n_shared_experts=1, use_residual=True), ValueError, "choose one"),
    (dict(num_experts=4, n_shared_experts=1, shared_expert=nn.Linear(8, 8)), ValueError, "not both"),
])
def test_bad_combinations(kwargs, error, message):
    with pytest.raises(error, match=message):
        MoE(8, EXPERT, **kwargs)


def test_shared_experts_need_a_plain_mlp_to_widen():
    with pytest.raises(ValueError, match="pass shared_expert=<module>"):
        MoE(8, nn.Linear(8, 8), num_experts=2, n_shared_experts=1)


def test_sequence_loss_needs_batch_seq_hidden_input():
    layer = MoE(8, EXPERT, num_experts=4, k=2, load_balancing_type="seq_aux_loss")
    layer(torch.randn(2, 6, 8))
    with pytest.raises(ValueError, match=r"seq_aux_loss' needs tokens shaped \[batch, seq, hidden\]"):
        layer(torch.randn(12, 8))


# Every method in every layout (one process): the layouts agree.

METHODS = {
    "sigmoid-bias": dict(scoring_func="sigmoid", bias_update_speed=0.01, load_balancing_type="none"),
    "seq-loss": dict(scoring_func="sigmoid", load_balancing_type="seq_aux_loss"),
    "global-loss": dict(load_balancing_type="global_aux_loss"),
    "groups": dict(n_group=4, topk_group=2, scoring_func="sigmoid"),
    "shared": dict(n_shared_experts=1, shared_expert_gate=True),
}


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_methods_agree_across_layouts_and_dropless(method, k):
    M, H, E = 8, 12, 8
    results = {}
    for compute, dropless in (("padded", False), ("packed", False), ("grouped", False), ("packed", True),
                              ("grouped", True)):
        torch.manual_seed(9)
        expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
        layer = MoE(M, expert, num_experts=E, k=k, capacity_factor=4.0, min_capacity=0, use_rts=False,
                    top2_2nd_expert_sampling=False, expert_layout=compute, dropless=dropless, **METHODS[method])
        if layer.expert_bias is not None:
            layer.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))
        x = torch.randn(3, 8, M, requires_grad=True)
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
        results[(compute, dropless)] = (out, l_aux, x.grad, layer.deepspeed_moe.gate.wg.weight.grad)
    first = results[("padded", False)]
    for key, values in results.items():
        for a, b in zip(values, first):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=str(key))
