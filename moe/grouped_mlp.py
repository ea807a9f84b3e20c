"""Grouped MLP: y = act(x W1^T + b1) W2^T + b2 with each expert's weights on its slice of packed rows.

Shape legend: N packed rows (sorted by expert, no padding), M model dim, H expert hidden dim,
L local experts.

One autograd function runs the whole expert MLP piece by piece of each expert's rows, so empty
capacity slots cost nothing, large temporaries (activations, their gradients) live in the CPU
workspace, and only the pre-activation is kept besides where the backward needs it (GELU, SiLU).
The products go through oneDNN on the CPU (fp32, bf16, fp16), which on the machines we measured is
1.3-2.6x faster than the default BLAS for these shapes; elsewhere and for float64 through F.linear.
Set MOE_CPU_ONEDNN=0 to use F.linear everywhere. The backward is first-order only.
"""

import collections
import functools
import os

import torch
import torch.nn.functional as F

from kernels import workspace
from kernels import grouped_mm, grouped_mm_t

__all__ = ["ACTIVATIONS", "grouped_mlp", "linear"]

ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PIECE_ROWS = 32
_SHORT_REDUCTION = 16 * PIECE_ROWS
_MAX_SEEN_REDUCTIONS = 512  # well under oneDNN's default primitive cache of 1024
_SEEN_REDUCTIONS: collections.OrderedDict = collections.OrderedDict()


@functools.cache
def _onednn_linear(dtype: torch.dtype):
    """torch's oneDNN linear (the op Inductor emits on CPU) for `dtype`, if this build and CPU run it
    and it agrees with F.linear; else None. Half types need CPU support (fp16 often lacks it)."""
    if os.environ.get("MOE_CPU_ONEDNN", "1") == "0" or not torch.backends.mkldnn.is_available():
        return None
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or dtype not in _ONEDNN_DTYPES:
        return None
    # fixed values: the check must not touch the global RNG
    x = torch.linspace(-1, 1, 35).view(5, 7).to(dtype)
    w, b = torch.linspace(-2, 2, 21).view(3, 7).to(dtype), torch.linspace(0, 1, 3).to(dtype)
    try:
        ok = torch.allclose(op(x, w, b, "none", [], "").float(), F.linear(x, w, b).float(), rtol=1e-2, atol=1e-2)
    except RuntimeError:
        return None
    return op if ok else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias; x [n, in], weight [out, in]; through oneDNN on the CPU when available."""
    # compiled, Inductor chooses the CPU GEMM itself (and cannot trace the availability probe)
    op = _onednn_linear(x.dtype) if x.device.type == "cpu" and not torch.compiler.is_compiling() else None
    if op is None:
        return F.linear(x, weight, bias)
    return op(x, weight, bias, "none", [], "")


_ACTIVATION_FUNCTIONS = {
    "relu": lambda h, approximate: torch.relu(h),
    "gelu": lambda h, approximate: F.gelu(h, approximate=approximate),
    "silu": lambda h, approximate: F.silu(h),
    "tanh": lambda h, approximate: torch.tanh(h),
    "sigmoid": lambda h, approximate: torch.sigmoid(h),
}
_NEEDS_INPUT = ("gelu", "silu")  # activations whose backward needs the pre-activation, not only the output


def _activate(name: str, approximate: str, h: torch.Tensor, out: torch.Tensor) -> None:
    """out = act(h), elementwise."""
    if name == "relu":
        torch.clamp_min(h, 0, out=out)
    elif name == "tanh":
        torch.tanh(h, out=out)
    elif name == "sigmoid":
        torch.sigmoid(h, out=out)
    elif name == "gelu":
        torch.ops.aten.gelu.out(h, approximate=approximate, out=out)
    else:
        torch.ops.aten.silu.out(h, out=out)


def _activation_backward(name: str, approximate: str, grad_a, h, a, out) -> None:
    """out = grad_a * act'(.), from the output a (ReLU, Tanh, Sigmoid) or the input h (GELU, SiLU)."""
    ops = torch.ops.aten
    if name == "relu":
        ops.threshold_backward.grad_input(grad_a, a, 0, grad_input=out)
    elif name == "tanh":
        ops.tanh_backward.grad_input(grad_a, a, grad_input=out)
    elif name == "sigmoid":
        ops.sigmoid_backward.grad_input(grad_a, a, grad_input=out)
    elif name == "gelu":
        ops.gelu_backward.grad_input(grad_a, h, approximate=approximate, grad_input=out)
    else:
        ops.silu_backward.grad_input(grad_a, h, grad_input=out)


def _slices(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, row slice) pieces covering every expert's rows: a multiple of PIECE_ROWS, then the rest.

    oneDNN JIT-compiles a primitive per distinct shape (about 1 ms) and caches a bounded number,
    while routing changes expert sizes every step; cutting each expert's rows into a bulk and a rest
    of fewer than PIECE_ROWS rows keeps the distinct shapes few, so they are soon all cached.
    """
    out, start = [], 0
    for e, count in enumerate(counts):
        bulk = count - count % PIECE_ROWS
        for begin, end in ((start, start + bulk), (start + bulk, start + count)):
            if end > begin:
                out.append((e, slice(begin, end)))
        start += count
    return out


def _experts(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, row slice) of every expert with at least one row."""
    out, start = [], 0
    for e, count in enumerate(counts):
        if count:
            out.append((e, slice(start, start + count)))
        start += count
    return out


def _reduction_parts(rows: slice, out: torch.Tensor) -> list[slice]:
    """How a weight gradient over `rows` is cut: the row count is the reduction length there.

    A new count means a new oneDNN primitive, so by default the product runs as bulk plus rest, like
    the row products, and the two results are summed into place. For short reductions (many small
    experts), where that sum costs most and counts vary least, a count is remembered and runs as one
    product when it comes again, its primitive then being likely cached.
    """
    n = rows.stop - rows.start
    key = (n, out.shape, out.dtype)
    if key in _SEEN_REDUCTIONS:
        _SEEN_REDUCTIONS.move_to_end(key)
        return [rows]
    if n < _SHORT_REDUCTION:
        _SEEN_REDUCTIONS[key] = None
        if len(_SEEN_REDUCTIONS) > _MAX_SEEN_REDUCTIONS:
            _SEEN_REDUCTIONS.popitem(last=False)
    bulk = rows.start + n // PIECE_ROWS * PIECE_ROWS
    return [part for part in (slice(rows.start, bulk), slice(bulk, rows.stop)) if part.stop > part.start]


def _weight_grad_into(out: torch.Tensor, grad_NO: torch.Tensor, input_NI: torch.Tensor, rows: slice) -> None:
    """out = grad[rows]^T @ input[rows], cut as `_reduction_parts` says."""
    products = [linear(grad_NO[part].t(), input_NI[part].t()) for part in _reduction_parts(rows, out)]
    if len(products) == 1:
        out.copy_(products[0])
    else:
        torch.add(products[0], products[1], out=out)


def _grad_like(param: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Uninitialised gradient for a stacked parameter, zeroed only for experts that got no rows."""
    grad = workspace.empty_like(param)
    for e, count in enumerate(counts):
        if not count:
            grad[e].zero_()
    return grad


def _per_expert(param: torch.Tensor | None, num_experts: int) -> tuple:
    """Each expert's slice of a stacked parameter (None for every expert when there is no parameter)."""
    return (None,) * num_experts if param is None else param.unbind(0)


class _GroupedMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NM, weight1, bias1, weight2, bias2, counts, activation):
        name, approximate = activation
        pieces = _slices(counts)
        sizes = [rows.stop - rows.start for _, rows in pieces]
        a_NH = workspace.empty((x_NM.shape[0], weight1.shape[1]), x_NM.dtype, x_NM.device)
        y_NM = workspace.empty((x_NM.shape[0], weight2.shape[1]), x_NM.dtype, x_NM.device)
        w1, w2, b1, b2 = (_per_expert(p, weight1.shape[0]) for p in (weight1, weight2, bias1, bias2))
        hidden = []
        # views made in one call each: per-op overhead matters with many experts
        for (e, _), x, a, y in zip(pieces, x_NM.split(sizes), a_NH.split(sizes), y_NM.split(sizes)):
            h = linear(x, w1[e], b1[e])
            _activate(name, approximate, h, a)
            y.copy_(linear(a, w2[e], b2[e]))
            if name in _NEEDS_INPUT:
                hidden.append(h)
        ctx.counts, ctx.pieces, ctx.sizes = counts, pieces, sizes
        ctx.activation, ctx.has_bias = activation, bias1 is not None
        ctx.save_for_backward(x_NM, weight1, weight2, a_NH, *hidden)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_NM):
        # 1. per piece: grad_a = grad_y W2, grad_h = act'(grad_a), grad_x = grad_h W1
        # 2. per expert: weight gradients (bulk and rest summed into place) and bias gradients
        x_NM, weight1, weight2, a_NH, *hidden = ctx.saved_tensors
        name, approximate = ctx.activation
        grad_y_NM = grad_y_NM.contiguous()
        grad_h_NH = workspace.empty_like(a_NH)
        grad_x_NM = workspace.empty_like(x_NM)
        w1_t, w2_t = weight1.transpose(1, 2).unbind(0), weight2.transpose(1, 2).unbind(0)
        views = (grad_y_NM, a_NH, grad_h_NH, grad_x_NM)
        for index, ((e, _), grad_y, a, grad_h, grad_x) in enumerate(zip(ctx.pieces, *(t.split(ctx.sizes) for t in views))):
            grad_a = linear(grad_y, w2_t[e])
            _activation_backward(name, approximate, grad_a, hidden[index] if hidden else None, a, grad_h)
            grad_x.copy_(linear(grad_h, w1_t[e]))
        grad_w1, grad_w2 = _grad_like(weight1, ctx.counts), _grad_like(weight2, ctx.counts)
        grad_b1 = _grad_like(weight1.new_empty(weight1.shape[:2]), ctx.counts) if ctx.has_bias else None
        grad_b2 = _grad_like(weight2.new_empty(weight2.shape[:2]), ctx.counts) if ctx.has_bias else None
        for e, rows in _experts(ctx.counts):
            _weight_grad_into(grad_w2[e], grad_y_NM, a_NH, rows)
            _weight_grad_into(grad_w1[e], grad_h_NH, x_NM, rows)
            if ctx.has_bias:
                torch.sum(grad_y_NM[rows], 0, out=grad_b2[e])
                torch.sum(grad_h_NH[rows], 0, out=grad_b1[e])
        return grad_x_NM, grad_w1, grad_b1, grad_w2, grad_b2, None, None


class _GroupedGemmMLP(torch.autograd.Function):
    """The same MLP with a grouped GEMM (kernels.grouped_gemm): one product per layer for all experts."""

    @staticmethod
    def forward(ctx, x_NM, weight1, bias1, weight2, bias2, counts, activation):
        # counts: a list, or an int tensor on the device (then rows after sum(counts) are padding);
        # nothing here reads the counts on the host
        name, approximate = activation
        counts_L = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x_NM.device)
        # the expert of every row, padding rows counted with the last expert (their values are never read)
        row_N = torch.arange(x_NM.shape[0], device=x_NM.device)
        expert_N = torch.searchsorted(torch.cumsum(counts_L, 0), row_N, right=True).clamp(max=weight1.shape[0] - 1)
        h_NH = grouped_mm(x_NM, weight1.transpose(1, 2), counts_L)
        if bias1 is not None:
            h_NH += bias1.index_select(0, expert_N)
        a_NH = torch.empty_like(h_NH)
        _activate(name, approximate, h_NH, a_NH)
        y_NM = grouped_mm(a_NH, weight2.transpose(1, 2), counts_L)
        if bias2 is not None:
            y_NM += bias2.index_select(0, expert_N)
        ctx.activation, ctx.has_bias = activation, bias1 is not None
        ctx.save_for_backward(x_NM, weight1, weight2, h_NH, a_NH, counts_L)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_NM):
        x_NM, weight1, weight2, h_NH, a_NH, counts_L = ctx.saved_tensors
        name, approximate = ctx.activation
        grad_y_NM = grad_y_NM.contiguous()
        grad_h_NH = grouped_mm(grad_y_NM, weight2, counts_L)
        _activation_backward(name, approximate, grad_h_NH, h_NH, a_NH, grad_h_NH)
        grad_x_NM = grouped_mm(grad_h_NH, weight1, counts_L)
        grad_w2 = grouped_mm_t(grad_y_NM, a_NH, counts_L)
        grad_w1 = grouped_mm_t(grad_h_NH, x_NM, counts_L)
        grad_b1 = grad_b2 = None
        if ctx.has_bias:  # per-expert sums without atomics; one more segment holds the padding rows
            padding = (x_NM.shape[0] - counts_L.sum()).reshape(1)
            lengths, L = torch.cat([counts_L, padding]), counts_L.shape[0]
            grad_b2 = torch.segment_reduce(grad_y_NM.float(), "sum", lengths=lengths, unsafe=True).narrow(0, 0, L).to(weight2.dtype)
            grad_b1 = torch.segment_reduce(grad_h_NH.float(), "sum", lengths=lengths, unsafe=True).narrow(0, 0, L).to(weight1.dtype)
        return grad_x_NM, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def _traced_mlp(x_NM, weight1, bias1, weight2, bias2, counts: list[int], activation: str, approximate: str):
    """Plain per-expert products for torch.compile, which differentiates and fuses them itself.

    The autograd functions above manage memory and oneDNN primitives by hand (workspace buffers,
    out= products, a module-level cache of reduction lengths); tracing cannot follow that, and
    Inductor plans buffers and picks the CPU GEMM on its own.
    """
    outputs = []
    for e, x in enumerate(x_NM.split(counts)):
        h = F.linear(x, weight1[e], None if bias1 is None else bias1[e])
        a = _ACTIVATION_FUNCTIONS[activation](h, approximate)
        outputs.append(F.linear(a, weight2[e], None if bias2 is None else bias2[e]))
    return torch.cat(outputs)


def grouped_mlp(
    x_NM: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, weight2: torch.Tensor,
    bias2: torch.Tensor | None, counts: list[int], activation: str, approximate: str = "none",
    use_grouped_gemm: bool = False,
) -> torch.Tensor:
    """Run L stacked MLP experts on their slices of packed rows; differentiable in x and every weight.

    With use_grouped_gemm=True every layer is one grouped product over all experts (kernels.grouped_gemm:
    torch's grouped GEMM, a Triton kernel or a loop); otherwise products per piece of rows.

    Args:
        x_NM: packed rows, shape [N, M], expert 0's rows first.
        weight1: shape [L, H, M]; bias1: [L, H] or None.
        weight2: shape [L, M_out, H]; bias2: [L, M_out] or None.
        counts: rows per expert, L ints summing to N; with use_grouped_gemm also an int tensor [L] on
            the rows' device summing to at most N (the rows after them are padding, their outputs unspecified).
        activation: one of ACTIVATIONS; approximate: GELU's approximation ("none" or "tanh").
        use_grouped_gemm: one grouped GEMM per layer instead of products per piece.

    Returns:
        y_NM: shape [N, M_out].

    Raises:
        ValueError: if the counts do not match the rows or experts, or the activation is unknown.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if isinstance(counts, torch.Tensor):
        if not use_grouped_gemm or counts.shape != (weight1.shape[0],):
            raise ValueError(f"counts given as a tensor must have shape [{weight1.shape[0]}] and need "
                             f"use_grouped_gemm=True, got shape {list(counts.shape)}")
    elif len(counts) != weight1.shape[0] or sum(counts) != x_NM.shape[0]:
        raise ValueError(f"counts {counts} must have {weight1.shape[0]} entries summing to {x_NM.shape[0]}")
    if torch.compiler.is_compiling() and not isinstance(counts, torch.Tensor):
        return _traced_mlp(x_NM, weight1, bias1, weight2, bias2, counts, activation, approximate)
    if use_grouped_gemm:
        return _GroupedGemmMLP.apply(x_NM, weight1, bias1, weight2, bias2, counts, (activation, approximate))
    return _GroupedMLP.apply(x_NM, weight1, bias1, weight2, bias2, counts, (activation, approximate))
