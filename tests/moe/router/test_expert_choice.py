"""Expert-choice routing (moe.router.expert_choice; Zhou et al. 2022) against a reference written here
from the paper: each expert takes the C tokens of highest score (ties: the lower token index), by
hand and on random logits with gradients (float64), with masked tokens never taken, and in every
expert layout of the layer (fp32 tolerance).
"""

import math

import pytest
import torch
from torch import nn

from moe import MoE, expert_choice_gating
from tests.moe.router.references import weights_by_expert

RTOL, ATOL = 1e-5, 1e-6
F64 = {"rtol": 1e-10, "atol": 1e-12}


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
    got = weights_by_expert(plan, S, E)
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
