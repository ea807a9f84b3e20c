"""Matrix products on the CPU through the implementation measured fastest for their shape.

    linear(x_NI, w_OI, b_O=None, out=None)   out = x @ w^T (+ b)   -> [N, O]   (forward, input gradient)
    linear_tn(a_NP, b_NQ, out=None)          out = a^T @ b          -> [P, Q]   (weight gradient)

Shape legend: N rows (the dimension that changes from step to step with routing), I/O/P/Q widths.
Operands may be transposed views; `out`, when given, is a contiguous tensor the result is written to.

Backends, all exact up to the order of the fp32 sums:
- "blas": torch's addmm/mm (MKL or OpenBLAS, as the build has it), written straight into `out`.
- "onednn": torch's oneDNN linear (the op Inductor emits on the CPU), with the N rows cut into a
  multiple of 32 and a rest. oneDNN JIT-compiles a primitive per distinct shape and caches a bounded
  number, while routing changes N every step; the cut keeps the distinct shapes few, so they are soon
  all cached. For `linear_tn` N is the reduction, and the two partial products are summed.
- "widened" (bf16 and fp16 only): the operands widened to fp32, torch's fp32 BLAS product, the
  result rounded once to the operands' dtype. A half-precision product sums in fp32 too, so this
  differs from it only in the order of the sums; on a CPU without native bf16 or fp16 multiply-adds
  it is several times faster (2-core AMD EPYC with AVX2: [1024, 512] x [512, 2048] in bf16 34 ms
  against torch's 217 ms, [1024, 128] x [128, 256] 1.1 against 10.6 ms), where AMX or AVX512-BF16
  make the native products faster than fp32 and the timing keeps them.

The first time a shape class is met (N rounded up to a power of two, the widths, dtype, operand
layouts, bias), every backend that runs its dtype (`candidates`) runs on the actual operands, alternating, and the fastest minimum time
wins (a call of DROP_FROM_SECONDS or more over DROP_SLOWER_THAN times the fastest after a round is
not timed again, nor one over FIRST_SLOWER_THAN times the fastest at its first call). Timing expected to take over NOTICE_SECONDS is announced once per process on
stderr. Products run on the single-threaded workers of `kernels.threads` (a concurrent plan) have
shape classes of their own ("linear@worker"), measured there: one thread favours other kernels than
two. Workers that meet a new class together may each measure it; the first choice stored is the one
every caller uses. The choice is kept for the rest of the process and never revised, so two
identical runs in one process multiply with the same backends and give bitwise equal results.
Products of fewer than MEASURE_FROM multiply-adds are not measured: they take BLAS (oneDNN's call costs some 50 us, more than
such a product, and a timing that small is noise), so small models are bitwise repeatable across
processes too. Half-precision products on a CPU without native half multiply-adds (oneDNN does not run
the dtype) take the widened product, unmeasured (`candidates`). Checkpoints record the choices and a resumed run adopts them (`adopt`). MOE_CPU_GEMM=blas,
onednn or widened forces a backend (BLAS where the forced one does not run the dtype);
MOE_CPU_GEMM_CACHE=<file.json> keeps choices across processes (entries are kept per CPU, as
`cpu_model` describes it, torch version and thread count). Other devices, float64 and code being compiled use torch's
own products.
"""

import functools
import itertools
import json
import logging
import os
import platform
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from kernels import threads

__all__ = ["BACKENDS", "MEASURE_FROM", "PIECE_ROWS", "adopt", "by_rows_class", "candidates", "choices", "choose",
           "class_rows", "clear", "widened_only",
           "cpu_model", "kept", "linear", "linear_function", "linear_tn", "linear_tn_function", "measuring", "shape_key",
           "worth_measuring"]

BACKENDS = ("blas", "onednn", "widened")
PIECE_ROWS = 32
MEASURE_FROM = 1 << 22  # multiply-adds: smaller products take the first listed implementation unmeasured
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WIDENED_DTYPES = (torch.bfloat16, torch.float16)  # products the "widened" backend is a candidate for
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}
# timed calls per candidate, alternating, after one warm-up call each; the least of three, also for
# calls of seconds (a layer's plan): one timing on a shared machine picks at random between candidates
# 5% apart
_ROUNDS = 3
# after a round, a candidate this much slower than the fastest is timed no more, if its call takes at
# least DROP_FROM_SECONDS: at that length a gap three times the 5% above is not the machine's noise,
# and at a layer's size a candidate costs seconds a call (the README's example layer on a 2-core AMD
# EPYC: the grouped GEMM 3.3-3.6 s against 2.7 s for the other plans); shorter calls are cheap to time
# every round
DROP_SLOWER_THAN = 1.15
DROP_FROM_SECONDS = 0.1
# a candidate whose first call took over this many times the fastest first call is not timed at all
# (a call of DROP_FROM_SECONDS or more that measured no products inside it: the first call of a layer's
# plan times its products' backends, seconds that say nothing of the plan). First calls carry one-time
# costs (fresh pages, worker threads starting, oneDNN's primitives) and a shared machine may stall one,
# hence a margin far wider than a round's; what it spares are candidates slower by orders of magnitude,
# such as torch's half-precision loops where they are timed (on a 2-core AMD EPYC with AVX2, where they
# are no longer timed: bf16 input-gradient products 9-18 s a call against 0.04-0.08 s widened, and the
# layer's grouped plan 153 s against 2.9 s, each called twice before this rule)
FIRST_SLOWER_THAN = 4.0
_tickets = itertools.count()  # one number per measurement begun and per first call, on any thread (atomic)
NOTICE_SECONDS = 10.0  # measuring expected to take longer than this is announced (once per process)
_noticed = False
_log = logging.getLogger(__name__)
_choices: dict[str, str] = {}
_fast: dict[tuple, str] = {}  # the hot path's index of _choices, by the parts of the key
_loaded_from: str | None = None
_choosing = threading.Lock()  # concurrent workers may measure one class at once: the first result stands
_loading = threading.Lock()  # the cache file is read once, whichever thread gets there first


@functools.cache
def _onednn_op(dtype: torch.dtype):
    """torch's oneDNN linear for `dtype`, if this build and CPU run it and it agrees with F.linear; else None."""
    if not torch.backends.mkldnn.is_available() or dtype not in _ONEDNN_DTYPES:
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None:
        return None
    # fixed values: the probe must not touch the global RNG; on real tensors whatever mode (fake tensors,
    # a tracer) the first caller runs under, since the answer is kept for the process
    with _disable_current_modes():
        x = torch.linspace(-1, 1, 35).view(5, 7).to(dtype)
        w, b = torch.linspace(-2, 2, 21).view(3, 7).to(dtype), torch.linspace(0, 1, 3).to(dtype)
        try:
            ok = torch.allclose(op(x, w, b, "none", [], "").float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
        except RuntimeError:
            return None
    return op if ok else None


def _forced() -> str:
    forced = os.environ.get("MOE_CPU_GEMM", "auto")
    if forced not in ("auto",) + BACKENDS:
        raise ValueError(f"MOE_CPU_GEMM must be auto, blas, onednn or widened, got {forced!r}")
    return forced


def _cut(n: int) -> list[slice]:
    """Rows [0, n) as a multiple of PIECE_ROWS and a rest (empty parts left out)."""
    bulk = n - n % PIECE_ROWS
    return [part for part in (slice(0, bulk), slice(bulk, n)) if part.stop > part.start]


# --- the backends -------------------------------------------------------------------------------

def _linear_blas(x, w, b=None, out=None):
    """x @ w^T (+ b) with torch's BLAS product."""
    if out is None:
        return F.linear(x, w, b)
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


def _linear_onednn(x, w, b, out):
    op = _onednn_op(x.dtype)
    parts = _cut(x.shape[0])
    if out is None and len(parts) == 1:
        return op(x, w, b, "none", [], "")
    out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if out is None else out
    for part in parts:
        out[part].copy_(op(x[part], w, b, "none", [], ""))
    return out


def _linear_tn_blas(a, b, out=None):
    """a^T @ b with torch's BLAS product."""
    return torch.mm(a.t(), b) if out is None else torch.mm(a.t(), b, out=out)


def _linear_tn_onednn(a, b, out):
    op = _onednn_op(a.dtype)
    products = [op(a[part].t(), b[part].t(), None, "none", [], "") for part in _cut(a.shape[0])]
    if not products:  # no rows: an empty sum
        return a.new_zeros(a.shape[1], b.shape[1]) if out is None else out.zero_()
    if len(products) == 1:
        return products[0] if out is None else out.copy_(products[0])
    return torch.add(products[0], products[1], out=out)


def _linear_widened(x, w, b=None, out=None):
    """x @ w^T (+ b) as an fp32 BLAS product of the widened operands, rounded once to x's dtype."""
    product = _linear_blas(x.float(), w.float(), None if b is None else b.float())
    return product.to(x.dtype) if out is None else out.copy_(product)


def _linear_tn_widened(a, b, out=None):
    """a^T @ b as an fp32 BLAS product of the widened operands, rounded once to a's dtype."""
    product = _linear_tn_blas(a.float(), b.float())
    return product.to(a.dtype) if out is None else out.copy_(product)


_LINEAR = {"blas": _linear_blas, "onednn": _linear_onednn, "widened": _linear_widened}
_LINEAR_TN = {"blas": _linear_tn_blas, "onednn": _linear_tn_onednn, "widened": _linear_tn_widened}


# --- the choice ---------------------------------------------------------------------------------

def _measure(runs: dict) -> str:
    """The name in `runs` whose call took the least time: each called once to warm up, then alternately;
    after the warm-up, a candidate over FIRST_SLOWER_THAN times the fastest first call, and after each
    round, one over DROP_SLOWER_THAN times the fastest so far, is timed no more (calls of
    DROP_FROM_SECONDS or more; at the warm-up only calls that measured nothing inside them)."""
    next(_tickets)
    started = time.perf_counter()
    first, clean = {}, set()
    for done, (name, run) in enumerate(runs.items(), 1):
        ticket, start = next(_tickets), time.perf_counter()
        run()
        first[name] = time.perf_counter() - start
        if next(_tickets) == ticket + 1:  # no measurement began inside this call, on any thread
            clean.add(name)
        _notice((time.perf_counter() - started) / done * len(runs) * (_ROUNDS + 1))
    fastest_first = min(first.values())
    slow = {name for name in clean if first[name] >= DROP_FROM_SECONDS and first[name] > FIRST_SLOWER_THAN * fastest_first}
    best = {name: first[name] if name in slow else float("inf") for name in runs}
    timed = {name: run for name, run in runs.items() if name not in slow}
    for _ in range(_ROUNDS):
        for name, run in timed.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
        fastest = min(best.values())
        timed = {name: run for name, run in timed.items()
                 if best[name] <= DROP_SLOWER_THAN * fastest or best[name] < DROP_FROM_SECONDS}
    return min(runs, key=lambda name: best[name])  # ties: the first listed


def _notice(expected_seconds: float) -> None:
    """Say once per process (rank 0 only, under torch.distributed), on stderr (logging's warning), that a first
    call is slow because it is timing candidates: measuring expected to take at most NOTICE_SECONDS passes
    unannounced."""
    global _noticed
    if _noticed or expected_seconds < NOTICE_SECONDS:
        return
    _noticed = True
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:  # one line per job, not per rank
        return
    _log.warning("exactmoe: timing the CPU products and expert plans for a new layer shape; this first call takes "
                 "several times a normal one, once per shape class and process (MOE_CPU_GEMM_CACHE=<file.json> "
                 "keeps the choices for later runs, MOE_CPU_GEMM=blas skips the timing; see kernels.gemm)")


def choose(key: str, runs: dict) -> str:
    """The implementation measured fastest for the shape class `key`, measured on its first call(s).

    Threads that meet a new class at once each measure it; the first choice stored is returned to all.

    Args:
        key: the shape class (see `shape_key`); a choice once made is kept for the process.
        runs: name -> a call without arguments that runs that implementation on the actual operands.

    Returns:
        The chosen name: the kept choice when there is one, else the fastest of `runs`.
    """
    _load()
    choice = _choices.get(key)
    if choice in runs:
        return choice
    measured = _measure(runs)
    with _choosing:  # another thread may have chosen meanwhile: its choice stands, so every call agrees
        choice = _choices.get(key)
        if choice not in runs:
            choice = _choices[key] = measured
            _save()
    return choice


def shape_key(kind: str, n: int, widths: tuple, dtype: torch.dtype, *operands) -> str:
    """A shape class: `kind`, N rounded up to a power of two, the widths, dtype and operand layouts."""
    layouts = "".join(map(_layout_code, operands))
    return f"{kind}|{class_rows(n)}|{'x'.join(map(str, widths))}|{_DTYPE_NAMES[dtype]}|{layouts}"


def _rows_class(n: int) -> int:
    """log2 of N rounded up to a power of two (0 for N <= 1)."""
    return (n - 1).bit_length() if n > 1 else 0


def _layout_code(t: torch.Tensor | None) -> str:
    """An operand's layout in a shape class: "-" absent, "t" a transposed view, "n" row-major."""
    return "-" if t is None else "t" if t.stride(0) == 1 and t.shape[0] > 1 else "n"


def worth_measuring(multiply_adds: int) -> bool:
    """Whether a product (or layer) of this many multiply-adds is large enough to be timed."""
    return multiply_adds >= MEASURE_FROM


def _runnable(dtype: torch.dtype) -> tuple[str, ...]:
    """The backends that run CPU products of `dtype`: BLAS, oneDNN where this build and CPU run the
    dtype, and for bf16 and fp16 the widened fp32 product."""
    names = ("blas",) + (("onednn",) if _onednn_op(dtype) is not None else ())
    return names + (("widened",) if dtype in _WIDENED_DTYPES else ())


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    """The backends timed for CPU products of `dtype` (one: taken without timing).

    Every backend that runs the dtype, except in half precision on a CPU where oneDNN does not run it:
    such a CPU has no bf16 or fp16 multiply-adds, torch's own half products there are loops far slower
    than fp32's BLAS (2-core AMD EPYC with AVX2, bf16: [2048, 512] x [512, 2048] 17.8 s with a row-major
    weight, 0.45 s with a transposed one, against 0.08 s widened), and timing them would cost a first
    call minutes; the widened product is taken.
    """
    if dtype in _WIDENED_DTYPES and _onednn_op(dtype) is None:
        return ("widened",)
    return _runnable(dtype)


def measuring(dtype: torch.dtype) -> bool:
    """Whether CPU products of `dtype` are chosen by measurement (else MOE_CPU_GEMM or the build decides)."""
    return _forced() == "auto" and len(candidates(dtype)) > 1


def widened_only(dtype: torch.dtype) -> bool:
    """Whether CPU products of `dtype` take the widened product untimed (half precision where oneDNN does
    not run it, MOE_CPU_GEMM unset): torch's own half products, its grouped GEMM's too, are slow loops there."""
    return _forced() == "auto" and candidates(dtype) == ("widened",)


def _backend(kind: str, n: int, widths: tuple, dtype: torch.dtype, operands: tuple, multiply_adds: int, run) -> str:
    """The backend for one product: forced, BLAS below the measuring size, else the shape class's choice.

    The hot path (a class already chosen) looks the choice up by a tuple, without building the
    class's string key; the tuple holds exactly what the key is made of. On a worker of
    `kernels.threads` the kind is the worker's ("linear@worker"): measured on one thread.
    """
    forced = _forced()
    if forced != "auto":
        return forced if forced in _runnable(dtype) else "blas"
    names = candidates(dtype)
    if len(names) > 1 and not worth_measuring(multiply_adds):
        return "blas"
    if threads.on_worker():
        kind += "@worker"
    fast_key = (kind, _rows_class(n), widths, dtype, *map(_layout_code, operands))
    choice = _fast.get(fast_key)
    if choice is not None:
        return choice
    key = shape_key(kind, n, widths, dtype, *operands)
    _load()
    choice = _choices.get(key)
    if len(names) == 1:  # one backend runs here (e.g. widened half precision): taken untimed
        if choice is not None and choice != names[0]:  # adopted or read from elsewhere, never run here
            with _choosing:
                _choices[key] = names[0]
        choice = names[0]
    elif choice not in names:
        choice = choose(key, {name: functools.partial(run, name) for name in names})
    _fast[fast_key] = choice  # a choice once made is never revised (see adopt), so it may be kept here
    return choice


def _cpu_product(t: torch.Tensor) -> bool:
    """A product on real CPU tensors in eager code (fake tensors, e.g. of a CPU trace, take torch's own)."""
    return t.is_cpu and t.dtype in _ONEDNN_DTYPES and not torch.compiler.is_compiling() and not isinstance(t, FakeTensor)


def linear_function(x_NI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None,
                    out: torch.Tensor | None = None):
    """The backend `linear` runs for these operands, to be called as f(x_NI, w_OI, b_O, out).

    A new shape class is measured here, on these operands. Loops over products that differ only in
    their rows resolve it once per rows class (`by_rows_class`) instead of once per product.
    """
    if not _cpu_product(x_NI):
        return _linear_blas
    (n, width_in), width_out = x_NI.shape, w_OI.shape[0]
    backend = _backend("linear", n, (width_in, width_out), x_NI.dtype, (x_NI, w_OI, b_O), n * width_in * width_out,
                       lambda name: _LINEAR[name](x_NI, w_OI, b_O, out))
    return _LINEAR[backend]


def linear(x_NI: torch.Tensor, w_OI: torch.Tensor, b_O: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (+ b) through the measured backend for this shape class.

    Args:
        x_NI: shape [N, I]. w_OI: shape [O, I] (a transposed view is fine). b_O: shape [O] or None.
        out: contiguous [N, O] tensor to write the result to, or None.

    Returns:
        The product, shape [N, O] (`out` when given).
    """
    return linear_function(x_NI, w_OI, b_O, out)(x_NI, w_OI, b_O, out)


def linear_tn_function(a_NP: torch.Tensor, b_NQ: torch.Tensor, out: torch.Tensor | None = None):
    """The backend `linear_tn` runs for these operands, to be called as f(a_NP, b_NQ, out); see `linear_function`."""
    if not _cpu_product(a_NP):
        return _linear_tn_blas
    (n, width_p), width_q = a_NP.shape, b_NQ.shape[1]
    backend = _backend("linear_tn", n, (width_p, width_q), a_NP.dtype, (a_NP, b_NQ), n * width_p * width_q,
                       lambda name: _LINEAR_TN[name](a_NP, b_NQ, out))
    return _LINEAR_TN[backend]


def linear_tn(a_NP: torch.Tensor, b_NQ: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a^T @ b, a reduction over the N rows, through the measured backend for this shape class.

    Args:
        a_NP: shape [N, P]. b_NQ: shape [N, Q]. out: contiguous [P, Q] tensor, or None.

    Returns:
        The product, shape [P, Q] (`out` when given).
    """
    return linear_tn_function(a_NP, b_NQ, out)(a_NP, b_NQ, out)


def _linear_row_work(x_NI, w_OI, *_) -> int:
    return x_NI.shape[1] * w_OI.shape[0]


def _linear_tn_row_work(a_NP, b_NQ, *_) -> int:
    return a_NP.shape[1] * b_NQ.shape[1]


def by_rows_class(kind: str):
    """A caller for one loop's products that differ only in their rows (N), such as an MoE layer's experts
    (slices of stacked tensors): each product runs the backend `linear` (kind "linear") or `linear_tn`
    ("linear_tn") would run, resolved once per rows class and measuring decision, then called directly.

    The backend of a product depends on its shape class and on whether it has MEASURE_FROM
    multiply-adds (smaller ones take BLAS unmeasured), which can split a class; the rest (widths,
    dtype, layouts) is the same for every product of such a loop. Between two products the CPU then
    runs a dict lookup instead of the backend's resolution (some 10 us of Python, which costs the
    products more than its own time). On a 2-core AMD EPYC with AVX2 this made the GPT recipe's
    expert MLP (8 experts, 48 products per forward and backward) 2.3-2.5 ms faster per call (about
    70 ms; medians of 150 alternating calls in one process), 0.9 ms above the same products called
    straight from a loop, against 3.4 ms before. For one thread's loop only: the concurrent plan's
    workers resolve per product, each in its own thread's shape classes.

    Returns:
        run(*operands): the product, with the operands of `linear` or `linear_tn`.

    Raises:
        ValueError: for another kind.
    """
    if kind not in ("linear", "linear_tn"):
        raise ValueError(f"kind must be 'linear' or 'linear_tn', got {kind!r}")
    function_of, row_work = ((linear_function, _linear_row_work) if kind == "linear"
                             else (linear_tn_function, _linear_tn_row_work))
    chosen, by_rows = {}, {}

    def run(*operands):
        n = operands[0].shape[0]
        function = by_rows.get(n)  # the loop's products differ only in N: N alone names the choice
        if function is None:
            key = (_rows_class(n), worth_measuring(n * row_work(*operands)))
            function = chosen.get(key)
            if function is None:
                function = chosen[key] = function_of(*operands)
            by_rows[n] = function
        return function(*operands)

    return run


def kept(key: str) -> str | None:
    """The choice kept for the shape class `key` (made here, adopted or read from the cache file), or None."""
    _load()
    return _choices.get(key)


def class_rows(n: int) -> int:
    """N rounded up to a power of two, as a shape class counts rows."""
    return 1 << _rows_class(n)


def choices() -> dict[str, str]:
    """The backend chosen for each shape class met so far ("kind|rows|widths|dtype|layouts" -> backend)."""
    return dict(_choices)


def adopt(chosen: dict[str, str]) -> None:
    """Use `chosen` (a `choices()` of another process, e.g. the one that wrote a checkpoint) for every
    shape class this process has not met yet; a choice already used here stays (invariant: two
    identical runs in one process multiply alike).

    Raises:
        ValueError: `chosen` is not a mapping of shape-class strings to implementation names.
    """
    if not isinstance(chosen, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in chosen.items()):
        raise ValueError(f"GEMM choices must map shape classes to implementation names, got {chosen!r}")
    _load()
    for key, value in chosen.items():
        _choices.setdefault(key, value)


def clear() -> None:
    """Forget every choice (tests; a later product measures again)."""
    global _loaded_from
    _choices.clear()
    _fast.clear()
    _loaded_from = None


# --- the optional file of choices ---------------------------------------------------------------

def _machine() -> str:
    """The cache file's entry for this process: on a concurrent plan's worker, its caller's thread count."""
    return f"{platform.machine()} {cpu_model()} torch {torch.__version__} threads {threads.caller_threads()}"


# the vector extensions that decide which products are fast: /proc/cpuinfo's flag -> its name
_CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))


@functools.cache
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, family, model number and vector extensions, as benchmarks print it and the
    cache file keys its choices: "AMD EPYC (family 25 model 17; AVX2, AVX-512, AVX512-BF16, no AMX)".

    CPUs sold under one name differ in what decides the products' speed (an "AMD EPYC" may have AVX2
    only, or AVX-512 with bf16 products). Read from Linux's /proc/cpuinfo (its first processor);
    elsewhere the platform's processor name.

    Args:
        cpuinfo: the file to read (tests give their own).
    """
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends here
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "flags" not in fields:
        return name
    flags = set(fields["flags"].split())
    features = [label if flag in flags else "no " + label for flag, label in _CPU_FEATURES
                if flag in flags or label in ("AVX2", "AVX-512", "AMX")]
    numbered = "cpu family" in fields and "model" in fields
    where = f"family {fields['cpu family']} model {fields['model']}; " if numbered else ""
    return f"{name} ({where}{', '.join(features)})"


def _load() -> None:
    """Read MOE_CPU_GEMM_CACHE once per path: choices measured earlier on this machine."""
    global _loaded_from
    path = os.environ.get("MOE_CPU_GEMM_CACHE")
    if not path or path == _loaded_from:
        return
    with _loading:  # another thread may be reading it: marked read only once its entries are in
        if path == _loaded_from:
            return
        try:
            with open(path) as f:
                stored = json.load(f)
        except FileNotFoundError:
            stored = {}
        except (OSError, ValueError) as error:
            raise ValueError(f"MOE_CPU_GEMM_CACHE={path!r} is not a readable JSON file of GEMM choices: {error}") from None
        entries = stored.get(_machine(), {}) if isinstance(stored, dict) else None
        if not isinstance(entries, dict) or not all(isinstance(value, str) for value in entries.values()):
            raise ValueError(f"MOE_CPU_GEMM_CACHE={path!r} must map machines to {{shape class: implementation name}}")
        for key, value in entries.items():
            _choices.setdefault(key, value)  # a choice already used in this process stays
        _loaded_from = path


def _save() -> None:
    """Write this process's choices into MOE_CPU_GEMM_CACHE atomically (other machines' entries kept)."""
    path = os.environ.get("MOE_CPU_GEMM_CACHE")
    if not path:
        return
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError):
        stored = {}
    stored = stored if isinstance(stored, dict) else {}
    stored[_machine()] = {**stored.get(_machine(), {}), **_choices}
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".gemm-", suffix=".tmp", delete=False) as f:
        json.dump(stored, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)
