"""The router module TopKGate: its noise policies, eval mode, fp32 computation and Jitter, each checked
against the policies it calls on hand-made logits.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moe import MoE, Routing, TopKGate, top1gating, top2gating, topkgating

RTOL, ATOL = 1e-5, 1e-6


def test_gate_takes_none_jitter_or_rsample_and_refuses_the_string_none():
    """No noise is None; the recipes' flag spells it "None" and translates it before the gate."""
    for policy in (None, "Jitter", "RSample"):
        assert TopKGate(8, 4, noisy_gate_policy=policy).config.noisy_gate_policy == policy
    refusal = r"^noisy_gate_policy must be one of \(None, 'Jitter', 'RSample'\), got 'None'$"
    with pytest.raises(ValueError, match=refusal):
        TopKGate(8, 4, noisy_gate_policy="None")


def test_gate_eval_uses_eval_capacity_and_no_noise():
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=2, capacity_factor=1.0, eval_capacity_factor=3.0, min_capacity=0, noisy_gate_policy="Jitter")
    x = torch.randn(32, 8)
    assert gate(x).capacity == math.ceil(32 / 4 * 1.0 * 2)
    gate.eval()
    first, second = gate(x), gate(x)
    assert first.capacity == math.ceil(32 / 4 * 3.0 * 2)
    assert torch.equal(first.expert_idx_SK, second.expert_idx_SK)
    logits = x @ gate.wg.weight.t()
    assert first.expert_idx_SK[:, 1].tolist() == logits.scatter(1, logits.argmax(1, keepdim=True), float("-inf")).argmax(1).tolist()


@pytest.mark.parametrize("case", ["bf16 gate", "fp16 gate", "fp32 gate under bf16 autocast"])
def test_gate_computes_logits_and_softmax_in_fp32_for_half_inputs(case):
    """The plan equals routing fp32 logits of the same (half) values; a half computation lies outside the
    tolerance, so the comparison tells the two apart."""
    dtype = {"bf16 gate": torch.bfloat16, "fp16 gate": torch.float16}.get(case, torch.float32)
    torch.manual_seed(0)
    gate = TopKGate(64, 8, k=1, min_capacity=0, use_rts=False).to(dtype)
    x = torch.randn(256, 64).to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.endswith("autocast")):
        plan = gate(x)
        half = top1gating(F.linear(x, gate.wg.weight), 1.0, 0, use_rts=False)  # logits rounded to 16 bits
    assert isinstance(plan, Routing) and gate.wg.weight.dtype == dtype
    expected = top1gating(x.double() @ gate.wg.weight.double().t(), 1.0, 0, use_rts=False)
    assert plan.weight_SK.dtype == torch.float32
    assert torch.equal(plan.expert_idx_SK, expected.expert_idx_SK), "choices differ from routing fp32 logits"
    torch.testing.assert_close(plan.weight_SK, expected.weight_SK.float(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.z_loss, expected.z_loss.float(), rtol=RTOL, atol=ATOL)
    assert not torch.allclose(half.weight_SK, expected.weight_SK.float(), rtol=RTOL, atol=ATOL), \
        "a 16-bit computation should differ here beyond the tolerance"


JITTER_EPS = 1e-2  # DeepSpeed's multiplicative_jitter epsilon


@pytest.mark.parametrize("k", [1, 2])
def test_jitter_multiplies_the_gate_input_by_uniform_noise_in_training_only(k):
    """Jitter alone (no random token selection, no second-expert sampling): in training the plan is that of
    the logits of x * U(1 - eps, 1 + eps), the noise drawn as DeepSpeed draws it from the same RNG state;
    in eval it is the plan of the logits of x."""
    torch.manual_seed(0)
    S, M, E = 512, 8, 8
    gate = TopKGate(M, E, k=k, capacity_factor=float(E), eval_capacity_factor=float(E), min_capacity=0,
                    noisy_gate_policy="Jitter", use_rts=False, top2_2nd_expert_sampling=False)
    x = torch.randn(S, M)
    weight = gate.wg.weight.detach()

    def route(x_SM):
        logits = x_SM @ weight.t()
        if k == 1:
            return top1gating(logits, float(E), 0, use_rts=False)
        return top2gating(logits, float(E), 0, top2_2nd_expert_sampling=False)

    torch.manual_seed(5)
    plan = gate(x)
    torch.manual_seed(5)
    noise = (1 - JITTER_EPS) + 2 * JITTER_EPS * torch.rand(S, M)  # Uniform(1 - eps, 1 + eps).rsample
    expected, clean = route(x * noise), route(x)
    assert torch.equal(plan.expert_idx_SK, expected.expert_idx_SK), "training choices differ from x * noise"
    torch.testing.assert_close(plan.weight_SK, expected.weight_SK, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(plan.z_loss, expected.z_loss, rtol=RTOL, atol=ATOL)
    assert not torch.equal(plan.expert_idx_SK, clean.expert_idx_SK), "the noise should move some choices here"

    gate.eval()
    evaluated = gate(x)
    assert torch.equal(evaluated.expert_idx_SK, clean.expert_idx_SK), "eval choices differ from the noiseless ones"
    torch.testing.assert_close(evaluated.weight_SK, clean.weight_SK, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(evaluated.z_loss, clean.z_loss, rtol=RTOL, atol=ATOL)


def test_router_bias_is_off_by_default_and_must_be_a_bool():
    gate = TopKGate(8, 4, k=2)
    assert gate.wg.bias is None and sorted(gate.state_dict()) == ["wg.weight"]
    with pytest.raises(TypeError, match=r"^router_bias must be True or False, got 'yes'$"):
        TopKGate(8, 4, router_bias="yes")


def test_router_bias_enters_the_logits_that_select_and_weigh_and_gets_its_gradient():
    """logits = x W^T + b: the plan and every gradient equal topkgating's on those logits. With
    norm_topk_prob the weights are the softmax over each token's k largest logits (GPT-OSS's router)."""
    torch.manual_seed(0)
    gate = TopKGate(8, 6, k=2, min_capacity=0, drop_tokens=False, norm_topk_prob=True, router_bias=True)
    assert MoE(8, torch.nn.Linear(8, 8), 6, k=2, router_bias=True).deepspeed_moe.gate.wg.bias.shape == (6,)
    with torch.no_grad():
        gate.wg.bias.copy_(torch.tensor([2.0, -2.0, 0.0, 1.0, -1.0, 0.5]))  # large enough to change choices
    x = torch.randn(20, 8, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    weight = gate.wg.weight.detach().clone().requires_grad_()
    bias = gate.wg.bias.detach().clone().requires_grad_()
    got = gate(x)
    logits = F.linear(x_ref, weight, bias)
    want = topkgating(logits, 2, 1.0, 0, drop_tokens=False, norm_topk_prob=True)
    assert torch.equal(got.expert_idx_SK, want.expert_idx_SK)
    assert not torch.equal(got.expert_idx_SK, F.linear(x_ref, weight).topk(2).indices)  # the bias does steer
    torch.testing.assert_close(got.weight_SK, want.weight_SK, rtol=RTOL, atol=ATOL)
    top_SK = logits.detach().topk(2).values
    torch.testing.assert_close(got.weight_SK, torch.softmax(top_SK, dim=1), rtol=RTOL, atol=ATOL)
    probe = torch.randn(20, 2)
    ((got.weight_SK * probe).sum() + got.l_aux).backward()
    ((want.weight_SK * probe).sum() + want.l_aux).backward()
    for have, expected in ((x.grad, x_ref.grad), (gate.wg.weight.grad, weight.grad), (gate.wg.bias.grad, bias.grad)):
        torch.testing.assert_close(have, expected, rtol=RTOL, atol=ATOL)
