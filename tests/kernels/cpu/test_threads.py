"""Experts side by side on single-threaded CPU workers (kernels.cpu.threads, the MLP's concurrent plan).

The workers are torch's OpenMP team where this process can call its runtime (Linux), else a pool of
threads; the tests of `run_each` run on both (`workers_of` forces the pool). The plan is compared
with plain torch autograd on per-expert F.linear products: float64 at 1e-10 (only the order of sums
differs), fp32 at 1e-5; two runs of the plan give bitwise equal results, on either kind of worker.
"""

import json
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu
from kernels.cpu import choices, gemm, threads
from moe import grouped_mlp as grouped_mlp_module
from moe.grouped_mlp import ACTIVATIONS, _ACTIVATION_FUNCTIONS, _ConcurrentMLP, grouped_mlp

TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv("MOE_CPU_GEMM", raising=False)
    monkeypatch.delenv("MOE_CPU_GEMM_CACHE", raising=False)
    gemm.clear()
    yield
    gemm.clear()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["team", "pool"])
def workers_of(request, monkeypatch):
    """Which workers run_each uses: torch's OpenMP team (where this process can call its runtime) or the pool."""
    if request.param == "pool":
        monkeypatch.setattr(threads, "openmp_team", lambda: False)
    elif not threads.openmp_team():
        pytest.skip("torch's intra-op threads are not an OpenMP team this process can call (not Linux, or "
                    "another threading backend): run_each uses the pool, tested beside this")
    return request.param


def _single_threaded() -> bool:
    """Whether torch ops called on this thread run on it alone: one intra-op thread (a pool worker), or
    inside an OpenMP parallel region (a team member), where torch's parallel loops and BLAS run serially."""
    if torch.get_num_threads() == 1:
        return True
    runtime = threads._openmp_runtime()
    return runtime is not None and bool(runtime.omp_in_parallel())


def test_every_item_runs_once_on_single_threaded_workers_while_the_caller_keeps_its_threads(two_threads, workers_of):
    seen, lock = [], threading.Lock()

    def work(item):
        time.sleep(0.01)  # long enough for every worker to take items
        with lock:
            seen.append((item, _single_threaded(), threads.on_worker(), threading.get_ident()))

    threads.run_each(work, range(7))
    assert sorted(item for item, *_ in seen) == list(range(7))
    assert all(alone and on_worker for _, alone, on_worker, _ in seen)
    assert len({ident for *_, ident in seen}) == 2  # both workers took items
    if workers_of == "pool":
        assert threading.get_ident() not in {ident for *_, ident in seen}
    else:  # the caller's thread is the team's first member
        assert threading.get_ident() in {ident for *_, ident in seen}
    assert torch.get_num_threads() == 2 and not threads.on_worker() and not _single_threaded()
    counts = []  # a thread started afterwards still gets the process's count, not the workers' one
    later = threading.Thread(target=lambda: counts.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert counts == [2]


def test_a_new_thread_count_makes_as_many_workers(two_threads, workers_of):
    threads.run_each(lambda item: None, range(2))
    torch.set_num_threads(3)
    together = threading.Barrier(3, timeout=10)  # passes only if three workers run at once
    seen = []

    def work(item):
        together.wait()
        seen.append(_single_threaded())

    threads.run_each(work, range(3))
    assert seen == [True] * 3 and threads.workers() == 3 and torch.get_num_threads() == 3


def test_run_each_inside_a_worker_runs_the_inner_items_there(two_threads, workers_of):
    """A nested call (an item calling run_each) runs its items on the calling worker, in order."""
    seen, lock = {}, threading.Lock()

    def inner(item):
        with lock:
            seen.setdefault(item // 10, []).append((item, threading.get_ident(), threads.on_worker()))

    def outer(item):
        time.sleep(0.01)
        threads.run_each(inner, [10 * item + i for i in range(3)])
        assert threads.on_worker()  # still a worker after the inner call

    threads.run_each(outer, range(4))
    assert sorted(seen) == list(range(4))
    for item, runs in seen.items():
        assert [i for i, _, _ in runs] == [10 * item + i for i in range(3)]
        assert len({ident for _, ident, _ in runs}) == 1 and all(on for _, _, on in runs)
    assert not threads.on_worker()


def test_workers_follow_the_callers_grad_and_inference_modes_with_autocast_off(two_threads, workers_of):
    modes, idents = [], set()

    def work(item):
        time.sleep(0.005)  # every worker takes items, the caller's thread and the others alike
        idents.add(threading.get_ident())
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")))

    with torch.no_grad():
        threads.run_each(work, range(4))
    threads.run_each(work, range(4))
    with torch.inference_mode():
        threads.run_each(work, range(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # off on every worker, whichever thread it is
        threads.run_each(work, range(4))
    assert modes == [(False, False, False)] * 4 + [(True, False, False)] * 4 + [(False, True, False)] * 4 + \
        [(True, False, False)] * 4
    assert len(idents) >= 2


def test_torchs_openmp_team_is_found_where_torch_runs_on_gnu_openmp_on_linux():
    """The team is not silently lost: on Linux with torch's OpenMP backend (the CPU wheels) it is found."""
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("the OpenMP team is used on Linux builds of torch with the OpenMP backend only")
    assert threads.openmp_team()


def test_a_team_of_one_runs_the_items_in_the_caller_with_its_threads(two_threads, monkeypatch):
    """Where OpenMP gives one thread (OMP_DYNAMIC on a loaded machine, OMP_THREAD_LIMIT=1), the region is
    not parallel: the items run as in the caller, not as single-threaded workers measuring their own classes."""
    if not threads.openmp_team():
        pytest.skip("torch's intra-op threads are not an OpenMP team this process can call")
    runtime = threads._openmp_runtime()

    class OneThread:
        omp_in_parallel = runtime.omp_in_parallel

        @staticmethod
        def GOMP_parallel(function, key, count, flags):
            runtime.GOMP_parallel(function, key, 1, flags)

    monkeypatch.setattr(threads, "_openmp_runtime", lambda: OneThread)
    seen = []
    threads.run_each(lambda item: seen.append((item, threads.on_worker(), _single_threaded(), threading.get_ident())),
                     range(5))
    assert [item for item, *_ in seen] == list(range(5))
    assert {(on, alone, ident) for _, on, alone, ident in seen} == {(False, False, threading.get_ident())}


def test_an_interrupt_in_one_item_stops_every_worker(two_threads, workers_of):
    done = []

    def work(item):
        time.sleep(0.005)
        if item == 1:
            raise KeyboardInterrupt
        done.append(item)

    with pytest.raises(KeyboardInterrupt):
        threads.run_each(work, range(40))
    assert len(done) < 10  # the other worker stopped at its next item, not after the other 38


def test_the_concurrent_plan_runs_under_inference_mode(two_threads):
    counts = [5, 0, 9]
    operands = [t.detach() if t is not None else None for t in _operands(torch.float32, True, counts)]
    with torch.inference_mode():
        got = _ConcurrentMLP.apply(*operands, counts, ("gelu", "none", False))
    torch.testing.assert_close(got, _reference(*operands, counts, "gelu"), **TOLERANCES[torch.float32])


def test_an_error_in_one_item_is_raised_after_the_others_ran(two_threads, workers_of):
    done = []

    def work(item):
        if item == 2:
            raise ValueError("item 2")
        done.append(item)

    with pytest.raises(ValueError, match="item 2"):
        threads.run_each(work, range(6))
    assert sorted(done) == [0, 1, 3, 4, 5]


def test_one_thread_runs_the_items_in_the_caller():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        callers = []
        threads.run_each(lambda item: callers.append(threading.current_thread() is threading.main_thread()), range(3))
        assert callers == [True] * 3
    finally:
        torch.set_num_threads(before)


def _reference(x, w1, b1, w2, b2, counts, activation):
    outputs = []
    for e, rows in enumerate(x.split(counts)):
        h = F.linear(rows, w1[e], None if b1 is None else b1[e])
        outputs.append(F.linear(_ACTIVATION_FUNCTIONS[activation](h, "none"), w2[e], None if b2 is None else b2[e]))
    return torch.cat(outputs)


def _operands(dtype, bias, counts, M=12, H=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    L, N = len(counts), sum(counts)
    tensors = [torch.randn(N, M, generator=g), torch.randn(L, H, M, generator=g) / 4,
               torch.randn(L, H, generator=g) if bias else None, torch.randn(L, M, H, generator=g) / 4,
               torch.randn(L, M, generator=g) if bias else None]
    return [None if t is None else t.to(dtype).requires_grad_() for t in tensors]


def _forward_backward(function, operands, counts, activation, seed=1):
    y = function(*operands, counts, activation)
    grad_y = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    leaves = [t for t in operands if t is not None]
    return [y.detach()] + list(torch.autograd.grad(y, leaves, grad_y))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_the_concurrent_plan_matches_autograd(two_threads, workers_of, dtype, activation, bias, monkeypatch):
    # buffers start as NaN: a row or gradient the plan does not write shows
    monkeypatch.setattr(cpu, "empty", lambda shape, dtype, device="cpu": torch.full(shape, float("nan"), dtype=dtype))
    monkeypatch.setattr(cpu, "empty_like", lambda t: torch.full_like(t, float("nan")))
    counts = [9, 0, 17, 3, 0, 11]  # uneven, with experts that got no rows
    operands = _operands(dtype, bias, counts)
    got = _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, activation)
    want = _forward_backward(_reference, operands, counts, activation)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCES[dtype])
    L = len(counts)
    for grad in got[2:]:  # weight and bias gradients of experts without rows are zero, not stale
        if grad.shape[0] == L:
            assert torch.equal(grad[1], torch.zeros_like(grad[1])) and torch.equal(grad[4], torch.zeros_like(grad[4]))


def test_the_concurrent_plan_is_bitwise_repeatable(two_threads, workers_of):
    counts = [300, 41, 0, 257, 129, 77, 513, 2]
    operands = _operands(torch.float32, True, counts, M=64, H=96)

    def run():
        return _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, "gelu")

    first = run()
    for _ in range(3):
        for a, b in zip(first, run()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("counts, workers", [([300, 41, 0, 257, 129, 77, 513, 2], 2), ([5, 0, 9], 2), ([0, 7, 0], 2),
                                             ([4, 1, 6, 3], 3), ([3, 8], 2), ([], 2), ([5, 9, 2], 1)])
def test_the_forward_items_cover_every_row_once_the_smallest_experts_cut_in_halves_last(counts, workers):
    items = grouped_mlp_module._forward_items(counts, workers)
    rows = {e: [] for e in range(len(counts))}
    for e, start, length in items:
        assert length > 0
        rows[e].extend(range(start, start + length))
    assert all(sorted(rows[e]) == list(range(count)) for e, count in enumerate(counts))
    nonempty = [e for e, count in enumerate(counts) if count]
    cut = sorted(nonempty, key=lambda e: (counts[e], -e))[:workers] if 1 < workers < len(nonempty) else []
    whole = [item for item in items if item[0] not in cut]
    assert whole == [(e, 0, counts[e]) for e in sorted(set(nonempty) - set(cut), key=lambda e: -counts[e])]
    assert items[:len(whole)] == whole  # the halves come last, the largest first
    halves = items[len(whole):]
    assert [length for *_, length in halves] == sorted((length for *_, length in halves), reverse=True)
    assert all(max(n for f, _, n in halves if f == e) - min(n for f, _, n in halves if f == e) <= 1 for e in cut
               if counts[e] > 1)


def test_the_concurrent_backward_runs_two_items_per_expert(two_threads, workers_of, monkeypatch):
    """Every expert's hidden-gradient part first, the largest first, then every W2 part; a lone expert is one item."""
    seen = []
    run_each = cpu.run_each
    monkeypatch.setattr(cpu, "run_each", lambda work, items: seen.append(list(items)) or run_each(work, seen[-1]))
    for counts, want in (([9, 0, 17, 3], [(2, ("h",)), (0, ("h",)), (3, ("h",)), (2, ("w2",)), (0, ("w2",)),
                                          (3, ("w2",))]),
                         ([0, 12, 0], [(1, ("h", "w2"))])):
        seen.clear()
        operands = _operands(torch.float32, True, counts)
        got = _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, "gelu")
        assert seen[-1] == want
        for a, b in zip(got, _forward_backward(_reference, operands, counts, "gelu")):
            torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])


def test_a_team_member_keeps_its_python_thread_state_between_calls(two_threads):
    """ctypes gives a callback on a thread Python did not start a thread state for that call only; the team's
    other members keep theirs, so their thread-local data outlives a run_each call."""
    if not threads.openmp_team():
        pytest.skip("torch's intra-op threads are not an OpenMP team this process can call")
    local, seen = threading.local(), []
    both = threading.Barrier(2, timeout=30)  # each member takes one of the two items

    def work(item):
        both.wait()
        seen.append((threading.get_ident(), getattr(local, "mark", None)))
        local.mark = threading.get_ident()

    threads.run_each(work, range(2))
    seen.clear()
    threads.run_each(work, range(2))
    assert len({ident for ident, _ in seen}) == 2
    assert all(mark == ident for ident, mark in seen)


def test_the_concurrent_plan_measures_its_products_on_the_workers(two_threads, monkeypatch):
    """Measured products (here every size, each backend forced in turn) take worker shape classes of
    their own, match autograd and repeat bit for bit."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, nothing is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    counts = [70, 0, 33, 129, 5]
    operands = _operands(torch.float32, True, counts, M=40, H=72)
    want = _forward_backward(_reference, operands, counts, "gelu")
    for backend in gemm.candidates(torch.float32):
        gemm.clear()
        measured_on = set()
        monkeypatch.setattr(cpu.backend, "_measure", lambda runs: measured_on.add(_single_threaded()) or backend)

        def run():
            return _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, "gelu")

        got = run()
        kinds = {key.split("|")[0] for key in gemm.choices()}
        assert kinds == {"linear@worker", "linear_tn@worker"} and set(gemm.choices().values()) == {backend}
        assert measured_on == {True}
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])
        for a, b in zip(got, run()):
            assert torch.equal(a, b)


def test_a_lone_expert_runs_in_the_caller_with_its_threads_and_classes(two_threads, monkeypatch):
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, nothing is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    measured_on = set()
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: measured_on.add(torch.get_num_threads()) or "onednn")
    counts = [0, 50, 0]
    operands = _operands(torch.float32, True, counts, M=40, H=72)
    got = _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, "relu")
    assert {key.split("|")[0] for key in gemm.choices()} == {"linear", "linear_tn"} and measured_on == {2}
    for a, b in zip(got, _forward_backward(_reference, operands, counts, "relu")):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])


def test_workers_keep_their_choices_under_the_callers_entry_of_the_cache_file(two_threads, monkeypatch, tmp_path):
    """The file's entries are per machine and thread count: the workers' classes belong to the caller's count."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, nothing is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    monkeypatch.setattr(cpu.backend, "_measure", lambda runs: "onednn")
    path = tmp_path / "gemm.json"
    monkeypatch.setenv("MOE_CPU_GEMM_CACHE", str(path))
    counts = [40, 30, 20]
    operands = _operands(torch.float32, True, counts, M=40, H=72)
    _forward_backward(lambda *a: _ConcurrentMLP.apply(*a[:6], (a[6], "none", False)), operands, counts, "gelu")
    stored = json.loads(path.read_text())
    assert list(stored) == [choices.machine()] and choices.machine().endswith("threads 2")
    assert set(stored[choices.machine()]) == set(gemm.choices()) and any("@worker" in key for key in gemm.choices())


def test_the_concurrent_plan_with_no_rows_at_all(two_threads):
    counts = [0, 0, 0]
    operands = _operands(torch.float32, True, counts)
    y = _ConcurrentMLP.apply(*operands, counts, ("gelu", "none", False))
    assert y.shape == (0, 12)
    y.sum().backward()
    assert not operands[1].grad.any()


def test_grouped_mlp_validates_counts_before_any_plan():
    operands = _operands(torch.float32, True, [2, 3])
    with pytest.raises(ValueError, match="counts"):
        grouped_mlp(operands[0], *operands[1:], [2, 2], "gelu", use_grouped_gemm=None)


def test_the_measured_plan_offers_and_runs_experts_side_by_side(two_threads, monkeypatch):
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, no plan is measured")
    offered, ran = [], []

    def choose(key, runs):
        if key.startswith("mlp"):
            offered.append(sorted(runs))
            return "concurrent" if "concurrent" in runs else "per_expert"
        return next(iter(runs))

    real_run_each = cpu.run_each
    monkeypatch.setattr(cpu, "run_each", lambda work, items: ran.append(1) or real_run_each(work, items))
    monkeypatch.setattr(cpu.backend, "choose", choose)
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    monkeypatch.setattr(grouped_mlp_module, "CONCURRENT_FROM", 0)
    counts = [7, 13, 0, 5]
    operands = _operands(torch.float32, True, counts)
    got = _forward_backward(lambda *a: grouped_mlp(*a[:6], a[6], use_grouped_gemm=None), operands, counts, "silu")
    want = _forward_backward(_reference, operands, counts, "silu")
    assert offered and all("concurrent" in runs and "per_expert" in runs for runs in offered) and ran
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOLERANCES[torch.float32])

    # a small layer: offered on the OpenMP team, not on the pool (whose spinning neighbours cost more)
    monkeypatch.setattr(grouped_mlp_module, "CONCURRENT_FROM", 1 << 40)
    for team in (True, False) if threads.openmp_team() else (False,):  # (no team to run on elsewhere)
        offered.clear(), ran.clear(), gemm.clear()
        monkeypatch.setattr(cpu, "openmp_team", lambda: team)  # what the plan's offer asks
        monkeypatch.setattr(threads, "openmp_team", lambda: team)  # what run_each asks
        _forward_backward(lambda *a: grouped_mlp(*a[:6], a[6], use_grouped_gemm=None), operands, counts, "silu")
        assert offered and all(("concurrent" in runs) == team for runs in offered) and bool(ran) == team


def test_a_kept_plan_stands_for_every_batch_of_its_class(two_threads, monkeypatch):
    """The offer depends on the class's rows: a batch just under the threshold keeps the class's choice."""
    if not gemm.measuring(torch.float32):
        pytest.skip("this torch build has no oneDNN linear: products always use BLAS, no plan is measured")
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)
    M, H = 12, 20
    monkeypatch.setattr(grouped_mlp_module, "CONCURRENT_FROM", 32 * M * H)  # 32 rows and more: offered
    measured = []

    def choose(key, runs):
        measured.append(key)
        return "concurrent" if key.startswith("mlp") else next(iter(runs))

    monkeypatch.setattr(cpu.backend, "choose", choose)
    monkeypatch.setattr(cpu.backend, "_choices", {})
    for counts in ([16, 16], [15, 14]):  # 32 rows, then 29 rows of the same class (32)
        operands = _operands(torch.float32, True, counts, M=M, H=H)
        if not measured:
            _forward_backward(lambda *a: grouped_mlp(*a[:6], a[6], use_grouped_gemm=None), operands, counts, "gelu")
            cpu.backend._choices.update({key: "concurrent" for key in measured if key.startswith("mlp")})
            continue
        ran = []
        real_run_each = cpu.run_each
        monkeypatch.setattr(cpu, "run_each", lambda work, items: ran.append(1) or real_run_each(work, items))
        _forward_backward(lambda *a: grouped_mlp(*a[:6], a[6], use_grouped_gemm=None), operands, counts, "gelu")
        assert ran, "the second batch of the class did not run the kept concurrent plan"
    assert sum(key.startswith("mlp") for key in measured) == 1
