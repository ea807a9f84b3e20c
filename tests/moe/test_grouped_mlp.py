"""The grouped MLP computes only the gradients autograd asks for, in every plan.

An input that needs no gradient (the first layer's input, frozen experts) saves its products; the
gradients that are computed equal, bit for bit, those of a backward that computes all of them, and
plain autograd on per-expert F.linear products within fp32 tolerance (1e-5).
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from kernels.cpu import gemm
from moe import grouped_mlp as grouped_mlp_module
from moe.grouped_mlp import grouped_mlp

FP32 = dict(rtol=1e-5, atol=1e-5)
PLANS = ("per_expert", "grouped", "concurrent")
NAMES = ("x", "w1", "b1", "w2", "b2")
COUNTS = [9, 0, 17, 3, 11]


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    # buffers start as NaN: a row or gradient the backward does not write shows
    monkeypatch.setattr(cpu, "empty", lambda shape, dtype, device="cpu": torch.full(shape, float("nan"), dtype=dtype))
    monkeypatch.setattr(cpu, "empty_like", lambda t: torch.full_like(t, float("nan")))
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
    return lambda *operands: grouped_mlp_module._PLANS[plan].apply(*operands, COUNTS, ("gelu", "none", False))


@pytest.mark.parametrize("plan", [*PLANS, "per_expert@by_expert"])
@pytest.mark.parametrize("needs", [{"w1", "b1", "w2", "b2"}, {"x"}, {"w2", "b2"}, {"x", "w1", "b1"}, {"b2"}, {"w1"}],
                         ids=lambda needs: "+".join(sorted(needs)))
def test_only_the_gradients_asked_for_are_computed_and_they_are_exact(plan, needs, monkeypatch):
    if plan.endswith("@by_expert"):  # the per-expert plan's hidden gradient expert by expert, not of all rows
        monkeypatch.setattr(grouped_mlp_module, "WHOLE_HIDDEN_BYTES", 0)
        plan = plan.split("@")[0]
    full = _gradients(_plan(plan), _operands(set(NAMES)))
    want = _gradients(_reference, _operands(set(NAMES)))
    got = _gradients(_plan(plan), _operands(needs))
    for name, value in got.items():
        assert torch.equal(value, full[name]), f"{plan}: {name} differs from the full backward's"
        torch.testing.assert_close(value, want[name], **FP32)


# work per expert (per expert, concurrent) or per layer (grouped) for each set of gradients asked for:
# forward 2 products; backward grad_h = grad_y W2 (for x, W1 or b1), grad_x = grad_h W1, the weight
# gradients grad_y^T a and grad_h^T x, the bias sums of grad_y and grad_h
WORK = {  # needs: (products, weight-gradient products, bias sums)
    "all": (4, 2, 2), "no-x": (3, 2, 2), "w2+b2": (2, 1, 1), "b2": (2, 0, 1), "w1": (3, 1, 0), "x": (4, 0, 0)}
NEEDS = {"all": set(NAMES), "no-x": set(NAMES) - {"x"}, "w2+b2": {"w2", "b2"}, "b2": {"b2"}, "w1": {"w1"},
         "x": {"x"}}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", WORK)
def test_gradients_not_asked_for_cost_no_products_or_sums(plan, case, monkeypatch):
    issued = []

    def counted(real, label):
        return lambda *a, **k: issued.append(label) or real(*a, **k)

    def counting(module, name, label):
        monkeypatch.setattr(module, name, counted(getattr(module, name), label))

    if plan == "grouped":  # one call per layer for all experts
        counting(grouped_mlp_module, "grouped_mm", "product"), counting(grouped_mlp_module, "grouped_mm_t", "weight")
        counting(torch, "segment_reduce", "sum")
        times = 1
    else:  # one call per expert with rows, through whichever backend kernels.cpu.gemm resolved
        for table, label in ((gemm._LINEAR, "product"), (gemm._LINEAR_TN, "weight")):
            for name, real in list(table.items()):
                monkeypatch.setitem(table, name, counted(real, label))
        counting(torch, "sum", "sum")
        times = sum(1 for count in COUNTS if count)
    _gradients(_plan(plan), _operands(NEEDS[case]))
    want = [times * n for n in WORK[case]]
    if plan == "concurrent":  # its forward cuts the smallest experts in halves of rows: 2 products per item
        want[0] += 2 * (len(grouped_mlp_module._forward_items(COUNTS, cpu.workers())) - times)
    assert [issued.count(label) for label in ("product", "weight", "sum")] == want


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
    assert cpu.workers() == 2


def test_an_evaluation_forward_takes_the_plan_of_its_training_forwards(monkeypatch):
    """Under no_grad the class still follows which operands require a gradient: no second class, no second timing."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, no plan is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    operands = _operands(set(NAMES) - {"x"})  # a first layer: its input needs no gradient
    train = _gradients(lambda *a: grouped_mlp(*a, COUNTS, "gelu", use_grouped_gemm=None), operands)
    with torch.no_grad():
        evaluation = grouped_mlp(*operands.values(), COUNTS, "gelu", use_grouped_gemm=None)
    assert [key.split("|")[0] for key in gemm.choices() if key.startswith("mlp")] == ["mlp@grads=01111"]
    assert torch.equal(evaluation, train["y"])


@pytest.mark.parametrize("plan", ["per_expert", "concurrent"])
def test_the_backward_holds_the_hidden_gradient_of_few_experts_at_a_time(plan, monkeypatch):
    """Where the hidden gradient of all rows would exceed WHOLE_HIDDEN_BYTES (set just below it for the
    per-expert plan; the concurrent plan's workers never make it), it is made expert by expert, in a
    buffer of the largest expert's rows (one per worker for the concurrent plan, made on the calling
    thread), never for all N rows at once. What the backward allocates on this thread peaks below the
    gradients it returns, those buffers, one more expert's rows for a oneDNN product's own output
    (copied into a buffer) and N x M of other transients: 2.7 MiB here (per expert) or 3.5 MiB
    (concurrent, two workers), where a [N, H] hidden gradient alone is 6.6 MiB."""
    from optim.memory import LiveBytes

    counts, M, H = [330, 0, 400, 350, 380, 390, 0, 360, 370, 0, 400, 380], 16, 512
    g = torch.Generator().manual_seed(0)
    L, N = len(counts), sum(counts)
    if plan == "per_expert":  # the concurrent plan goes expert by expert at any size
        monkeypatch.setattr(grouped_mlp_module, "WHOLE_HIDDEN_BYTES", N * H * 4 - 1)
    x = torch.randn(N, M, generator=g).requires_grad_()
    w1, b1 = (torch.randn(L, H, M, generator=g) / 4).requires_grad_(), torch.randn(L, H, generator=g).requires_grad_()
    w2, b2 = (torch.randn(L, M, H, generator=g) / 4).requires_grad_(), torch.randn(L, M, generator=g).requires_grad_()
    y = grouped_mlp_module._PLANS[plan].apply(x, w1, b1, w2, b2, counts, ("gelu", "none", False))
    grad_y = torch.randn(y.shape, generator=g)
    with LiveBytes() as live:
        y.backward(grad_y)
    gradients = sum(t.numel() * t.element_size() for t in (x, w1, b1, w2, b2))
    buffers = cpu.workers() if plan == "concurrent" else 1
    assert gradients <= live.peak <= gradients + (buffers + 1) * max(counts) * H * 4 + N * M * 4 < N * H * 4
    reference = _reference_with(counts, x, w1, b1, w2, b2)
    wanted = torch.autograd.grad(reference, [x, w1, b1, w2, b2], grad_y)
    for name, got, want in zip(NAMES, (x.grad, w1.grad, b1.grad, w2.grad, b2.grad), wanted):
        torch.testing.assert_close(got, want, **FP32, msg=lambda m: f"{name}: {m}")


def _reference_with(counts, x, w1, b1, w2, b2):
    return torch.cat([F.linear(F.gelu(F.linear(rows, w1[e], b1[e])), w2[e], b2[e]) for e, rows in enumerate(x.split(counts))])


@pytest.mark.parametrize("activation", ["gelu", "silu", "relu", "tanh", "sigmoid"])
def test_the_hidden_gradient_of_all_rows_gives_the_numbers_of_expert_by_expert(activation, monkeypatch):
    """Up to WHOLE_HIDDEN_BYTES the per-expert backward makes the hidden gradient of all N rows and runs
    the activation's backward once; one byte less, once per expert with rows. The same gradients
    within fp32 tolerance: an elementwise kernel may take its scalar path for the last
    elements of a call (SiLU's derivative then differs in the last bit), and the calls end elsewhere."""
    operands = _operands(set(NAMES))
    N, H = sum(COUNTS), operands["w1"].shape[1]
    calls = []
    real = grouped_mlp_module._activation_backward
    monkeypatch.setattr(grouped_mlp_module, "_activation_backward",
                        lambda *args: calls.append(args[1].shape) or real(*args))

    def run(bound):
        monkeypatch.setattr(grouped_mlp_module, "WHOLE_HIDDEN_BYTES", bound)
        calls.clear()
        grads = _gradients(lambda *ops: grouped_mlp_module._PerExpertMLP.apply(*ops, COUNTS, (activation, "none", False)),
                           operands)
        return grads, list(calls)

    whole, whole_calls = run(N * H * 4)
    per_expert, per_expert_calls = run(N * H * 4 - 1)
    assert whole_calls == [(N, H)]
    assert per_expert_calls == [(count, H) for count in COUNTS if count]
    for name in NAMES:
        torch.testing.assert_close(whole[name], per_expert[name], **FP32, msg=lambda m: f"{name}: {m}")
