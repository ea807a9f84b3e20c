"""The experts of an MoE layer (moe.experts): stacked MLP weights against the same experts held as
module copies, in the packed and padded layouts, forward and gradients; and state dicts that load
from either form (and DeepSpeed's per-expert keys) into the other. Tolerances: fp32 1e-5 relative
(1e-6 absolute).
"""

import pytest
import torch
from torch import nn

from moe import MoE

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _mlp(m=8, h=12, act=nn.GELU, bias=True):
    return nn.Sequential(nn.Linear(m, h, bias=bias), act(), nn.Linear(h, m, bias=bias))


def _loop_twin(layer: MoE, expert: nn.Module, **kwargs) -> MoE:
    """The same layer with experts held as module copies (a fourth, parameter-free module defeats stacking)."""
    looped = MoE(layer.hidden_size, nn.Sequential(*expert, nn.Identity()), **kwargs)
    looped.load_state_dict(layer.state_dict())
    return looped


@pytest.mark.parametrize("act", [nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid])
@pytest.mark.parametrize("compute", ["packed", "padded"])
def test_stacked_experts_equal_the_module_loop(act, compute):
    torch.manual_seed(2)
    expert = _mlp(8, 40, act)
    kwargs = dict(num_experts=4, k=2, capacity_factor=1.0, min_capacity=0, top2_2nd_expert_sampling=False)
    stacked = MoE(8, expert, expert_layout=compute, **kwargs)
    with torch.no_grad():  # distinct experts, as after training
        for p in stacked.deepspeed_moe.experts.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    assert stacked.deepspeed_moe.experts.stacked
    looped = _loop_twin(stacked, expert, **kwargs)
    assert not looped.deepspeed_moe.experts.stacked
    x = torch.randn(50, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, l_aux, _ = stacked(x)
    out2, l_aux2, _ = looped(x2)
    torch.testing.assert_close(out, out2, **FP32)
    grad = torch.randn_like(out)
    (out * grad).sum().add(l_aux).backward()
    (out2 * grad).sum().add(l_aux2).backward()
    torch.testing.assert_close(x.grad, x2.grad, **FP32)
    ex, ex2 = stacked.deepspeed_moe.experts, looped.deepspeed_moe.experts
    for e in range(4):
        torch.testing.assert_close(ex.weight1.grad[e], ex2.deepspeed_experts[e][0].weight.grad, **FP32)
        torch.testing.assert_close(ex.bias1.grad[e], ex2.deepspeed_experts[e][0].bias.grad, **FP32)
        torch.testing.assert_close(ex.weight2.grad[e], ex2.deepspeed_experts[e][2].weight.grad, **FP32)
        torch.testing.assert_close(ex.bias2.grad[e], ex2.deepspeed_experts[e][2].bias.grad, **FP32)
    torch.testing.assert_close(
        stacked.deepspeed_moe.gate.wg.weight.grad, looped.deepspeed_moe.gate.wg.weight.grad, **FP32
    )


def test_packed_path_splits_large_experts_and_matches_the_loop():
    torch.manual_seed(3)
    expert = _mlp(16, 24, nn.ReLU, bias=False)
    kwargs = dict(num_experts=2, k=2, capacity_factor=2.0, min_capacity=0, top2_2nd_expert_sampling=False)
    stacked = MoE(16, expert, **kwargs)
    looped = _loop_twin(stacked, expert, **kwargs)
    x = torch.randn(300, 16)  # > 2 * 32 rows per expert: bulk and remainder pieces
    out, _, _ = stacked(x)
    out2, _, _ = looped(x)
    torch.testing.assert_close(out, out2, **FP32)
    out.sum().backward()
    out2.sum().backward()
    torch.testing.assert_close(
        stacked.deepspeed_moe.experts.weight1.grad[1], looped.deepspeed_moe.experts.deepspeed_experts[1][0].weight.grad, **FP32
    )


def test_state_dicts_load_across_layouts_and_from_deepspeed_keys():
    torch.manual_seed(9)
    expert = _mlp()
    stacked = MoE(8, expert, num_experts=3, k=1)
    with torch.no_grad():
        stacked.deepspeed_moe.experts.weight1.add_(torch.randn_like(stacked.deepspeed_moe.experts.weight1))
    looped = _loop_twin(stacked, expert, num_experts=3, k=1)
    keys = looped.state_dict().keys()
    assert "deepspeed_moe.experts.deepspeed_experts.2.0.weight" in keys
    again = MoE(8, expert, num_experts=3, k=1)
    again.load_state_dict(looped.state_dict())
    assert torch.equal(again.deepspeed_moe.experts.weight1, stacked.deepspeed_moe.experts.weight1)
