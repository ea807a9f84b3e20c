"""The experts of an MoE layer (moe.experts): stacked MLP weights, plain and gated (SwiGLU), against the
same experts held as module copies, in the packed, grouped and padded layouts, forward and gradients,
in one process and under expert parallelism; and state dicts that load from either form (and
DeepSpeed's per-expert keys) into the other. Tolerances: fp32 1e-5 relative (1e-6 absolute); bf16
against the fp32 loop 2e-2, as the layer's half-precision test.
"""

import pytest
import torch
from torch import nn

from moe import Experts, MoE, SwiGLU
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


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


# Gated experts: moe.SwiGLU is held stacked, weight1 [L, 2H, M] (gate rows, then up rows), weight2 [L, M, H].
GATED_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
                     "silu": nn.SiLU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
M, H = 10, 14  # widths that are not powers of two


class _LoopSwiGLU(SwiGLU):
    """SwiGLU under another type: held as module copies, the per-expert loop the stacked form must equal."""


def _gated_pair(layout: str, act=nn.SiLU, **kwargs) -> tuple[MoE, MoE]:
    """A stacked SwiGLU layer and its per-expert loop with the same (distinct, per-expert seeded) weights."""
    options = dict(num_experts=6, k=2, min_capacity=0, top2_2nd_expert_sampling=False, expert_layout=layout,
                   expert_init="per_expert_seed", seed=5) | kwargs
    torch.manual_seed(4)
    stacked = MoE(M, SwiGLU(M, H, act()), **options)
    looped = MoE(M, _LoopSwiGLU(M, H, act()), **options)
    looped.load_state_dict(stacked.state_dict())
    assert stacked.deepspeed_moe.experts.stacked and stacked.deepspeed_moe.experts.gated
    assert not looped.deepspeed_moe.experts.stacked
    return stacked, looped


def _loop_grads(looped: MoE) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's expert gradients in the stacked form (zeros for an expert that got no rows)."""
    def grad(p):
        return torch.zeros_like(p) if p.grad is None else p.grad

    experts = looped.deepspeed_moe.experts.deepspeed_experts
    return (torch.stack([torch.cat([grad(e.gate_proj.weight), grad(e.up_proj.weight)]) for e in experts]),
            torch.stack([grad(e.down_proj.weight) for e in experts]))


def _step(layer: MoE, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    out, l_aux, _ = layer(x)
    ((out * grad).sum() + l_aux).backward()
    return out.detach(), x.grad


def _assert_gated_equal(stacked: MoE, looped: MoE, x: torch.Tensor, tolerance: dict = FP32) -> None:
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x.dtype)
    out, grad_x = _step(stacked, x, grad)
    out2, grad_x2 = _step(looped, x, grad)
    torch.testing.assert_close(out, out2, **tolerance)
    torch.testing.assert_close(grad_x, grad_x2, **tolerance)
    experts = stacked.deepspeed_moe.experts
    grad_w1, grad_w2 = _loop_grads(looped)
    torch.testing.assert_close(experts.weight1.grad, grad_w1, **tolerance)
    torch.testing.assert_close(experts.weight2.grad, grad_w2, **tolerance)
    torch.testing.assert_close(stacked.deepspeed_moe.gate.wg.weight.grad, looped.deepspeed_moe.gate.wg.weight.grad,
                               **tolerance)


@pytest.mark.parametrize("act", GATED_ACTIVATIONS)
@pytest.mark.parametrize("layout", ["packed", "grouped", "padded"])
def test_stacked_gated_experts_equal_the_module_loop(layout, act):
    stacked, looped = _gated_pair(layout, GATED_ACTIVATIONS[act], capacity_factor=0.75)
    x = torch.randn(40, M, generator=torch.Generator().manual_seed(0))
    _assert_gated_equal(stacked, looped, x)
    if layout == "padded":
        assert bool((stacked.deepspeed_moe.routing.expert_idx_SK < 0).any()), "the test should drop choices"


@pytest.mark.parametrize("layout", ["packed", "grouped"])
def test_stacked_gated_experts_with_empty_experts_and_one_row_equal_the_loop(layout):
    """Three tokens, top-1, six experts: most experts get no rows, the others one to three."""
    stacked, looped = _gated_pair(layout, k=1, dropless=True, expert_layout=layout)
    x = torch.randn(3, M, generator=torch.Generator().manual_seed(2))
    _assert_gated_equal(stacked, looped, x)
    counts = stacked.deepspeed_moe.exp_counts
    assert int((counts == 0).sum()) >= 3 and int(counts.sum()) == 3


@pytest.mark.parametrize("layout", ["packed", "grouped", "padded"])
def test_bf16_stacked_gated_experts_equal_the_fp32_loop_within_bf16_rounding(layout):
    stacked, looped = _gated_pair(layout, capacity_factor=2.0)
    stacked.deepspeed_moe.experts.to(torch.bfloat16)
    x = torch.randn(24, M, generator=torch.Generator().manual_seed(3))
    out, _, _ = stacked(x.bfloat16())
    assert out.dtype == torch.bfloat16
    out2, _, _ = looped(x.bfloat16().float())
    torch.testing.assert_close(out.float(), out2, **BF16)
    out.float().sum().backward()
    out2.sum().backward()
    grad_w1, grad_w2 = _loop_grads(looped)
    experts = stacked.deepspeed_moe.experts
    assert experts.weight1.grad.dtype == torch.bfloat16
    torch.testing.assert_close(experts.weight1.grad.float(), grad_w1, **BF16)
    torch.testing.assert_close(experts.weight2.grad.float(), grad_w2, **BF16)


def test_gated_state_dicts_load_across_forms_and_from_per_expert_module_keys():
    stacked, looped = _gated_pair("packed", num_experts=3, k=1)
    experts = stacked.deepspeed_moe.experts
    with torch.no_grad():
        experts.weight1.add_(torch.randn_like(experts.weight1))
    looped.load_state_dict(stacked.state_dict())  # stacked keys into module copies
    keys = looped.state_dict().keys()
    assert "deepspeed_moe.experts.deepspeed_experts.2.up_proj.weight" in keys
    for e, module in enumerate(looped.deepspeed_moe.experts.deepspeed_experts):
        gate, up = experts.weight1[e].chunk(2)
        assert torch.equal(module.gate_proj.weight, gate) and torch.equal(module.up_proj.weight, up)
        assert torch.equal(module.down_proj.weight, experts.weight2[e])
    again = MoE(M, SwiGLU(M, H), num_experts=3, k=1)
    again.load_state_dict(looped.state_dict())  # per-expert module keys (DeepSpeed's) into stacked weights
    assert set(again.state_dict()) == set(stacked.state_dict())
    for key, value in stacked.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_expert_tensors_are_views_under_the_modules_names():
    stacked, looped = _gated_pair("packed", num_experts=2)
    experts, loop = stacked.deepspeed_moe.experts, looped.deepspeed_moe.experts
    assert sorted(experts.expert_tensors(1)) == sorted(loop.expert_tensors(1)) == [
        "down_proj.weight", "gate_proj.weight", "up_proj.weight"]
    for name, tensor in experts.expert_tensors(1).items():
        assert torch.equal(tensor, loop.expert_tensors(1)[name]), name
    with torch.no_grad():
        experts.expert_tensors(1)["up_proj.weight"].fill_(3.0)
    assert bool((experts.weight1[1, H:] == 3).all()) and not bool((experts.weight1[1, :H] == 3).any())
    plain = MoE(8, _mlp(), num_experts=2).deepspeed_moe.experts
    assert sorted(plain.expert_tensors(0)) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_which_gated_experts_are_stacked():
    """SwiGLU exactly, without biases, with an activation the stacked path computes; anything else is a loop."""
    assert Experts(SwiGLU(M, H, nn.GELU(approximate="tanh")), 2).stacked

    class Swish(nn.Module):
        def forward(self, x):
            return x * torch.sigmoid(x)

    biased = SwiGLU(M, H)
    biased.up_proj = nn.Linear(M, H)
    for expert in (_LoopSwiGLU(M, H), SwiGLU(M, H, Swish()), biased):
        assert not Experts(expert, 2).stacked
    with pytest.raises(ValueError, match=r"stacked=True needs an nn.Sequential\(Linear, activation, Linear\) or a "
                                         r"moe.SwiGLU expert without biases"):
        Experts(biased, 2, stacked=True)


def _seeded(make):
    torch.manual_seed(0)  # the same router on every rank and in the reference
    return make()


def _gated_expert_parallel(rank, world):
    """Each rank's tokens through the layer at ep_size 2 against one process holding every expert."""
    for layout in ("packed", "grouped", "padded", "dropless"):
        reset_groups()
        options = dict(num_experts=4, k=2, min_capacity=0, top2_2nd_expert_sampling=False, use_rts=False,
                       expert_init="per_expert_seed", seed=3)
        options |= dict(dropless=True) if layout == "dropless" else dict(capacity_factor=0.9, expert_layout=layout)
        layer, reference = (_seeded(lambda: MoE(M, SwiGLU(M, H), ep_size=ep_size, **options)) for ep_size in (2, 1))
        assert layer.deepspeed_moe.experts.gated and layer.deepspeed_moe.experts.num_local_experts == 2
        for r in range(world):  # the reference sees every rank's tokens in turn
            g = torch.Generator().manual_seed(100 + r)
            x, grad = torch.randn(12, M, generator=g), torch.randn(12, M, generator=g)
            out_r, _, _ = reference(x)
            (out_r * grad).sum().backward()
            if r == rank:
                out, _, _ = layer(x)
                (out * grad).sum().backward()
                torch.testing.assert_close(out, out_r, **FP32, msg=layout)
        first = expert_groups(2).ep_rank * 2
        for name in ("weight1", "weight2"):
            mine, theirs = getattr(layer.deepspeed_moe.experts, name), getattr(reference.deepspeed_moe.experts, name)
            assert torch.equal(mine.detach(), theirs.detach()[first:first + 2]), f"{layout}: {name}"
            torch.testing.assert_close(mine.grad, theirs.grad[first:first + 2], **FP32, msg=f"{layout}: {name}")


@pytest.mark.slow
def test_stacked_gated_experts_under_expert_parallelism_equal_one_process():
    run_distributed(_gated_expert_parallel, 2)
