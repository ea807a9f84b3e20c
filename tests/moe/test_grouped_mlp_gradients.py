"""The grouped MLP computes only the gradients autograd asks for, in every plan.

An input that needs no gradient (the first layer's input, frozen experts) saves its products; the
gradients that are computed equal, bit for bit, those of a backward that computes all of them, and
plain autograd on per-expert F.linear products within fp32 tolerance (1e-5).
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import gemm, threads
from moe import grouped_mlp as grouped_mlp_module
from moe.grouped_mlp import grouped_mlp

FP32 = dict(rtol=1e-5, atol=1e-5)
PLANS = ("per_expert", "grouped", "concurrent")
NAMES = ("x", "w1", "b1", "w2", "b2")
COUNTS = [9, 0, 17, 3, 11]


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv("MOE_CPU_GEMM", raising=False)
    monkeypatch.delenv("MOE_CPU_GEMM_CACHE", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the concurrent plan runs on two workers
    gemm.clear()
    yield
    gemm.clear()
    torch.set_num_threads(before)


def _operands(needs: set, bias: bool = True, M=12, H=20):
    g = torch.Generator().manual_seed(0)
    L, N = len(COUNTS), sum(COUNTS)
    tensors = dict(x=torch.randn(N, M, generator=g), w1=torch.randn(L, H, M, generator=g) / 4,
                   b1=torch.randn(L, H, generator=g), w2=torch.randn(L, M, H, generator=g) / 4,
                   b2=torch.randn(L, M, generator=g))
    if not bias:
        tensors["b1"] = tensors["b2"] = None
    return {name: None if t is None else t.requires_grad_(name in needs) for name, t in tensors.items()}


def _reference(x, w1, b1, w2, b2):
    outputs = []
    for e, rows in enumerate(x.split(COUNTS)):
        h = F.linear(rows, w1[e], None if b1 is None else b1[e])
        outputs.append(F.linear(F.gelu(h), w2[e], None if b2 is None else b2[e]))
    return torch.cat(outputs)


def _gradients(function, operands: dict) -> dict:
    """The output and the gradient of every operand that requires one, by name."""
    y = function(*operands.values())
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    wanted = [name for name, t in operands.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, [operands[name] for name in wanted], grad_y)
    return {"y": y.detach(), **dict(zip(wanted, grads))}


def _plan(plan):
    return lambda *operands: grouped_mlp_module._PLANS[plan].apply(*operands, COUNTS, ("gelu", "none"))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("needs", [{"w1", "b1", "w2", "b2"}, {"x"}, {"w2", "b2"}, {"x", "w1", "b1"}, {"b2"}, {"w1"}],
                         ids=lambda needs: "+".join(sorted(needs)))
def test_only_the_gradients_asked_for_are_computed_and_they_are_exact(plan, needs):
    full = _gradients(_plan(plan), _operands(set(NAMES)))
    want = _gradients(_reference, _operands(set(NAMES)))
    got = _gradients(_plan(plan), _operands(needs))
    assert set(got) == {"y"} | needs
    for name, value in got.items():
        assert torch.equal(value, full[name]), f"{plan}: {name} differs from the full backward's"
        torch.testing.assert_close(value, want[name], **FP32)


@pytest.mark.parametrize("plan", ("per_expert", "concurrent"))
def test_an_input_that_needs_no_gradient_saves_a_product_per_expert(plan, monkeypatch):
    issued = []
    for name in ("linear", "linear_tn"):
        real = getattr(gemm, name)
        monkeypatch.setattr(gemm, name, lambda *a, real=real, name=name, **k: issued.append(name) or real(*a, **k))
    experts = sum(1 for count in COUNTS if count)
    counts = {}
    for needs in (set(NAMES), set(NAMES) - {"x"}, {"w2", "b2"}):
        issued.clear()
        _gradients(_plan(plan), _operands(needs, bias=False))
        counts[frozenset(needs)] = issued.count("linear"), issued.count("linear_tn")
    # forward 2 linear per expert; backward: grad_h (linear), grad_x (linear), grad_w2 and grad_w1 (linear_tn)
    assert counts[frozenset(NAMES)] == (4 * experts, 2 * experts)
    assert counts[frozenset(set(NAMES) - {"x"})] == (3 * experts, 2 * experts)
    assert counts[frozenset({"w2", "b2"})] == (2 * experts, 1 * experts)  # grad_w2 only: no grad_h at all


def test_the_layer_plan_is_measured_for_the_gradients_asked_for(monkeypatch):
    """The plan's shape class names which gradients its backward computes, so each is timed on its own work."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, no plan is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    monkeypatch.setattr(grouped_mlp_module, "CONCURRENT_FROM", 0)
    for needs in (set(NAMES), set(NAMES) - {"x"}):
        operands = _operands(needs)
        got = _gradients(lambda *a: grouped_mlp(*a, COUNTS, "gelu", use_grouped_gemm=None), operands)
        want = _gradients(_reference, _operands(needs))
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], **FP32)
    kinds = sorted(key.split("|")[0] for key in gemm.choices() if key.startswith("mlp"))
    assert kinds == ["mlp", "mlp@grads=01111"]
    assert threads.workers() == 2
