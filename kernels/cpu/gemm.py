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
  it is several times faster, where AMX or AVX512-BF16 make the native products faster than fp32 and
  the timing keeps them.

Each shape class (N rounded up to a power of two, the widths, dtype, operand layouts, bias) takes the
backend measured fastest among those that run its dtype (`candidates`), on the actual operands of its
first call; `kernels.cpu.choices` measures and keeps the choices. Products run on the single-threaded
workers of `kernels.cpu.threads` (a concurrent plan) have shape classes of their own
("linear@worker"), measured there: one thread favours other kernels than two. Products of fewer than
MEASURE_FROM multiply-adds are not measured: they take BLAS (oneDNN's call costs more than such a
product, and a timing that small is noise), so small models are bitwise repeatable across processes
too. Half-precision products on a CPU without native half multiply-adds (oneDNN does not run the
dtype) take the widened product, unmeasured (`candidates`). MOE_CPU_GEMM=blas, onednn or widened
forces a backend (BLAS where the forced one does not run the dtype). Other devices, float64 and code
being compiled use torch's own products.

`choices`, `adopt`, `choose`, `kept` and `clear` are those of the process's `CpuBackend`
(`kernels.cpu.choices.backend`).
"""

import functools
import os

import torch
import torch.nn.functional as F

from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from kernels.cpu import threads
from kernels.cpu.choices import backend, class_rows, cpu_model, layout_code, rows_class, shape_key

__all__ = ["BACKENDS", "MEASURE_FROM", "PIECE_ROWS", "adopt", "by_rows_class", "candidates", "choices", "choose",
           "class_rows", "clear", "widened_only",
           "cpu_model", "kept", "linear", "linear_function", "linear_tn", "linear_tn_function", "measuring", "shape_key",
           "worth_measuring"]

BACKENDS = ("blas", "onednn", "widened")
PIECE_ROWS = 32
MEASURE_FROM = 1 << 22  # multiply-adds: smaller products take the first listed implementation unmeasured
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WIDENED_DTYPES = (torch.bfloat16, torch.float16)  # products the "widened" backend is a candidate for


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
    than fp32's BLAS, and timing them would cost a first call minutes; the widened product is taken.
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
    `kernels.cpu.threads` the kind is the worker's ("linear@worker"): measured on one thread.
    """
    forced = _forced()
    if forced != "auto":
        return forced if forced in _runnable(dtype) else "blas"
    names = candidates(dtype)
    if len(names) > 1 and not worth_measuring(multiply_adds):
        return "blas"
    if threads.on_worker():
        kind += "@worker"
    fast_key = (kind, rows_class(n), widths, dtype, *map(layout_code, operands))
    return backend.resolve(fast_key, (kind, n, widths, dtype, *operands), names, run)


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
    chosen = _backend("linear", n, (width_in, width_out), x_NI.dtype, (x_NI, w_OI, b_O), n * width_in * width_out,
                      lambda name: _LINEAR[name](x_NI, w_OI, b_O, out))
    return _LINEAR[chosen]


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
    chosen = _backend("linear_tn", n, (width_p, width_q), a_NP.dtype, (a_NP, b_NQ), n * width_p * width_q,
                      lambda name: _LINEAR_TN[name](a_NP, b_NQ, out))
    return _LINEAR_TN[chosen]


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
    runs a dict lookup instead of the backend's resolution (Python that costs the products more than
    its own time, as it evicts their operands from the caches). For one thread's loop only: the
    concurrent plan's workers resolve per product, each in its own thread's shape classes.

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
            key = (rows_class(n), worth_measuring(n * row_work(*operands)))
            function = chosen.get(key)
            if function is None:
                function = chosen[key] = function_of(*operands)
            by_rows[n] = function
        return function(*operands)

    return run


# the process's measured choices (kernels.cpu.choices.CpuBackend), as functions of this module

def choose(key: str, runs: dict) -> str:
    """`CpuBackend.choose` of the process's backend."""
    return backend.choose(key, runs)


def kept(key: str) -> str | None:
    """`CpuBackend.kept` of the process's backend."""
    return backend.kept(key)


def choices() -> dict[str, str]:
    """`CpuBackend.choices` of the process's backend: shape class -> the implementation chosen."""
    return backend.choices()


def adopt(chosen: dict[str, str]) -> None:
    """`CpuBackend.adopt` of the process's backend."""
    backend.adopt(chosen)


def clear() -> None:
    """`CpuBackend.clear` of the process's backend (tests; a later product measures again)."""
    backend.clear()
