"""CPU products by measured backend: every backend equals torch's product, and a choice once made is kept.

Tolerances: fp32 against torch's product 1e-5 relative (the backends differ only in summation order);
bf16 against the fp32 product cast to bf16, 2e-2.
"""

import json
import platform
import re
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu
from kernels.cpu import choices, gemm
from moe import MoE
from moe import grouped_mlp as grouped_mlp_module
from moe.grouped_mlp import grouped_mlp

FP32 = dict(rtol=1e-5, atol=1e-5)
BF16 = dict(rtol=2e-2, atol=2e-2)


DEFAULT_MEASURE_FROM = gemm.MEASURE_FROM


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv("MOE_CPU_GEMM", raising=False)
    monkeypatch.delenv("MOE_CPU_GEMM_CACHE", raising=False)
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)  # the shapes here are small: measure them anyway
    gemm.clear()
    yield
    gemm.clear()


def _operands(n, width_in, width_out, dtype, transposed):
    g = torch.Generator().manual_seed(n * 7 + width_in)
    x = torch.randn(n, width_in, generator=g).to(dtype)
    w = torch.randn(width_in, width_out, generator=g).to(dtype).t() if transposed else \
        torch.randn(width_out, width_in, generator=g).to(dtype)
    return x, w, torch.randn(width_out, generator=g).to(dtype)


@pytest.mark.parametrize("backend", ["blas", "onednn", "auto"])
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 70])
@pytest.mark.parametrize("transposed", [False, True])
def test_linear_equals_torch(monkeypatch, backend, n, transposed):
    monkeypatch.setenv("MOE_CPU_GEMM", backend)
    x, w, b = _operands(n, 24, 40, torch.float32, transposed)
    expected = F.linear(x.double(), w.double(), b.double()).float()
    torch.testing.assert_close(gemm.linear(x, w, b), expected, **FP32)
    out = torch.full((n, 40), float("nan"))
    assert gemm.linear(x, w, out=out) is out
    torch.testing.assert_close(out, F.linear(x.double(), w.double()).float(), **FP32)


@pytest.mark.parametrize("backend", ["blas", "onednn", "auto"])
@pytest.mark.parametrize("n", [0, 1, 31, 33, 70])
def test_linear_tn_equals_torch(monkeypatch, backend, n):
    monkeypatch.setenv("MOE_CPU_GEMM", backend)
    g = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, 24, generator=g), torch.randn(n, 40, generator=g)
    expected = (a.double().t() @ b.double()).float()
    torch.testing.assert_close(gemm.linear_tn(a, b), expected, **FP32)
    out = torch.full((24, 40), float("nan"))
    assert gemm.linear_tn(a, b, out=out) is out
    torch.testing.assert_close(out, expected, **FP32)


def _onednn_running(monkeypatch, half: bool):
    """gemm's oneDNN op as on a CPU whose oneDNN runs bf16 and fp16 (a stand-in op there) or refuses them."""
    real = gemm._onednn_op
    stand_in = lambda x, w, b, *attrs: F.linear(x, w, b)  # noqa: E731
    monkeypatch.setattr(gemm, "_onednn_op", lambda dtype: real(dtype) if dtype == torch.float32
                        else stand_in if half else None)


@pytest.mark.parametrize("backend", ["blas", "onednn", "widened"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_products(monkeypatch, backend, dtype):
    monkeypatch.setenv("MOE_CPU_GEMM", backend)
    if backend == "onednn" and gemm._onednn_op(dtype) is None:  # this CPU refuses it: the wrapper around a stand-in
        _onednn_running(monkeypatch, half=True)
    x, w, b = _operands(37, 16, 24, dtype, False)
    expected = F.linear(x.float(), w.float(), b.float()).to(dtype)
    torch.testing.assert_close(gemm.linear(x, w, b), expected, **BF16)
    torch.testing.assert_close(gemm.linear_tn(x, x), (x.float().t() @ x.float()).to(dtype), **BF16)
    out, out_tn = torch.full((37, 24), float("nan"), dtype=dtype), torch.full((16, 16), float("nan"), dtype=dtype)
    assert gemm.linear(x, w.t().contiguous().t(), out=out) is out and gemm.linear_tn(x, x, out=out_tn) is out_tn
    torch.testing.assert_close(out, F.linear(x.float(), w.float()).to(dtype), **BF16)
    torch.testing.assert_close(out_tn, (x.float().t() @ x.float()).to(dtype), **BF16)


def test_the_widened_product_sums_in_fp32_and_rounds_once(monkeypatch):
    # each output element is the fp32 sum of exactly widened bf16 products, rounded once: within half
    # a bf16 ulp of the float64 product, plus the fp32 sum's own rounding
    monkeypatch.setenv("MOE_CPU_GEMM", "widened")
    x, w, b = _operands(64, 256, 32, torch.bfloat16, False)
    exact = F.linear(x.double(), w.double(), b.double())
    got = gemm.linear(x, w, b)
    assert got.dtype == torch.bfloat16
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()  # a bf16 ulp at each value: 2^-7 of it, at most
    assert bool(((got.double() - exact).abs() <= 0.5 * ulp + 1e-4 * exact.abs().max()).all())


def test_with_native_half_products_the_widened_product_is_timed_beside_them(monkeypatch):
    _onednn_running(monkeypatch, half=True)
    measured = []
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: measured.append(list(runs)) or list(runs)[-1])
    assert "widened" not in gemm.candidates(torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        assert gemm.candidates(dtype) == ("blas", "onednn", "widened") and gemm.measuring(dtype)
        x, w, _ = _operands(40, 24, 40, dtype, False)
        out = gemm.linear(x, w)
        assert out.dtype == dtype
        torch.testing.assert_close(out, F.linear(x.float(), w.float()).to(dtype), **BF16)
    assert measured == [["blas", "onednn", "widened"]] * 2
    assert set(gemm.choices().values()) == {"widened"}


def test_without_native_half_products_the_widened_product_is_taken_untimed(monkeypatch):
    _onednn_running(monkeypatch, half=False)
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: pytest.fail(f"timed {list(runs)}"))
    ran = _spy_backends(monkeypatch)
    for dtype in (torch.bfloat16, torch.float16):
        assert gemm.candidates(dtype) == ("widened",) and not gemm.measuring(dtype)
        x, w, b = _operands(40, 24, 40, dtype, False)
        torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x.float(), w.float(), b.float()).to(dtype), **BF16)
        torch.testing.assert_close(gemm.linear_tn(x, x), (x.float().t() @ x.float()).to(dtype), **BF16)
    assert [name for _, name, _ in ran] == ["widened"] * 4 and gemm.choices() == {}
    monkeypatch.setenv("MOE_CPU_GEMM", "blas")  # forced: torch's own product, whatever it costs
    gemm.linear(x, w)
    assert ran[-1][1] == "blas"
    monkeypatch.setenv("MOE_CPU_GEMM", "widened")  # forced where it does not run the dtype: BLAS, fp32 as before
    x, w, b = _operands(40, 24, 40, torch.float32, False)
    assert torch.equal(gemm.linear(x, w, b), torch.addmm(b, x, w.t())) and ran[-1][1] == "blas"

def test_a_shape_class_is_measured_once_and_its_choice_kept(monkeypatch):
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    measured = []

    def fake_measure(runs):
        measured.append(list(runs))
        return list(runs)[len(measured) % 2]  # alternates, like noisy timings would

    monkeypatch.setattr(cpu.backend, "_measure", fake_measure)
    x, w, _ = _operands(40, 24, 40, torch.float32, False)
    gemm.linear(x, w)
    gemm.linear(x[:35], w)  # 35 and 40 rows: one class (up to 64)
    gemm.linear(x[:10], w)  # a new class (up to 16)
    gemm.linear(x, w.t().contiguous().t())  # a transposed weight: another class
    assert measured == [list(gemm.candidates(torch.float32))] * 3
    assert sorted(gemm.choices()) == ["linear|16|24x40|float32|nn-", "linear|64|24x40|float32|nn-",
                                      "linear|64|24x40|float32|nt-"]


def _spy_backends(monkeypatch) -> list:
    """Record (kind, backend name, rows) of every product run from now on, whatever called it."""
    ran = []
    for kind, table in (("linear", gemm._LINEAR), ("linear_tn", gemm._LINEAR_TN)):
        for name, real in list(table.items()):
            def spy(*operands, _real=real, _kind=kind, _name=name):
                ran.append((_kind, _name, operands[0].shape[0]))
                return _real(*operands)
            monkeypatch.setitem(table, name, spy)
    return ran


def _count_resolutions(monkeypatch) -> list:
    resolved = []
    real = gemm._backend

    def counting(kind, n, *args):
        resolved.append((kind, n))
        return real(kind, n, *args)

    monkeypatch.setattr(gemm, "_backend", counting)
    return resolved


def test_a_loop_resolves_each_rows_class_once_and_runs_what_linear_runs(monkeypatch):
    """by_rows_class: a backend lookup on a class's first product only; every product runs the backend
    `linear` / `linear_tn` runs for the same operands, and gives its bits."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    measured = []

    def fake_measure(runs):
        measured.append(1)
        return list(runs)[len(measured) % 2]  # alternates: neighbouring classes get different backends

    monkeypatch.setattr(cpu.backend, "_measure", fake_measure)
    x, w, b = _operands(70, 24, 40, torch.float32, False)
    y = torch.randn(70, 40, generator=torch.Generator().manual_seed(5))
    rows = [40, 35, 10, 0, 64, 12, 1, 70]  # classes: 64, 64, 16, 0, 64, 16, 0, 128
    resolved = _count_resolutions(monkeypatch)
    ran = _spy_backends(monkeypatch)
    run, run_tn = gemm.by_rows_class("linear"), gemm.by_rows_class("linear_tn")
    outs = []
    for n in rows:
        out, out_tn = torch.full((n, 40), float("nan")), torch.full((24, 40), float("nan"))
        assert run(x[:n], w, b, out) is out and run_tn(x[:n], y[:n], out_tn) is out_tn
        outs.append((out, out_tn))
    assert [n for kind, n in resolved if kind == "linear"] == [40, 10, 0, 70]
    assert [n for kind, n in resolved if kind == "linear_tn"] == [40, 10, 0, 70]
    assert set(gemm.choices().values()) == {"blas", "onednn"}
    looped, ran[:] = list(ran), []
    for n, (out, out_tn) in zip(rows, outs):
        assert torch.equal(out, gemm.linear(x[:n], w, b)) and torch.equal(out_tn, gemm.linear_tn(x[:n], y[:n]))
        torch.testing.assert_close(out, F.linear(x[:n].double(), w.double(), b.double()).float(), **FP32)
    assert looped == ran, "a product in the loop ran another backend than linear / linear_tn run for it"


@pytest.mark.parametrize("rows", [[16, 10], [10, 16]])
def test_a_loop_keeps_small_products_of_a_measured_class_on_blas(monkeypatch, rows):
    """Products under MEASURE_FROM take BLAS unmeasured, also when a larger product of their class was measured."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 12 * 24 * 40)  # 12 rows of 24 x 40: 10 rows below, 16 above
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: "onednn")
    x, w, b = _operands(16, 24, 40, torch.float32, False)
    y = torch.randn(16, 40, generator=torch.Generator().manual_seed(5))
    ran = _spy_backends(monkeypatch)
    run, run_tn = gemm.by_rows_class("linear"), gemm.by_rows_class("linear_tn")
    for n in rows:
        run(x[:n], w, b, torch.empty(n, 40))
        run_tn(x[:n], y[:n], torch.empty(24, 40))
    backends = {(kind, n): name for kind, name, n in ran}
    assert backends == {("linear", 16): "onednn", ("linear", 10): "blas", ("linear_tn", 16): "onednn",
                        ("linear_tn", 10): "blas"}


def test_a_loop_of_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="kind must be 'linear' or 'linear_tn', got 'mm'"):
        gemm.by_rows_class("mm")


def test_threads_measuring_one_class_at_once_all_use_the_first_choice_stored(monkeypatch):
    """Workers of a concurrent plan may meet a new class together; their timings may disagree, but the
    choice stored first is the one every caller multiplies with, now and later."""
    barrier = threading.Barrier(2, timeout=30)
    results = {}

    def fake_measure(runs):
        barrier.wait()  # both threads are measuring the class at once
        return list(runs)[0] if threading.current_thread().name == "first" else list(runs)[1]

    monkeypatch.setattr(cpu.backend, "_measure", fake_measure)

    def call():
        results[threading.current_thread().name] = gemm.choose("linear@worker|64|8x8|float32|nn-",
                                                                dict.fromkeys(gemm.BACKENDS, lambda: None))

    workers = [threading.Thread(target=call, name=name) for name in ("first", "second")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    stored = gemm.choices()["linear@worker|64|8x8|float32|nn-"]
    assert results == {"first": stored, "second": stored}


def test_two_identical_runs_are_bitwise_equal_whatever_the_timings(monkeypatch):
    """The first run measures (here: timings that disagree every time), the second reuses the choices."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    calls = []

    def fake_measure(runs):
        for run in runs.values():  # as the real measurement does: every candidate runs
            run()
        calls.append(1)
        if "per_expert" in runs:  # the layer's plan: products per expert, whose backends are under test
            return "per_expert"
        return list(runs)[len(calls) % len(runs)]

    monkeypatch.setattr(cpu.backend, "_measure", fake_measure)

    def run():
        torch.manual_seed(0)
        expert = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))
        layer = MoE(16, expert, num_experts=4, k=2, capacity_factor=2.0)
        x = torch.randn(70, 16, requires_grad=True)
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
        return [out, x.grad] + [p.grad for p in layer.parameters()]

    first = run()
    measured = len(calls)
    assert measured > 0 and {"blas", "onednn"} <= set(gemm.choices().values())
    second = run()
    assert len(calls) == measured, "the second run measured again"
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_grouped_and_per_expert_plans_agree(monkeypatch):
    g = torch.Generator().manual_seed(3)
    L, M, H, counts = 3, 16, 32, [5, 0, 11]
    args = [torch.randn(16, M, generator=g), torch.randn(L, H, M, generator=g), torch.randn(L, H, generator=g),
            torch.randn(L, M, H, generator=g), torch.randn(L, M, generator=g)]
    outputs = {}
    for plan in ("per_expert", "grouped"):
        monkeypatch.setattr(cpu.backend, "choose", lambda key, runs, plan=plan: plan if key.startswith("mlp") else list(runs)[0])
        monkeypatch.setattr(cpu, "measuring", lambda dtype: True)
        leaves = [t.clone().requires_grad_() for t in args]
        y = grouped_mlp(leaves[0], *leaves[1:], counts, "gelu", use_grouped_gemm=None)
        y.square().sum().backward()
        outputs[plan] = [y] + [t.grad for t in leaves]
    for a, b in zip(outputs["per_expert"], outputs["grouped"]):
        torch.testing.assert_close(a, b, **FP32)


def test_the_layer_plan_is_measured_on_the_cpu():
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    from kernels.grouped_gemm import runs_natively

    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), num_experts=4, k=2)
    layer(torch.randn(24, 16))[0].sum().backward()
    plans = {key: value for key, value in gemm.choices().items() if key.startswith("mlp")}
    if runs_natively(torch.zeros(8, 16), torch.zeros(4, 16, 32)):
        (key, plan), = plans.items()  # the input needs no gradient: the class says so
        # on torch's own OpenMP team the concurrent plan is a candidate too (moe.grouped_mlp): any timed plan
        offered = ("per_expert", "grouped") + (("concurrent",) if cpu.workers() > 1 and cpu.openmp_team() else ())
        assert key.startswith("mlp@grads=01111|") and key.endswith("|4x16x32x16|float32|n") and plan in offered
    else:
        assert plans == {}


def test_half_precision_without_native_products_times_the_plans_but_not_the_grouped_gemm(monkeypatch):
    # products widened untimed, plans timed: per expert against experts side by side, never torch's
    # grouped GEMM (it would multiply in bf16 itself, the loops the widened products avoid)
    _onednn_running(monkeypatch, half=False)
    monkeypatch.setattr(grouped_mlp_module, "CONCURRENT_FROM", 0)
    monkeypatch.setattr(cpu, "workers", lambda: 2)
    monkeypatch.setattr(grouped_mlp_module, "runs_natively", lambda *operands: True)
    timed = []
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: timed.append(list(runs)) or list(runs)[0])
    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), num_experts=4, k=2).bfloat16()
    layer.deepspeed_moe.gate.float()
    layer(torch.randn(24, 16).bfloat16())[0].float().sum().backward()
    assert timed == [["per_expert", "concurrent"]]
    assert set(gemm.choices().values()) == {"per_expert"}  # the products' widened choice is not timed, not listed
    _onednn_running(monkeypatch, half=True)  # where the CPU has half products: they and the grouped GEMM are timed
    gemm.clear()
    timed.clear()
    layer(torch.randn(24, 16).bfloat16())[0].float().sum().backward()
    assert ["per_expert", "grouped", "concurrent"] in timed


def test_a_choice_adopted_from_elsewhere_gives_way_where_only_the_widened_product_runs(monkeypatch):
    _onednn_running(monkeypatch, half=False)
    x, w, _ = _operands(40, 24, 40, torch.bfloat16, False)
    key = gemm.shape_key("linear", 40, (24, 40), torch.bfloat16, x, w, None)
    gemm.adopt({key: "onednn"})  # a checkpoint of a machine with bf16 products
    ran = _spy_backends(monkeypatch)
    gemm.linear(x, w)
    assert ran == [("linear", "widened", 40)] and gemm.choices() == {key: "widened"}


def test_fake_cpu_tensors_take_torch_products_and_leave_the_probe_alone(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    gemm._onednn_op.cache_clear()
    outside = gemm._onednn_op(torch.float32) is not None
    gemm._onednn_op.cache_clear()  # the next probe runs under a fake mode, and its answer is kept
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: pytest.fail(f"timed {list(runs)} on fake tensors"))
    with FakeTensorMode():
        x, w = torch.empty(64, 24), torch.empty(40, 24)
        assert gemm.linear(x, w).shape == (64, 40)  # torch's product, nothing timed
        inside = gemm._onednn_op(torch.float32) is not None
    assert inside == outside


def test_the_first_forward_under_inference_mode_runs_without_measuring_the_plan():
    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), num_experts=4, capacity_factor=2.0)
    x = torch.randn(2, 12, 16)
    with torch.inference_mode():
        y = layer(x)[0]
    assert not any(key.startswith("mlp") for key in gemm.choices())
    with torch.no_grad():
        torch.testing.assert_close(y, layer(x)[0], **FP32)


def test_choices_persist_in_the_cache_file(monkeypatch, tmp_path):
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    path = tmp_path / "gemm.json"
    monkeypatch.setenv("MOE_CPU_GEMM_CACHE", str(path))
    x, w, _ = _operands(20, 8, 12, torch.float32, False)
    gemm.linear(x, w)
    stored = json.loads(path.read_text())
    (machine, entries), = stored.items()
    assert "torch" in machine and list(entries) == ["linear|32|8x12|float32|nn-"]
    # a later process reads the file and measures nothing: the stored choice is used as it is
    entries["linear|32|8x12|float32|nn-"] = "onednn"
    path.write_text(json.dumps(stored))
    gemm.clear()
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: pytest.fail("measured although the file had the choice"))
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w), **FP32)
    assert gemm.choices() == {"linear|32|8x12|float32|nn-": "onednn"}
    assert not list(tmp_path.glob(".gemm-*")), "no temporary file is left behind"


def test_small_products_take_blas_unmeasured(monkeypatch):
    monkeypatch.setattr(gemm, "MEASURE_FROM", DEFAULT_MEASURE_FROM)
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: pytest.fail("a small product was measured"))
    x, w, b = _operands(64, 32, 64, torch.float32, False)  # 131,072 multiply-adds
    torch.testing.assert_close(gemm.linear(x, w, b), F.linear(x, w, b), rtol=0, atol=0)  # BLAS: torch's own
    torch.testing.assert_close(gemm.linear_tn(x, x), torch.mm(x.t(), x), rtol=0, atol=0)
    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), num_experts=4, k=2)
    layer(torch.randn(24, 16))[0].sum().backward()
    assert gemm.choices() == {}
    assert not gemm.worth_measuring(DEFAULT_MEASURE_FROM - 1) and gemm.worth_measuring(DEFAULT_MEASURE_FROM)


def test_adopted_choices_fill_the_classes_not_met_yet(monkeypatch):
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS")
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: "blas")
    x, w, _ = _operands(20, 8, 12, torch.float32, False)
    gemm.linear(x, w)
    gemm.adopt({"linear|32|8x12|float32|nn-": "onednn", "linear|64|8x12|float32|nn-": "onednn"})
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: pytest.fail("measured although a choice was adopted"))
    gemm.linear(torch.cat([x, x, x]), w)
    assert gemm.choices() == {"linear|32|8x12|float32|nn-": "blas", "linear|64|8x12|float32|nn-": "onednn"}
    with pytest.raises(ValueError, match="GEMM choices must map shape classes to implementation names, got"):
        gemm.adopt(["blas"])


def test_bad_settings_are_named(monkeypatch, tmp_path):
    x, w, _ = _operands(4, 8, 8, torch.float32, False)
    monkeypatch.setenv("MOE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="MOE_CPU_GEMM must be auto, blas, onednn or widened, got 'mkl'"):
        gemm.linear(x, w)
    if not gemm._onednn_op(torch.float32):
        return
    monkeypatch.setenv("MOE_CPU_GEMM", "auto")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("MOE_CPU_GEMM_CACHE", str(bad))
    with pytest.raises(ValueError, match="MOE_CPU_GEMM_CACHE=.*bad.json"):
        gemm.linear(x, w)


class _Clock:
    """time.perf_counter for gemm: each candidate's call advances it by that candidate's cost."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def run(self, seconds: float, calls: list, name: str):
        def call():
            calls.append(name)
            self.now += seconds
        return call


def test_a_long_candidate_far_slower_after_a_round_is_timed_no_more(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(choices.time, "perf_counter", clock)
    monkeypatch.setattr(cpu.backend, "_noticed", True)  # (12 s of timing would announce itself)
    runs = {"fast": clock.run(1.0, calls, "fast"), "close": clock.run(1.1, calls, "close"),
            "slow": clock.run(1.3, calls, "slow")}  # 1.3 > DROP_SLOWER_THAN = 1.15 times the fastest
    assert cpu.backend._measure(runs) == "fast"
    assert calls.count("fast") == calls.count("close") == 1 + choices._ROUNDS  # warm-up, then every round
    assert calls.count("slow") == 2  # warm-up and the first round
    calls.clear()  # short calls are timed every round whatever their gap: one round's noise can be that large
    short = {name: clock.run(seconds, calls, name) for name, seconds in (("fast", 0.01), ("slow", 0.02))}
    assert cpu.backend._measure(short) == "fast" and calls.count("slow") == 1 + choices._ROUNDS


def test_a_candidate_far_slower_at_its_first_call_is_not_timed_unless_it_measured_inside(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(choices.time, "perf_counter", clock)
    monkeypatch.setattr(cpu.backend, "_noticed", True)
    runs = {"fast": clock.run(1.0, calls, "fast"), "slow": clock.run(4.5, calls, "slow"),
            "close": clock.run(3.9, calls, "close")}
    assert cpu.backend._measure(runs) == "fast"
    assert calls.count("slow") == 1  # its first call only: over FIRST_SLOWER_THAN = 4 times the fastest first call
    assert calls.count("close") == 2  # within 4x at first, then over DROP_SLOWER_THAN after the first round
    assert calls.count("fast") == 1 + choices._ROUNDS

    def plan():  # a layer's plan: its first call times its products' backends (40 s of the clock) first
        calls.append("plan")
        if calls.count("plan") == 1:
            cpu.backend._measure({"a": clock.run(5.0, calls, "a"), "b": clock.run(5.5, calls, "b")})
        clock.now += 1.0

    calls.clear()
    assert cpu.backend._measure({"other": clock.run(1.1, calls, "other"), "plan": plan}) == "plan"
    assert calls.count("plan") == calls.count("other") == 1 + choices._ROUNDS


def test_a_first_call_during_which_another_thread_measured_is_not_judged_by_it(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(choices.time, "perf_counter", clock)
    monkeypatch.setattr(cpu.backend, "_noticed", True)

    def plan():  # experts side by side: a worker thread times its products during the plan's first call
        calls.append("plan")
        if calls.count("plan") == 1:
            worker = threading.Thread(target=cpu.backend._measure, args=({"a": clock.run(5.0, calls, "a")},))
            worker.start()
            worker.join()
        clock.now += 1.0

    assert cpu.backend._measure({"other": clock.run(1.1, calls, "other"), "plan": plan}) == "plan"
    assert calls.count("plan") == 1 + choices._ROUNDS


def test_a_long_measurement_is_announced_once_per_process(monkeypatch, caplog):
    clock, calls = _Clock(), []
    monkeypatch.setattr(choices.time, "perf_counter", clock)
    monkeypatch.setattr(cpu.backend, "_noticed", False)
    quick = {name: clock.run(seconds, calls, name) for name, seconds in (("a", 0.5), ("b", 1.5))}  # 8 s in all
    with caplog.at_level("WARNING", logger="kernels.gemm"):
        cpu.backend._measure(quick)  # projected from the calls so far, not the first call times all: under NOTICE_SECONDS
        assert caplog.records == []
        slow = {name: clock.run(2.0, calls, name) for name in ("a", "b")}  # about 16 s
        cpu.backend._measure(slow)
        cpu.backend._measure(slow)
    assert len(caplog.records) == 1 and "MOE_CPU_GEMM_CACHE" in caplog.records[0].getMessage()


def test_only_rank_0_announces_a_long_measurement(monkeypatch, caplog):
    monkeypatch.setattr(cpu.backend, "_noticed", False)
    monkeypatch.setattr(choices.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(choices.dist, "get_rank", lambda: 1)
    with caplog.at_level("WARNING", logger="kernels.gemm"):
        cpu.backend._notice(60.0)
    assert caplog.records == []


AVX512_EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512dq avx512_bf16 avx512_vnni

processor\t: 1
model name\t: another name the first processor's block must win over
"""


@pytest.mark.parametrize("flags, features", [
    ("avx avx2 avx512f avx512_bf16", "AVX2, AVX-512, AVX512-BF16, no AMX"),
    ("avx avx2", "AVX2, no AVX-512, no AMX"),
    ("avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8", "AVX2, AVX-512, AVX512-BF16, AMX"),
    ("sse2", "no AVX2, no AVX-512, no AMX"),
])
def test_the_cpu_name_says_family_model_and_vector_extensions(tmp_path, flags, features):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(re.sub(r"flags\t\t: .*", f"flags\\t\\t: {flags}", AVX512_EPYC))
    assert gemm.cpu_model(str(cpuinfo)) == f"AMD EPYC (family 25 model 17; {features})"


def test_without_cpu_flags_the_cpu_name_is_the_model_name_alone(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert gemm.cpu_model(str(cpuinfo)) == "Some CPU"
    assert gemm.cpu_model(str(tmp_path / "missing")) == (platform.processor() or "unknown CPU")
    assert gemm.cpu_model() in choices.machine()  # the cache file's entries are kept per CPU so described
