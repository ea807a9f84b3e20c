"""moe.router.balancing against its formulas: DeepSpeed's balance loss on hand-counted probabilities,
the sequence-wise loss (DeepSeek-V3) and the global-batch loss (Qiu et al. 2025) with their gradients
against per-sequence and Switch-form references, sigmoid scores normalised for P, no loss at all, and
the auxiliary-loss-free expert bias update (Wang et al. 2024). Values within fp32 tolerance, float64
where a gradient is compared.
"""

import pytest
import torch

from moe import top1gating, top2gating, topkgating
from moe.router.balancing import update_bias
from tests.moe.router.references import normalized, reference_switch_loss

RTOL, ATOL = 1e-5, 1e-6
F64 = {"rtol": 1e-10, "atol": 1e-12}


# Probabilities in sixteenths, so that every balance loss below is a fraction computed by hand.
# first choices: 0, 0, 1, 3; second choices: 1, 2, 2, 1
HAND_PROBS = torch.tensor([[8, 4, 3, 1], [8, 1, 4, 3], [1, 8, 4, 3], [3, 4, 1, 8]], dtype=torch.float32) / 16


def test_balance_loss_equals_hand_counts_in_deepspeed_form():
    """l_aux = mean(me * ce) * E * E / k on HAND_PROBS, worked out by hand (and checked once against DeepSpeed).

    me, the mean probability per expert, is [20, 17, 12, 15] / 64.
    top-1 and top-2 count first choices with k = 1: ce = [2, 1, 0, 1] / 4, so
        l_aux = 16 * mean(me * ce) = 4 * (40 + 17 + 0 + 15) / 256 = 9 / 8,
        the same when capacity 1 drops token 1's choice: choices are counted before drops.
    top-1 with token 1 unused: ce = [1, 1, 0, 1] / 4 (still over 4 tokens): 4 * (20 + 17 + 15) / 256 = 13 / 16.
    top-k with k = 2 counts both choices: ce = [2, 3, 2, 1] / 4, so
        l_aux = 16 / 2 * mean(me * ce) = 2 * (40 + 51 + 24 + 15) / 256 = 65 / 64.
    """
    logits = HAND_PROBS.log()
    top1 = top1gating(logits, 1.0, 0, use_rts=False)
    assert top1.capacity == 1 and top1.expert_idx_SK[:, 0].tolist() == [0, -1, 1, 3]
    assert abs(top1.l_aux.item() - 9 / 8) < 1e-6
    unused = top1gating(logits, 4.0, 0, used_token=torch.tensor([1, 0, 1, 1]), use_rts=False)
    assert abs(unused.l_aux.item() - 13 / 16) < 1e-6
    top2 = top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False)
    assert top2.expert_idx_SK.tolist() == [[0, 1], [0, 2], [1, 2], [3, -1]]  # capacity 2: token 3's second dropped
    assert abs(top2.l_aux.item() - 9 / 8) < 1e-6
    topk = topkgating(logits, 2, 4.0, 0)
    assert sorted(map(sorted, topk.expert_idx_SK.tolist())) == [[0, 1], [0, 2], [1, 2], [1, 3]]
    assert abs(topk.l_aux.item() - 65 / 64) < 1e-6


def _reference_seq_loss(logits, experts_SK, seq_len, scoring):
    """DeepSeek-V3: per sequence f_i = E / (K T) sum_t 1(i chosen at t), P_i = mean_t s'_{i,t}; mean over sequences."""
    S, E = logits.shape
    K = experts_SK.shape[1]
    probs = normalized(logits, scoring)
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
    reference = reference_switch_loss(logits, plan.exp_counts + outside, scoring)
    torch.testing.assert_close(plan.l_aux, reference, **F64)
    (grad,) = torch.autograd.grad(plan.l_aux, logits)
    (grad_ref,) = torch.autograd.grad(reference, logits)
    torch.testing.assert_close(grad, grad_ref, **F64)
    alone = topkgating(logits, k, 1.0, 0, drop_tokens=False, scoring_func=scoring, load_balancing_type="global_aux_loss")
    torch.testing.assert_close(alone.l_aux, reference_switch_loss(logits, plan.exp_counts, scoring), **F64)


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
    torch.testing.assert_close(plan.l_aux, reference_switch_loss(logits, plan.exp_counts, "sigmoid"), **F64)


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
