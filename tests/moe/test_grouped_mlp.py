"""The grouped MLP computes only the gradients autograd asks for, in every plan, plain and gated.

An input that needs no gradient (the first layer's input, frozen experts) saves its products; the
gradients that are computed equal, bit for bit, those of a backward that computes all of them, and
plain autograd on per-expert F.linear products within fp32 tolerance (1e-5).

The gated MLP (act(gate) * up, weight1 [L, 2H, M] with gate rows then up rows) equals the per-expert
products in every plan, the grouped one on each grouped GEMM backend (torch's, Triton interpreted on
the CPU, the loop), for every activation, with and without biases, with empty experts and one-row
experts, at widths that are not powers of two, and with counts on the device and padding rows; it
keeps for the backward what the plain MLP keeps (x, h, a and the weights). In bf16 against the fp32
products of the rounded operands: 2e-2 relative, and 2e-2 of each tensor's largest value absolute
(sums of bf16 products: an element much smaller than its tensor's largest keeps fewer correct bits).
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


def _operands(needs: set, bias: bool = True, M=12, H=20, gated: bool = False):
    g = torch.Generator().manual_seed(0)
    L, N, H1 = len(COUNTS), sum(COUNTS), 2 * H if gated else H
    tensors = dict(x=torch.randn(N, M, generator=g), w1=torch.randn(L, H1, M, generator=g) / 4,
                   b1=torch.randn(L, H1, generator=g), w2=torch.randn(L, M, H, generator=g) / 4,
                   b2=torch.randn(L, M, generator=g))
    if not bias:
        tensors["b1"] = tensors["b2"] = None
    return {name: None if t is None else t.requires_grad_(name in needs) for name, t in tensors.items()}


def _reference(x, w1, b1, w2, b2, counts=COUNTS, activation=F.gelu, gated=False):
    outputs = []
    for e, rows in enumerate(x.split(counts)):
        h = F.linear(rows, w1[e], None if b1 is None else b1[e])
        if gated:
            gate, up = h.chunk(2, dim=1)
            a = activation(gate) * up
        else:
            a = activation(h)
        outputs.append(F.linear(a, w2[e], None if b2 is None else b2[e]))
    return torch.cat(outputs)


def _gradients(function, operands: dict) -> dict:
    """The output and the gradient of every operand that requires one, by name."""
    y = function(*operands.values())
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    wanted = [name for name, t in operands.items() if t is not None and t.requires_grad]
    grads = torch.autograd.grad(y, [operands[name] for name in wanted], grad_y)
    return {"y": y.detach(), **dict(zip(wanted, grads))}


def _plan(plan, gated=False):
    return lambda *operands: grouped_mlp_module._PLANS[plan].apply(*operands, COUNTS, ("gelu", "none", gated))


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("plan", [*PLANS, "per_expert@by_expert"])
@pytest.mark.parametrize("needs", [{"w1", "b1", "w2", "b2"}, {"x"}, {"w2", "b2"}, {"x", "w1", "b1"}, {"b2"}, {"w1"}],
                         ids=lambda needs: "+".join(sorted(needs)))
def test_only_the_gradients_asked_for_are_computed_and_they_are_exact(plan, needs, gated, monkeypatch):
    if plan.endswith("@by_expert"):  # the per-expert plan's hidden gradient expert by expert, not of all rows
        monkeypatch.setattr(grouped_mlp_module, "WHOLE_HIDDEN_BYTES", 0)
        plan = plan.split("@")[0]
    full = _gradients(_plan(plan, gated), _operands(set(NAMES), gated=gated))
    want = _gradients(lambda *a: _reference(*a, gated=gated), _operands(set(NAMES), gated=gated))
    got = _gradients(_plan(plan, gated), _operands(needs, gated=gated))
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


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", WORK)
def test_gradients_not_asked_for_cost_no_products_or_sums(plan, case, gated, monkeypatch):
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
    _gradients(_plan(plan, gated), _operands(NEEDS[case], gated=gated))
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


# The gated MLP on every plan against the per-expert products.
GATED_COUNTS = [9, 0, 1, 17, 0, 5]  # empty experts and a one-row expert
# the Triton kernels run interpreted on the CPU, seconds per case: slow there
GATED_PLANS = ["per_expert", "per_expert@by_expert", "concurrent", "grouped@torch",
               pytest.param("grouped@triton", marks=pytest.mark.slow), "grouped@loop"]
GATED_ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu, "gelu-tanh": lambda h: F.gelu(h, approximate="tanh"),
                     "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
BF16_RTOL = 2e-2


def _gated_operands(bias: bool, counts=GATED_COUNTS, M=11, H=13, padding: int = 0) -> dict:
    """x [N + padding, M], w1 [L, 2H, M], b1 [L, 2H], w2 [L, M, H], b2 [L, M] (no biases unless `bias`)."""
    g = torch.Generator().manual_seed(2)
    L, N = len(counts), sum(counts) + padding
    tensors = dict(x=torch.randn(N, M, generator=g), w1=torch.randn(L, 2 * H, M, generator=g) / 3,
                   b1=torch.randn(L, 2 * H, generator=g) if bias else None, w2=torch.randn(L, M, H, generator=g) / 3,
                   b2=torch.randn(L, M, generator=g) if bias else None)
    return {name: None if t is None else t.requires_grad_() for name, t in tensors.items()}


def _use_plan(plan: str, monkeypatch) -> str:
    """The plan's name in _PLANS, with its variant set up: the hidden gradient per expert, or a grouped GEMM backend."""
    plan, _, variant = plan.partition("@")
    if variant == "by_expert":
        monkeypatch.setattr(grouped_mlp_module, "WHOLE_HIDDEN_BYTES", 0)
    elif variant:
        from kernels.grouped_gemm import _torch_grouped_mm_runs

        if variant == "torch" and not _torch_grouped_mm_runs(torch.device("cpu"), torch.float32):
            pytest.skip("torch's grouped GEMM does not run for fp32 here")
        monkeypatch.setenv("MOE_GROUPED_GEMM", variant)
        monkeypatch.setenv("MOE_KERNELS", "triton" if variant == "triton" else "auto")
    return plan


def _gated_activation(name: str) -> tuple:
    return (name.split("-")[0], "tanh" if name.endswith("-tanh") else "none", True)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", GATED_ACTIVATIONS)
@pytest.mark.parametrize("plan", GATED_PLANS)
def test_gated_plans_equal_the_per_expert_products(plan, activation, bias, monkeypatch):
    plan = _use_plan(plan, monkeypatch)
    operands = _gated_operands(bias)
    got = _gradients(lambda *a: grouped_mlp_module._PLANS[plan].apply(*a, GATED_COUNTS, _gated_activation(activation)),
                     operands)
    want = _gradients(lambda *a: _reference(*a, GATED_COUNTS, GATED_ACTIVATIONS[activation], gated=True), operands)
    assert sorted(got) == sorted(want) == sorted(["y", "x", "w1", "w2"] + ["b1", "b2"] * bias)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, **FP32, msg=lambda m: f"{name}: {m}")
    for e, count in enumerate(GATED_COUNTS):  # an expert without rows gets zero gradients, not unwritten ones
        if not count:
            assert not got["w1"][e].any() and not got["w2"][e].any()


@pytest.mark.parametrize("plan", [p for p in GATED_PLANS if "grouped" in str(p)])
def test_gated_grouped_plan_takes_counts_on_the_device_and_leaves_padding_rows_out(plan, monkeypatch):
    plan, padding = _use_plan(plan, monkeypatch), 7
    operands = _gated_operands(bias=False, padding=padding)
    n = sum(GATED_COUNTS)
    counts_L = torch.tensor(GATED_COUNTS)
    y = grouped_mlp(*operands.values(), counts_L, "silu", use_grouped_gemm=True, gated=True)
    assert y.shape == (n + padding, 11)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(y, [operands["x"], operands["w1"], operands["w2"]], grad_y)
    valid = {name: t if name == "w1" or name == "w2" or t is None else t[:n].detach().requires_grad_()
             for name, t in operands.items()}
    want_y = _reference(*valid.values(), GATED_COUNTS, F.silu, gated=True)
    want = torch.autograd.grad(want_y, [valid["x"], valid["w1"], valid["w2"]], grad_y[:n])
    torch.testing.assert_close(y[:n], want_y, **FP32)
    torch.testing.assert_close(got[0][:n], want[0], **FP32)
    torch.testing.assert_close(got[1], want[1], **FP32)  # the padding rows' gradients left out of the weights'
    torch.testing.assert_close(got[2], want[2], **FP32)


@pytest.mark.parametrize("plan", GATED_PLANS)
def test_gated_bf16_plans_equal_the_fp32_products_within_bf16_rounding(plan, monkeypatch):
    plan = _use_plan(plan, monkeypatch)
    operands = _gated_operands(bias=False)
    half = {name: None if t is None else t.detach().bfloat16().requires_grad_() for name, t in operands.items()}
    got = _gradients(lambda *a: grouped_mlp_module._PLANS[plan].apply(*a, GATED_COUNTS, ("silu", "none", True)), half)
    rounded = {name: None if t is None else t.detach().float().requires_grad_() for name, t in half.items()}
    want = _gradients(lambda *a: _reference(*a, GATED_COUNTS, F.silu, gated=True), rounded)
    for name, value in want.items():
        assert got[name].dtype == torch.bfloat16
        torch.testing.assert_close(got[name].float(), value, rtol=BF16_RTOL, atol=BF16_RTOL * float(value.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
@pytest.mark.parametrize("plan", PLANS)
def test_the_forward_keeps_x_h_a_and_the_weights_for_the_backward(plan, gated):
    """What the plain MLP keeps, the gated one keeps: x, the pre-activation h ([N, 2H] gated: gate and up),
    the activation a ([N, H]) and the weights, nothing more (the grouped plan also its counts and offsets)."""
    operands = _operands(set(NAMES), gated=gated)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _plan(plan, gated)(*operands.values())
    N, M, H = sum(COUNTS), 12, 20
    floats = sorted(tuple(t.shape) for t in saved if t.is_floating_point())
    assert floats == sorted([(N, M), (N, 2 * H if gated else H), (N, H), (len(COUNTS), 2 * H if gated else H, M),
                             (len(COUNTS), M, H)])
    assert all(t.numel() <= len(COUNTS) + 1 for t in saved if not t.is_floating_point())


def test_the_gated_weights_must_have_twice_the_hidden_width():
    operands = _operands(set(), gated=False)
    with pytest.raises(ValueError, match=r"weight1 must have twice weight2's hidden width \(20\) as its rows \(gate, "
                                         r"then up\), got weight1 \[5, 20, 12\] and weight2 \[5, 12, 20\]"):
        grouped_mlp(*operands.values(), COUNTS, "silu", gated=True)
    with pytest.raises(ValueError, match=r"weight1 must have weight2's hidden width \(20\) as its rows, got weight1 "
                                         r"\[5, 40, 12\]"):
        grouped_mlp(*_operands(set(), gated=True).values(), COUNTS, "silu")
