"""Routing semantics of top1gating, top2gating and topkgating on hand-made and random logits.

Exact slots, drops and counts are compared exactly; weights and losses with fp32 tolerances. A dense
reference written the way DeepSpeed computes it (one-hot masks and cumulative sums over [S, E])
checks the plans on random logits. The capacity formula and the kept counts have their tests in
test_plan.py, the balance loss worked out by hand in test_balancing.py.
"""

import pytest
import torch
import torch.nn.functional as F

from moe import top1gating, top2gating, topkgating

RTOL, ATOL = 1e-5, 1e-6


def _logits(choices, num_experts, margin=4.0):
    """Logits whose argmax per token is `choices[s]`, with the remaining experts in index order."""
    S = len(choices)
    logits = -torch.arange(num_experts, dtype=torch.float32).repeat(S, 1) * 0.1
    logits[torch.arange(S), torch.tensor(choices)] = margin
    return logits


def _deepspeed_l_aux(logits, chosen_SK, k):
    """DeepSpeed's balance loss as sharded_moe writes it: mean(me * ce) * E * E / k, with me the mean gate
    probability per expert and ce the mean of the [S, E] mask of the counted choices (top-1 and top-2 count
    first choices with k = 1, top-k counts all k choices). Choices are counted before capacity drops."""
    gates = F.softmax(logits.double(), dim=1)
    num_experts = gates.shape[1]
    mask = torch.zeros_like(gates).scatter_(1, chosen_SK, 1.0)
    me, ce = gates.mean(0), mask.mean(0)
    return (torch.mean(me * ce) * num_experts * num_experts / k).float()


def test_top1_first_come_drops_weights_counts_and_loss():
    choices = [0, 0, 1, 0, 2, 0, 1, 3]
    logits = _logits(choices, 4)
    plan = top1gating(logits, capacity_factor=1.0, min_capacity=0, use_rts=False)
    assert plan.capacity == 2
    assert plan.expert_idx_SK[:, 0].tolist() == [0, 0, 1, -1, 2, -1, 1, 3]
    assert plan.slot_SK[:, 0].tolist() == [0, 1, 0, -1, 0, -1, 1, 0]
    assert plan.exp_counts.tolist() == [4, 2, 1, 1]
    gates = F.softmax(logits, dim=1)
    expected = torch.tensor([gates[s, c] if c >= 0 else 0.0 for s, c in enumerate(plan.expert_idx_SK[:, 0].tolist())])
    torch.testing.assert_close(plan.weight_SK[:, 0], expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.l_aux, _deepspeed_l_aux(logits, torch.tensor(choices).unsqueeze(1), 1),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.z_loss, torch.logsumexp(logits, 1).square().mean(), rtol=RTOL, atol=ATOL)


def test_top1_random_token_selection_keeps_capacity_and_token_order():
    choices = [0] * 6 + [1, 2]
    logits = _logits(choices, 4)
    torch.manual_seed(3)
    plan = top1gating(logits, 1.0, 0, use_rts=True)
    kept = (plan.expert_idx_SK[:6, 0] == 0).nonzero().squeeze(1).tolist()
    assert len(kept) == plan.capacity == 2
    assert plan.slot_SK[kept, 0].tolist() == [0, 1]  # kept tokens take slots in token order
    picks = set()
    for seed in range(20):
        torch.manual_seed(seed)
        plan = top1gating(logits, 1.0, 0, use_rts=True)
        picks.add(tuple((plan.expert_idx_SK[:6, 0] == 0).nonzero().squeeze(1).tolist()))
    assert len(picks) > 1, "random token selection should not always keep the same tokens"


def test_top1_used_token_and_dropless():
    choices = [0, 0, 0, 1]
    logits = _logits(choices, 2)
    used = torch.tensor([1, 0, 1, 1])
    plan = top1gating(logits, 1.0, 0, used_token=used, use_rts=False)
    assert plan.expert_idx_SK[:, 0].tolist() == [0, -1, 0, 1]
    assert plan.exp_counts.tolist() == [2, 1]
    assert plan.weight_SK[1, 0].item() == 0.0
    dropless = top1gating(logits, 0.1, 100, drop_tokens=False)
    assert dropless.capacity == 3 and bool(dropless.kept_SK.all())


def test_top1_rsample_noise_picks_by_noisy_logits():
    logits = torch.zeros(4000, 4)
    torch.manual_seed(0)
    plan = top1gating(logits, 4.0, 0, noisy_gate_policy="RSample", drop_tokens=False)
    counts = plan.exp_counts.float()
    assert counts.min() > 800, "Gumbel noise on equal logits should spread tokens evenly"
    clear = _logits([1, 2, 3], 4, margin=50.0)
    plan = top1gating(clear, 4.0, 0, noisy_gate_policy="RSample")
    assert plan.expert_idx_SK[:, 0].tolist() == [1, 2, 3]


def test_top2_slots_second_choices_after_first_and_renormalised():
    # first choices: 0,0,1,0 ; second (next best by logits, index order): 1,1,0,1
    logits = _logits([0, 0, 1, 0], 3)
    plan = top2gating(logits, capacity_factor=0.5, min_capacity=3, top2_2nd_expert_sampling=False)
    assert plan.capacity == 3
    assert plan.expert_idx_SK.tolist() == [[0, 1], [0, 1], [1, -1], [0, -1]]
    # expert 0: firsts at tokens 0,1,3 -> slots 0,1,2; second at token 2 -> slot 3 >= C: dropped
    # expert 1: first at token 2 -> slot 0; seconds at tokens 0,1,3 -> slots 1,2,3 (token 3 dropped)
    assert plan.slot_SK.tolist() == [[0, 1], [1, 2], [0, -1], [2, -1]]
    assert plan.exp_counts.tolist() == [4, 4, 0]
    gates = F.softmax(logits, dim=1)
    w0 = gates[0, 0] / (gates[0, 0] + gates[0, 1])
    torch.testing.assert_close(plan.weight_SK[0], torch.stack([w0, 1 - w0]), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.weight_SK[3], torch.tensor([1.0, 0.0]), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.weight_SK[2], torch.tensor([1.0, 0.0]), rtol=RTOL, atol=ATOL)
    first = torch.tensor([[0], [0], [1], [0]])  # DeepSpeed's top-2 loss counts first choices only
    torch.testing.assert_close(plan.l_aux, _deepspeed_l_aux(logits, first, 1), rtol=RTOL, atol=ATOL)


def test_top2_sampling_never_repeats_the_first_expert():
    torch.manual_seed(0)
    logits = torch.randn(512, 8)
    plan = top2gating(logits, 4.0, 0, top2_2nd_expert_sampling=True)
    assert bool((plan.expert_idx_SK[:, 0] != plan.expert_idx_SK[:, 1]).all())
    assert plan.expert_idx_SK[:, 0].tolist() == logits.argmax(1).tolist()


def test_topk_position_and_probs_policies():
    # 4 tokens, 4 experts, k=3; expert 3 is everyone's third choice, expert 0 everyone's first
    logits = torch.tensor([[3.0, 2.0, -5, 1.0], [3.0, 2.0, -5, 1.5], [3.0, -5, 2.0, 0.5], [3.0, 2.0, -5, 1.2]])
    position = topkgating(logits, 3, capacity_factor=0.5, min_capacity=2, drop_policy="position")
    assert position.capacity == 2
    assert position.expert_idx_SK[:, 0].tolist() == [0, 0, -1, -1]
    assert position.slot_SK.tolist() == [[0, 0, 0], [1, 1, 1], [-1, 0, -1], [-1, -1, -1]]
    probs = topkgating(logits, 3, capacity_factor=0.5, min_capacity=2, drop_policy="probs")
    gates = F.softmax(logits, 1)
    for e in range(4):
        chosen = [s for s in range(4) if e in probs.expert_idx_SK[s].tolist()]
        candidates = [s for s in range(4) if e in torch.topk(logits[s], 3).indices.tolist()]
        best = sorted(candidates, key=lambda s: -gates[s, e].item())[:2]
        assert sorted(chosen) == sorted(best), f"expert {e}"
        slots = [probs.slot_SK[s, probs.expert_idx_SK[s].tolist().index(e)].item() for s in sorted(chosen)]
        assert slots == list(range(len(chosen)))
    total = probs.weight_SK.sum(1)
    kept_any = probs.kept_SK.any(1)
    torch.testing.assert_close(total[kept_any], torch.ones(int(kept_any.sum())), rtol=RTOL, atol=ATOL)
    assert probs.exp_counts.tolist() == [4, 3, 1, 4]
    top3 = torch.tensor([[0, 1, 3], [0, 1, 3], [0, 2, 3], [0, 1, 3]])  # every token's three best, before drops
    torch.testing.assert_close(probs.l_aux, _deepspeed_l_aux(logits, top3, 3), rtol=RTOL, atol=ATOL)


def _dense_reference(logits, k, capacity, policy):
    """DeepSpeed's dense construction: one-hot masks, cumulative sums over tokens, [S, E, C] tensors."""
    gates = F.softmax(logits, 1)
    S, E = gates.shape
    if k == 1:
        mask = F.one_hot(gates.argmax(1), E)
        loc = torch.cumsum(mask, 0) - 1
        mask = mask * (loc < capacity)
        loc = torch.cumsum(mask, 0) - 1
        weights = gates * mask
    elif k == 2:
        m1 = F.one_hot(gates.argmax(1), E)
        m2 = F.one_hot(logits.masked_fill(m1.bool(), float("-inf")).argmax(1), E)
        l1 = torch.cumsum(m1, 0) - 1
        l2 = torch.cumsum(m2, 0) - 1 + m1.sum(0, keepdim=True)
        m1, m2 = m1 * (l1 < capacity), m2 * (l2 < capacity)
        w = gates * m1 + gates * m2
        weights = w / w.sum(1, keepdim=True).clamp(min=torch.finfo(w.dtype).eps)
        mask, loc = m1 + m2, l1 * m1 + l2 * m2
    else:
        top = torch.topk(gates, k, 1).indices
        mask = torch.zeros_like(gates, dtype=torch.long).scatter(1, top, 1)
        if policy == "position":
            mask = mask * ((torch.cumsum(mask, 0) - 1) < capacity)
        else:
            score = torch.where(mask.bool(), gates, torch.full_like(gates, -1.0))
            order = torch.argsort(-score, dim=0, stable=True)
            rank = torch.empty_like(order).scatter_(0, order, torch.arange(S).unsqueeze(1).expand(S, E))
            mask = mask * (rank < capacity)
        loc = torch.cumsum(mask, 0) - 1
        w = gates * mask
        weights = w / w.sum(1, keepdim=True).clamp(min=torch.finfo(w.dtype).eps)
    combine = torch.zeros(S, E, capacity)
    for s, e in mask.nonzero().tolist():
        combine[s, e, loc[s, e]] = weights[s, e]
    return combine


@pytest.mark.parametrize("k,policy", [(1, None), (2, None), (3, "position"), (3, "probs"), (4, "probs")])
@pytest.mark.parametrize("seed", [0, 1])
def test_plans_match_dense_deepspeed_construction(k, policy, seed):
    torch.manual_seed(seed)
    logits = torch.randn(48, 6) * 2
    if k == 1:
        plan = top1gating(logits, 0.8, 0, use_rts=False)
    elif k == 2:
        plan = top2gating(logits, 0.8, 0, top2_2nd_expert_sampling=False)
    else:
        plan = topkgating(logits, k, 0.8, 0, drop_policy=policy)
    combine, dispatch = plan.dense()
    expected = _dense_reference(logits, k, plan.capacity, policy)
    counted = logits.argmax(1, keepdim=True) if k <= 2 else torch.topk(logits, k, 1).indices
    torch.testing.assert_close(plan.l_aux, _deepspeed_l_aux(logits, counted, 1 if k <= 2 else k), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(combine, expected, rtol=RTOL, atol=ATOL)
    assert torch.equal(dispatch, expected > 0)
    assert combine.shape == (48, 6, plan.capacity)


@pytest.mark.parametrize("k", [1, 2])
def test_gradients_flow_from_combine_weights_to_logits(k):
    """A loss of the combine weights alone (no l_aux, no z_loss) gives the logits the gradient of
    softmax -> gather the chosen experts (-> renormalise over the kept choices for top-2)."""
    torch.manual_seed(0)
    logits = torch.randn(16, 4, dtype=torch.float64, requires_grad=True)
    coeff_SK = torch.randn(16, k, dtype=torch.float64)
    if k == 1:
        plan = top1gating(logits, 0.5, 0, use_rts=False, load_balancing_type="none")
    else:
        plan = top2gating(logits, 0.5, 0, top2_2nd_expert_sampling=False, load_balancing_type="none")
    assert bool((plan.expert_idx_SK < 0).any()), "some choices should be dropped here"
    loss = (plan.weight_SK * coeff_SK).sum()
    assert loss.requires_grad, "the combine weights carry no gradient"
    loss.backward()
    assert logits.grad.abs().sum() > 0, "no gradient reaches the logits from the weights"

    reference = logits.detach().clone().requires_grad_()
    kept_SK = plan.expert_idx_SK >= 0
    chosen_SK = F.softmax(reference, 1).gather(1, plan.expert_idx_SK.clamp(min=0)) * kept_SK
    if k == 2:
        # a token whose choices were all dropped keeps weights 0: DeepSpeed clamps the denominator the same way
        chosen_SK = chosen_SK / chosen_SK.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float64).eps)
    (chosen_SK * coeff_SK).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: top1gating(torch.randn(8, 4), 1.0, 0, noisy_gate_policy="Gaussian"), "noisy_gate_policy"),
        (lambda: topkgating(torch.randn(8, 4), 0, 1.0, 0), r"k \(0\) must be between 1 and num_experts \(4\)"),
        (lambda: topkgating(torch.randn(8, 4), 5, 1.0, 0), r"k \(5\) must be between 1 and num_experts \(4\)"),
        (lambda: top2gating(torch.randn(8, 1), 1.0, 0), r"k \(2\) must be between 1 and num_experts \(1\)"),
        (lambda: top1gating(torch.randn(3, 4), 1.0, 4), r"number of tokens \(3\) must be >= min_capacity \(4\)"),
        (lambda: top1gating(torch.tensor([[0.0, float("nan")]] * 4), 1.0, 0), "non-finite"),
        (lambda: topkgating(torch.randn(8, 4), 2, 1.0, 0, drop_policy="random"), "drop_policy"),
        (lambda: top1gating(torch.randn(8, 4), 0.0, 0), "capacity_factor must be > 0"),
        (lambda: top1gating(torch.randn(8), 1.0, 0), r"logits must have shape \[S, E\]"),
    ],
)
def test_bad_inputs_name_the_value(call, message, monkeypatch):
    monkeypatch.setenv("MOE_SYNC_CHECKS", "1")  # the non-finite check reads a device value: opt-in
    with pytest.raises(ValueError, match=message):
        call()


def test_non_finite_check_is_off_by_default(monkeypatch):
    monkeypatch.delenv("MOE_SYNC_CHECKS", raising=False)
    plan = top1gating(torch.tensor([[0.0, float("nan")]] * 4), 1.0, 0)  # no host read, so no error
    assert plan.expert_idx_SK.shape == (4, 1)
