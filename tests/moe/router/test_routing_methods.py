"""The routers of current MoE models against definitions written here from the papers' formulas.

Sigmoid scoring and the expert bias (DeepSeek-V3; Wang et al. 2024), the sequence-wise and
global-batch balance losses (DeepSeek-V3; Qiu et al. 2025), group-limited routing (DeepSeek-V2/V3),
expert-choice routing (Zhou et al. 2022) and shared experts (DeepSeekMoE, Qwen-MoE). Each reference
loops over tokens, sequences or experts in plain torch; chosen experts are compared exactly, weights,
losses and gradients within fp32 tolerance (float64 where a gradient is compared).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moe
from moe import MoE, TopKGate, expert_choice_gating, topkgating
from moe.router.balancing import update_bias

RTOL, ATOL = 1e-5, 1e-6
F64 = {"rtol": 1e-10, "atol": 1e-12}


# References, one token, sequence or expert at a time.

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


def _normalized(logits, scoring):
    s = torch.softmax(logits, 1) if scoring == "softmax" else torch.sigmoid(logits)
    return s / s.sum(1, keepdim=True)


def _reference_seq_loss(logits, experts_SK, seq_len, scoring):
    """DeepSeek-V3: per sequence f_i = E / (K T) sum_t 1(i chosen at t), P_i = mean_t s'_{i,t}; mean over sequences."""
    S, E = logits.shape
    K = experts_SK.shape[1]
    probs = _normalized(logits, scoring)
    losses = []
    for b in range(S // seq_len):
        rows = range(b * seq_len, (b + 1) * seq_len)
        f = torch.zeros(E, dtype=logits.dtype)
        for t in rows:
            for e in experts_SK[t].tolist():
                f[e] += E / (K * seq_len)
        P = probs[list(rows)].mean(0)
        losses.append((f * P).sum())
    return torch.stack(losses).mean()


def _reference_switch_loss(logits, counts, scoring):
    """E * sum_i f_i P_i, f_i = c_i / sum_j c_j (counts given, so f carries no gradient)."""
    E = logits.shape[1]
    f = counts.to(logits.dtype) / counts.sum()
    return E * (f * _normalized(logits, scoring).mean(0)).sum()


def _same_choices(plan_SK, reference_SK):
    """The same set of experts per token (the column order of a top-k is not part of the contract)."""
    assert sorted(map(sorted, plan_SK.tolist())) == sorted(map(sorted, reference_SK.tolist()))
    assert [sorted(r) for r in plan_SK.tolist()] == [sorted(r) for r in reference_SK.tolist()]


def _weights_by_expert(plan, S, E):
    dense = torch.zeros(S, E, dtype=plan.weight_SK.dtype)
    kept = plan.expert_idx_SK >= 0
    rows = torch.arange(S).unsqueeze(1).expand_as(plan.expert_idx_SK)[kept]
    return dense.index_put((rows, plan.expert_idx_SK[kept]), plan.weight_SK[kept], accumulate=True)


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
    got, want = _weights_by_expert(plan, S, E), _reference_dense_weights(experts, weights, E)
    torch.testing.assert_close(got, want, **F64)
    probe = torch.randn(S, E, dtype=torch.float64)
    (grad,) = torch.autograd.grad((got * probe).sum(), logits)
    (grad_ref,) = torch.autograd.grad((want * probe).sum(), logits)
    torch.testing.assert_close(grad, grad_ref, **F64)


def test_bias_after_several_updates_follows_the_sign_rule():
    u = 0.01
    counts_steps = [torch.tensor([5, 1, 2, 0]), torch.tensor([2, 2, 2, 2]), torch.tensor([0, 7, 1, 0])]
    bias = torch.zeros(4)
    expected = [0.0] * 4
    for counts in counts_steps:
        update_bias(bias, counts, u)
        mean = sum(counts.tolist()) / 4
        expected = [b + u * ((mean > c) - (mean < c)) for b, c in zip(expected, counts.tolist())]
    torch.testing.assert_close(bias, torch.tensor(expected), rtol=0, atol=1e-7)


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


# Balance losses.

@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_sequence_loss_and_its_gradient_equal_the_per_sequence_formula(scoring):
    torch.manual_seed(1)
    B, T, E, k = 3, 10, 6, 2
    logits = torch.randn(B * T, E, dtype=torch.float64, requires_grad=True)
    plan = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, load_balancing_type="seq_aux_loss",
                      seq_len=T)
    reference = _reference_seq_loss(logits, plan.expert_idx_SK, T, scoring)
    torch.testing.assert_close(plan.l_aux, reference, **F64)
    (grad,) = torch.autograd.grad(plan.l_aux, logits)
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, grad_ref, **F64)


def test_sequence_loss_hand_made_value():
    # two sequences of two tokens, E = 2, k = 1, equal logits: P = 1/2 each; sequence 0 sends both tokens to
    # expert 0 (f = [2, 0]), sequence 1 one to each (f = [1, 1]): losses 1 and 1, mean 1.
    logits = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    plan = topkgating(logits, 1, 1.0, 0, drop_tokens=False, load_balancing_type="seq_aux_loss", seq_len=2)
    p = torch.softmax(torch.tensor([1.0, 0.0]), 0)
    seq0 = 2 * (1.0 * p[0])  # f = [1, 0] as fractions, E = 2
    seq1 = 2 * (0.5 * (p[0] + p[1]) / 2 + 0.5 * (p[1] + p[0]) / 2)
    torch.testing.assert_close(plan.l_aux, (seq0 + seq1) / 2, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_global_loss_uses_given_counts_and_differentiates_through_p_only(scoring):
    torch.manual_seed(2)
    S, E, k = 24, 8, 2
    logits = torch.randn(S, E, dtype=torch.float64, requires_grad=True)
    outside = torch.randint(0, 50, (E,))
    plan = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, load_balancing_type="global_aux_loss",
                      global_counts=lambda counts: counts + outside)
    reference = _reference_switch_loss(logits, plan.exp_counts + outside, scoring)
    torch.testing.assert_close(plan.l_aux, reference, **F64)
    (grad,) = torch.autograd.grad(plan.l_aux, logits)
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, grad_ref, **F64)
    alone = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, load_balancing_type="global_aux_loss")
    torch.testing.assert_close(alone.l_aux, _reference_switch_loss(logits, plan.exp_counts, scoring), **F64)


def test_gate_accumulates_global_counts_over_micro_batches():
    torch.manual_seed(3)
    gate = TopKGate(6, 4, k=2, drop_tokens=False, load_balancing_type="global_aux_loss").double()
    x1, x2 = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 6, dtype=torch.float64)
    first = gate(x1)
    second = gate(x2)
    total = first.exp_counts + second.exp_counts
    assert torch.equal(gate.global_counts, total)
    logits2 = x2 @ gate.wg.weight.t()
    torch.testing.assert_close(second.l_aux, _reference_switch_loss(logits2, total, "softmax"), **F64)
    moe.update_routing(gate)
    assert int(gate.global_counts.sum()) == 0


def test_no_balance_loss_and_defaults_unchanged():
    torch.manual_seed(4)
    logits = torch.randn(20, 4)
    assert float(topkgating(logits, 2, 1.0, 0, load_balancing_type="none").l_aux) == 0.0
    gates = torch.softmax(logits, 1)
    plan = topkgating(logits, 3, 1.0, 0)
    torch.testing.assert_close(plan.l_aux, 4 * (gates.mean(0) * plan.exp_counts / (20 * 3)).sum(), rtol=RTOL, atol=ATOL)


def test_sigmoid_aux_loss_takes_p_from_normalised_scores():
    torch.manual_seed(5)
    logits = torch.randn(30, 6, dtype=torch.float64)
    plan = topkgating(logits, 2, 1.0, 0, drop_tokens=False, scoring_func="sigmoid")
    torch.testing.assert_close(plan.l_aux, _reference_switch_loss(logits, plan.exp_counts, "sigmoid"), **F64)


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
    got, want = _weights_by_expert(plan, S, E), _reference_dense_weights(experts, weights, E)
    torch.testing.assert_close(got, want, **F64)
    size = E // n_group
    groups_reached = (plan.expert_idx_SK // size).tolist()
    assert max(len(set(r)) for r in groups_reached) <= topk_group


# Expert choice.

def _reference_expert_choice(logits, capacity_factor):
    S, E = logits.shape
    C = min(math.ceil(S * capacity_factor / E), S)
    scores = torch.softmax(logits, 1)
    dense = torch.zeros(S, E, dtype=logits.dtype)
    for e in range(E):
        tokens = sorted(range(S), key=lambda s: (-scores[s, e].item(), s))[:C]
        for s in tokens:
            dense[s, e] = scores[s, e]
    return dense, C


def test_expert_choice_hand_made():
    # 4 tokens, 2 experts, C = ceil(4 * 1 / 2) = 2: expert 0 takes tokens 0 and 1, expert 1 tokens 3 and 2
    logits = torch.tensor([[3.0, 0.0], [2.0, 0.0], [0.0, 0.5], [0.0, 3.0]])
    plan = expert_choice_gating(logits, 1.0)
    assert plan.capacity == 2 and plan.expert_idx_SK.shape == (4, 2)
    assert plan.expert_idx_SK.tolist() == [[0, -1], [0, -1], [-1, 1], [-1, 1]]
    assert plan.slot_SK.tolist() == [[0, -1], [1, -1], [-1, 0], [-1, 1]]
    scores = torch.softmax(logits, 1)
    torch.testing.assert_close(plan.weight_SK.sum(1), torch.stack([scores[0, 0], scores[1, 0], scores[2, 1],
                                                                   scores[3, 1]]), rtol=RTOL, atol=ATOL)
    assert plan.exp_counts.tolist() == [2, 2] and float(plan.l_aux) == 0.0


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 2.0, 3.5])
def test_expert_choice_random_equals_reference_with_gradients(capacity_factor):
    torch.manual_seed(int(capacity_factor * 10))
    S, E = 30, 6
    logits = torch.randn(S, E, dtype=torch.float64, requires_grad=True)
    plan = expert_choice_gating(logits, capacity_factor)
    want, C = _reference_expert_choice(logits, capacity_factor)
    assert plan.capacity == C and plan.kept_counts().tolist() == [C] * E
    got = _weights_by_expert(plan, S, E)
    torch.testing.assert_close(got, want, **F64)
    probe = torch.randn(S, E, dtype=torch.float64)
    (grad,) = torch.autograd.grad((got * probe).sum(), logits)
    (grad_ref,) = torch.autograd.grad((want * probe).sum(), logits)
    torch.testing.assert_close(grad, grad_ref, **F64)


def test_expert_choice_layer_every_layout_equals_the_reference():
    torch.manual_seed(6)
    M, H, E, S = 8, 12, 4, 20
    expert = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
    outputs = {}
    for compute in ("padded", "packed", "grouped"):
        torch.manual_seed(7)
        layer = MoE(M, expert, num_experts=E, routing="expert_choice", capacity_factor=1.5, expert_layout=compute)
        x = torch.randn(S, M)
        outputs[compute] = layer(x)[0]
    torch.manual_seed(7)
    layer = MoE(M, expert, num_experts=E, routing="expert_choice", capacity_factor=1.5)
    x = torch.randn(S, M)
    logits = x @ layer.deepspeed_moe.gate.wg.weight.t()
    weights, _ = _reference_expert_choice(logits, 1.5)
    reference = torch.zeros(S, M)
    for e in range(E):
        copy = nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))
        copy.load_state_dict(expert.state_dict())
        reference += weights[:, e:e + 1] * copy(x)
    for compute, out in outputs.items():
        torch.testing.assert_close(out, reference, rtol=RTOL, atol=1e-5, msg=compute)


def test_expert_choice_used_token_never_chosen():
    logits = torch.randn(8, 2)
    used = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0])
    plan = expert_choice_gating(logits, 2.0, used_token=used)  # C = 8 > 3 used tokens
    assert bool((plan.expert_idx_SK[3:] == -1).all()) and plan.kept_counts().tolist() == [3, 3]


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
