"""Grouped MLP: y = act(x W1^T + b1) W2^T + b2 with each expert's weights on its slice of packed rows.

Shape legend: N packed rows (sorted by expert, no padding), M model dim, H expert hidden dim,
L local experts.

Gated (`gated=True`, the SwiGLU MLP of Mixtral, Qwen, DeepSeek, OLMoE): W1 holds each expert's gate
rows then its up rows, [L, 2H, M], so that one product makes h = [gate | up], and the activation
step is a = act(gate) * up, [N, H]; W2 is [L, M, H] as for the plain MLP. Its backward takes
grad_a = grad_y W2 to grad_gate = grad_a * up * act'(gate) and grad_up = grad_a * act(gate), [N, 2H],
the hidden gradient the rest of the backward uses as the plain MLP's. Both forms keep h and a for the
backward (the plain MLP only a where its activation's backward needs no more). The autograd functions
below take the activation as one tuple, (name, approximate, gated).

Three implementations, equal up to the order of fp32 sums:
- per expert: one autograd function runs each expert's products on its rows, so empty capacity
  slots cost nothing; large temporaries (activations, their gradients) live in the CPU workspace and
  the products write into them (`kernels.cpu` picks each product's CPU backend by measurement);
  only the pre-activation is kept besides where the backward needs it (GELU, SiLU). The forward's
  activation runs once over every row, between the loops of products. The backward makes the hidden
  gradient of all N rows (grad_y W2 per expert, then one activation backward over every row) where
  that buffer takes at most WHOLE_HIDDEN_BYTES; beyond, it goes expert by expert: the hidden
  gradient of one expert's rows is made in a buffer of the largest expert's rows (one per worker in
  the concurrent plan) and used at once for that expert's gradients, so a large layer's backward
  never holds the hidden gradient of all N rows (128 MiB at N = 16384, H = 2048 in fp32).
- grouped: one grouped GEMM per layer for all experts (`kernels.grouped_gemm`).
- concurrent (CPU): the per-expert work with experts side by side on single-threaded workers
  (`kernels.cpu.run_each`), each product through the backend measured for its shape class on one
  thread. Several products each on one core can beat each product on every core, and do by far when
  other processes share the cores. Where the workers are torch's own OpenMP team (Linux), offered for
  every layer whose plan is timed; on a pool of threads only for large layers (see CONCURRENT_FROM).
On the CPU with `use_grouped_gemm=None` the candidates are timed on the first batch of each shape
class and the fastest is kept (see `kernels.cpu`). The backward is first-order only, and computes
only the gradients autograd asks for (`ctx.needs_input_grad`): rows that need no gradient (a model's
first layer) save the input-gradient product per expert, frozen weights their products and sums, as
autograd saves them for nn.Linear.
"""

import queue
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from kernels import cpu, grouped_mm, grouped_mm_t, grouped_sum
from kernels.grouped_gemm import group_offsets, runs_natively

__all__ = ["ACTIVATIONS", "apply_activation", "grouped_mlp"]

ACTIVATIONS = ("relu", "gelu", "silu", "tanh", "sigmoid")
# multiply-adds of the first product from which the concurrent plan is a candidate when its workers
# are a pool of threads (kernels.cpu.threads): while they run, the caller's idle OpenMP threads spin
# for a while (libgomp's default wait policy), which the plan's timing alone does not see, and a small
# layer's training step pays more for it than the plan saves; a large layer's products outweigh it. On
# torch's own OpenMP team nothing spins beside the workers: the plan is a candidate for every measured layer.
CONCURRENT_FROM = 1 << 32
# the per-expert backward makes all experts' hidden gradients in one [N, H] buffer, then runs the
# activation's backward once over every row, when that buffer takes at most this many bytes; beyond,
# expert by expert in a buffer of the largest expert's rows (the memory the docstring's note is about).
# Per expert, oneDNN's GELU backward meets a new row count each call and builds its primitive anew,
# which one call over all rows avoids.
WHOLE_HIDDEN_BYTES = 32 << 20


_ACTIVATION_FUNCTIONS = {
    "relu": lambda h, approximate: torch.relu(h),
    "gelu": lambda h, approximate: F.gelu(h, approximate=approximate),
    "silu": lambda h, approximate: F.silu(h),
    "tanh": lambda h, approximate: torch.tanh(h),
    "sigmoid": lambda h, approximate: torch.sigmoid(h),
}
_NEEDS_INPUT = ("gelu", "silu")  # activations whose backward needs the pre-activation, not only the output


def apply_activation(h: torch.Tensor, activation: str, approximate: str = "none", gated: bool = False) -> torch.Tensor:
    """act(h), or for a gated MLP act(gate) * up of h = [gate | up] (last dimension); differentiable by autograd."""
    if not gated:
        return _ACTIVATION_FUNCTIONS[activation](h, approximate)
    gate, up = h.chunk(2, dim=-1)
    return _ACTIVATION_FUNCTIONS[activation](gate, approximate) * up


def _activate(activation: tuple, h: torch.Tensor, out: torch.Tensor) -> None:
    """out = act(h), elementwise; gated, out = act(h[:, :H]) * h[:, H:] for out of width H."""
    name, approximate, gated = activation
    if gated:
        width = out.shape[-1]
        _activate_elementwise(name, approximate, h[..., :width], out)
        out.mul_(h[..., width:])
    else:
        _activate_elementwise(name, approximate, h, out)


def _activate_elementwise(name: str, approximate: str, h: torch.Tensor, out: torch.Tensor) -> None:
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


def _activation_backward(activation: tuple, grad_a, h, a, out) -> None:
    """out = the gradient of h from grad_a, the gradient of the activation's output a = act(h).

    Plain: out = grad_a * act'(h) (out may be grad_a itself). Gated, h = [gate | up] of width 2H and
    grad_a of width H: out[:, :H] = grad_a * up * act'(gate), out[:, H:] = grad_a * act(gate), with
    act(gate) made in out[:, H:] first (the output the backwards of ReLU, Tanh and Sigmoid read).
    """
    name, approximate, gated = activation
    if not gated:
        _elementwise_backward(name, approximate, grad_a, h, a, out)
        return
    width = grad_a.shape[-1]
    gate, up, grad_gate, grad_up = h[..., :width], h[..., width:], out[..., :width], out[..., width:]
    _activate_elementwise(name, approximate, gate, grad_up)
    torch.mul(grad_a, up, out=grad_gate)
    _elementwise_backward(name, approximate, grad_gate, gate, grad_up, grad_gate)
    grad_up.mul_(grad_a)


def _elementwise_backward(name: str, approximate: str, grad_a, h, a, out) -> None:
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


def _nonempty(counts: list[int]) -> list[int]:
    """The experts with at least one row."""
    return [e for e, count in enumerate(counts) if count]


def _grad_like(param: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Uninitialised gradient for a stacked parameter, zeroed only for experts that got no rows."""
    grad = cpu.empty_like(param)
    for e, count in enumerate(counts):
        if not count:
            grad[e].zero_()
    return grad


def _per_expert(param: torch.Tensor | None, num_experts: int) -> tuple:
    """Each expert's slice of a stacked parameter (None for every expert when there is no parameter)."""
    return (None,) * num_experts if param is None else param.unbind(0)


def _forward_buffers(x_NM, weight1, weight2, activation: tuple) -> tuple:
    """The forward's workspace buffers h_NH (pre-activation, [N, 2H] when gated), a_NH (activation) and
    y_NM; h_NH is a_NH itself (activated in place) when the activation's backward needs only its output."""
    name, _, gated = activation
    N, M_out = x_NM.shape[0], weight2.shape[1]
    a_NH = cpu.empty((N, weight2.shape[2]), x_NM.dtype, x_NM.device)
    separate = gated or name in _NEEDS_INPUT
    h_NH = cpu.empty((N, weight1.shape[1]), x_NM.dtype, x_NM.device) if separate else a_NH
    return h_NH, a_NH, cpu.empty((N, M_out), x_NM.dtype, x_NM.device)


def _save(ctx, x_NM, weight1, weight2, h_NH, a_NH, counts, activation) -> None:
    ctx.counts, ctx.activation = counts, activation
    ctx.save_for_backward(x_NM, weight1, weight2, a_NH, *([h_NH] if h_NH is not a_NH else []))


def _backward_buffers(ctx, grad_y_NM) -> SimpleNamespace:
    """The backward's saved tensors and the gradient buffers autograd asked for (None where an input
    needs no gradient), whole and as each expert's rows (`*_e`).

    Weight and bias gradients are zero for experts that got no rows; the rest is written by the products.
    The hidden gradient is made when x, W1 or b1 needs a gradient (`b.needs_h`): for all rows at once
    (`_whole_hidden_gradient`) up to WHOLE_HIDDEN_BYTES, else per expert (`_hidden_gradient`).
    """
    x_NM, weight1, weight2, a_NH, *kept = ctx.saved_tensors
    counts = ctx.counts
    needs_x, needs_w1, needs_b1, needs_w2, needs_b2 = ctx.needs_input_grad[:5]
    none = (None,) * len(counts)
    b = SimpleNamespace(x_NM=x_NM, weight1=weight1, weight2=weight2, a_NH=a_NH, h_NH=kept[0] if kept else None,
                        grad_y_NM=grad_y_NM.contiguous(), needs_h=needs_x or needs_w1 or needs_b1)
    b.grad_x_NM = cpu.empty_like(x_NM) if needs_x else None
    b.grad_w1 = _grad_like(weight1, counts) if needs_w1 else None
    b.grad_w2 = _grad_like(weight2, counts) if needs_w2 else None
    b.grad_b1 = _grad_like(weight1.new_empty(weight1.shape[:2]), counts) if needs_b1 else None
    b.grad_b2 = _grad_like(weight2.new_empty(weight2.shape[:2]), counts) if needs_b2 else None
    # each expert's rows as views made in one call per tensor: the loops issue products, not slicing
    b.grad_y_e, b.grad_x_e, b.x_e, b.a_e, b.h_e = (
        none if t is None else t.split_with_sizes(counts) for t in (b.grad_y_NM, b.grad_x_NM, x_NM, a_NH, b.h_NH))
    b.grad_w1_e, b.grad_w2_e, b.grad_b1_e, b.grad_b2_e = (
        none if t is None else t.unbind(0) for t in (b.grad_w1, b.grad_w2, b.grad_b1, b.grad_b2))
    return b


def _hidden_buffers(activation: tuple, rows: int, a_NH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h, grad_a) buffers of `rows` rows: one buffer, the activation's backward in place, for a plain
    MLP; gated, grad_h [rows, 2H] and grad_a [rows, H] (grad_y W2, before the gated backward)."""
    H = a_NH.shape[1]
    grad_a = cpu.empty((rows, H), a_NH.dtype, a_NH.device)
    return (cpu.empty((rows, 2 * H), a_NH.dtype, a_NH.device), grad_a) if activation[2] else (grad_a, grad_a)


def _hidden_gradient(b: SimpleNamespace, activation: tuple, e: int, w2_t, grad_h: torch.Tensor,
                     grad_a: torch.Tensor) -> torch.Tensor:
    """Expert e's hidden gradient written into grad_h ([n_e, H], or [n_e, 2H] when gated; contiguous):
    grad_y W2 into grad_a (grad_h itself when plain), then the activation's backward."""
    b.product_h(b.grad_y_e[e], w2_t[e], None, grad_a)
    _activation_backward(activation, grad_a, b.h_e[e], b.a_e[e], grad_h)
    return grad_h


def _whole_hidden_gradient(ctx, b: SimpleNamespace, w2_t) -> tuple | None:
    """Each expert's rows of one [N, H] hidden gradient ([N, 2H] gated), one activation backward for all;
    None past the bound."""
    N, H = b.a_NH.shape
    width = 3 * H if ctx.activation[2] else H  # gated: grad_h [N, 2H] and grad_a [N, H]
    if N * width * b.a_NH.element_size() > WHOLE_HIDDEN_BYTES:
        return None
    grad_h_NH, grad_a_NH = _hidden_buffers(ctx.activation, N, b.a_NH)
    grad_a_e = grad_a_NH.split_with_sizes(ctx.counts)
    for e in _nonempty(ctx.counts):
        b.product_h(b.grad_y_e[e], w2_t[e], None, grad_a_e[e])
    _activation_backward(ctx.activation, grad_a_NH, b.h_NH, b.a_NH, grad_h_NH)
    return grad_h_NH.split_with_sizes(ctx.counts)


# an expert's backward in two independent parts: "h", what needs its hidden gradient (the input's
# gradient, W1's and b1's), and "w2", W2's and b2's gradients, which need only grad_y and the activation
_ALL_PARTS = ("h", "w2")


def _expert_gradients(b: SimpleNamespace, e: int, w1_t, grad_h: torch.Tensor | None, parts: tuple = _ALL_PARTS) -> None:
    """Expert e's input, weight and bias gradients that autograd asked for, of the given parts, from
    its hidden gradient grad_h (None when none of them needs it)."""
    grad_y = b.grad_y_e[e]
    if "h" in parts and b.grad_x_NM is not None:
        b.product_x(grad_h, w1_t[e], None, b.grad_x_e[e])
    if "w2" in parts and b.grad_w2 is not None:
        b.product_w2(grad_y, b.a_e[e], b.grad_w2_e[e])
    if "h" in parts and b.grad_w1 is not None:
        b.product_w1(grad_h, b.x_e[e], b.grad_w1_e[e])
    if "w2" in parts and b.grad_b2 is not None:
        torch.sum(grad_y, 0, out=b.grad_b2_e[e])
    if "h" in parts and b.grad_b1 is not None:
        torch.sum(grad_h, 0, out=b.grad_b1_e[e])


def _expert_backward(ctx, b: SimpleNamespace, slots: int):
    """The backward's work for one expert e, as a function of (e, parts) (parts: of _ALL_PARTS, all of
    them by default), for up to `slots` experts at once.

    With one slot and a hidden gradient of all rows within WHOLE_HIDDEN_BYTES, that gradient is made
    here first, for every expert (`_whole_hidden_gradient`). Otherwise each running expert's "h" part
    takes one of `slots` hidden-gradient buffers of the largest expert's rows and gives it back when
    done (a "w2" part needs none). The
    buffers are made here, on the calling thread, so that allocation trackers (which see only that
    thread) see them, and never [N, H] at once.
    """
    w1_t, w2_t = b.weight1.transpose(1, 2).unbind(0), b.weight2.transpose(1, 2).unbind(0)
    experts = _nonempty(ctx.counts)
    # one thread: each product's backend resolved once per rows class; workers resolve per product,
    # each in its own thread's classes (kernels.cpu.gemm)
    one = slots == 1
    b.product_h, b.product_x = (cpu.by_rows_class("linear") if one else cpu.linear for _ in range(2))
    b.product_w2, b.product_w1 = (cpu.by_rows_class("linear_tn") if one else cpu.linear_tn for _ in range(2))
    buffers = queue.SimpleQueue()
    grad_h_e = _whole_hidden_gradient(ctx, b, w2_t) if one and b.needs_h else None
    if b.needs_h and grad_h_e is None:
        for _ in range(min(slots, len(experts))):
            buffers.put(_hidden_buffers(ctx.activation, max(ctx.counts), b.a_NH))

    def expert(e: int, parts: tuple = _ALL_PARTS) -> None:
        if not b.needs_h or grad_h_e is not None or "h" not in parts:
            _expert_gradients(b, e, w1_t, None if grad_h_e is None else grad_h_e[e], parts)
            return
        grad_h, grad_a = buffer = buffers.get()
        rows = ctx.counts[e]
        _expert_gradients(b, e, w1_t, _hidden_gradient(b, ctx.activation, e, w2_t, grad_h[:rows], grad_a[:rows]), parts)
        buffers.put(buffer)

    return expert


def _gradients(b: SimpleNamespace) -> tuple:
    return b.grad_x_NM, b.grad_w1, b.grad_b1, b.grad_w2, b.grad_b2, None, None


class _PerExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NM, weight1, bias1, weight2, bias2, counts, activation):
        h_NH, a_NH, y_NM = _forward_buffers(x_NM, weight1, weight2, activation)
        w1, w2, b1, b2 = (_per_expert(p, weight1.shape[0]) for p in (weight1, weight2, bias1, bias2))
        x_e, h_e, a_e, y_e = (t.split_with_sizes(counts) for t in (x_NM, h_NH, a_NH, y_NM))
        experts = _nonempty(counts)
        first, second = (cpu.by_rows_class("linear") for _ in range(2))
        for e in experts:
            first(x_e[e], w1[e], b1[e], h_e[e])
        _activate(activation, h_NH, a_NH)  # one call for every row: faster than one per expert
        for e in experts:
            second(a_e[e], w2[e], b2[e], y_e[e])
        _save(ctx, x_NM, weight1, weight2, h_NH, a_NH, counts, activation)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_NM):
        # grad_h = act'(.) * (grad_y W2) for all rows at once (up to WHOLE_HIDDEN_BYTES) or expert by expert in
        # one buffer of the largest expert's rows, then per expert grad_x = grad_h W1, the weight gradients
        # (reductions over the expert's rows) and the biases
        b = _backward_buffers(ctx, grad_y_NM)
        expert = _expert_backward(ctx, b, 1)
        for e in _nonempty(ctx.counts):
            expert(e)
        return _gradients(b)


class _ConcurrentMLP(torch.autograd.Function):
    """The per-expert MLP with experts run side by side on single-threaded CPU workers (kernels.cpu.run_each).

    Forward, an expert's rows are one work item (products and activation), the largest experts first;
    where more experts have rows than there are workers, the `workers` smallest are cut into two
    halves of rows, the last items. Backward, an expert's gradients are two items: what needs its
    hidden gradient (three products, the activation's backward, b1's sum) and W2's and b2's gradients
    (one product and a sum); every expert's first item comes before any second one. So the workers end
    on short items and wait less for each other at the end of a call.
    Each product takes the backend measured for its shape class on one thread, the same on every
    worker, so which worker runs an item does not change its result (a lone item runs in the
    caller, with the caller's threads and shape classes).
    """

    @staticmethod
    def forward(ctx, x_NM, weight1, bias1, weight2, bias2, counts, activation):
        h_NH, a_NH, y_NM = _forward_buffers(x_NM, weight1, weight2, activation)
        w1, w2, b1, b2 = (_per_expert(p, weight1.shape[0]) for p in (weight1, weight2, bias1, bias2))
        x_e, h_e, a_e, y_e = (t.split_with_sizes(counts) for t in (x_NM, h_NH, a_NH, y_NM))

        def rows(item):
            e, start, length = item
            x, h, a, y = (t[e] if length == counts[e] else t[e].narrow(0, start, length) for t in (x_e, h_e, a_e, y_e))
            cpu.linear(x, w1[e], b1[e], h)
            _activate(activation, h, a)
            cpu.linear(a, w2[e], b2[e], y)

        cpu.run_each(rows, _forward_items(counts, cpu.workers()))
        _save(ctx, x_NM, weight1, weight2, h_NH, a_NH, counts, activation)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_NM):
        # each expert's two parts are items of their own: first every expert's hidden-gradient part
        # (three products), then the W2 parts (one product each), so the workers finish on short items
        b = _backward_buffers(ctx, grad_y_NM)
        expert = _expert_backward(ctx, b, cpu.workers())
        order = _largest_first(ctx.counts)
        if len(order) == 1:  # a lone expert: one item, run in the caller with its threads
            items = [(order[0], _ALL_PARTS)]
        else:
            items = [(e, ("h",)) for e in order] if b.needs_h else []
            items += [(e, ("w2",)) for e in order] if b.grad_w2 is not None or b.grad_b2 is not None else []
        cpu.run_each(lambda item: expert(*item), items)
        return _gradients(b)


def _forward_items(counts: list[int], workers: int) -> list[tuple[int, int, int]]:
    """The forward's work items (expert, first row, rows): whole experts, the most rows first; where
    more experts have rows than there are workers (two or more), the `workers` smallest are each cut
    in two halves that end the order: rows are independent in the forward, and workers that finish on
    half an expert wait less for each other."""
    order = _largest_first(counts)
    cut = order[len(order) - workers:] if 1 < workers < len(order) else []
    items = [(e, 0, counts[e]) for e in order if e not in cut]
    halves = [(e, 0, counts[e] - counts[e] // 2) for e in cut] + [(e, counts[e] - counts[e] // 2, counts[e] // 2) for e in cut]
    return items + sorted((h for h in halves if h[2]), key=lambda h: -h[2])


def _largest_first(counts: list[int]) -> list[int]:
    """The experts with rows, the most rows first (ties by index)."""
    return sorted(_nonempty(counts), key=lambda e: -counts[e])


class _GroupedGemmMLP(torch.autograd.Function):
    """The same MLP with a grouped GEMM (kernels.grouped_gemm): one product per layer for all experts."""

    @staticmethod
    def forward(ctx, x_NM, weight1, bias1, weight2, bias2, counts, activation):
        # counts: a list, or an int tensor on the device (then rows after sum(counts) are padding);
        # nothing here reads the counts on the host
        counts_L = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x_NM.device)
        offsets_L = group_offsets(counts_L)  # made once for the layer's products and bias sums
        # the expert of every row, padding rows counted with the last expert (their values are never read)
        row_N = torch.arange(x_NM.shape[0], device=x_NM.device, dtype=torch.int32)
        expert_N = torch.searchsorted(offsets_L, row_N, right=True).clamp(max=weight1.shape[0] - 1)
        h_NH = grouped_mm(x_NM, weight1.transpose(1, 2), counts_L, offsets_L)
        if bias1 is not None:
            h_NH += bias1.index_select(0, expert_N)
        a_NH = h_NH.new_empty((h_NH.shape[0], weight2.shape[2]))
        _activate(activation, h_NH, a_NH)
        y_NM = grouped_mm(a_NH, weight2.transpose(1, 2), counts_L, offsets_L)
        if bias2 is not None:
            y_NM += bias2.index_select(0, expert_N)
        ctx.activation = activation
        ctx.save_for_backward(x_NM, weight1, weight2, h_NH, a_NH, counts_L, offsets_L)
        return y_NM

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y_NM):
        x_NM, weight1, weight2, h_NH, a_NH, counts_L, offsets_L = ctx.saved_tensors
        needs_x, needs_w1, needs_b1, needs_w2, needs_b2 = ctx.needs_input_grad[:5]
        grad_y_NM = grad_y_NM.contiguous()
        grad_x_NM = grad_w1 = grad_b1 = grad_w2 = grad_b2 = grad_h_NH = None
        if needs_x or needs_w1 or needs_b1:
            grad_a_NH = grouped_mm(grad_y_NM, weight2, counts_L, offsets_L)
            grad_h_NH = torch.empty_like(h_NH) if ctx.activation[2] else grad_a_NH  # gated: [N, 2H] from [N, H]
            _activation_backward(ctx.activation, grad_a_NH, h_NH, a_NH, grad_h_NH)
        if needs_x:
            grad_x_NM = grouped_mm(grad_h_NH, weight1, counts_L, offsets_L)
        if needs_w2:
            grad_w2 = grouped_mm_t(grad_y_NM, a_NH, counts_L, offsets_L)
        if needs_w1:
            grad_w1 = grouped_mm_t(grad_h_NH, x_NM, counts_L, offsets_L)
        # per-expert sums in fp32, without atomics (padding rows left out)
        grad_b2 = grouped_sum(grad_y_NM, counts_L, offsets_L).to(weight2.dtype) if needs_b2 else None
        grad_b1 = grouped_sum(grad_h_NH, counts_L, offsets_L).to(weight1.dtype) if needs_b1 else None
        return grad_x_NM, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def _traced_mlp(x_NM, weight1, bias1, weight2, bias2, counts: list[int], activation: tuple):
    """Plain per-expert products for torch.compile, which differentiates and fuses them itself.

    The autograd functions above manage memory and oneDNN primitives by hand (workspace buffers,
    out= products, a module-level cache of reduction lengths); tracing cannot follow that, and
    Inductor plans buffers and picks the CPU GEMM on its own.
    """
    outputs = []
    for e, x in enumerate(x_NM.split(counts)):
        h = F.linear(x, weight1[e], None if bias1 is None else bias1[e])
        a = apply_activation(h, *activation)
        outputs.append(F.linear(a, weight2[e], None if bias2 is None else bias2[e]))
    return torch.cat(outputs)


def grouped_mlp(
    x_NM: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, weight2: torch.Tensor,
    bias2: torch.Tensor | None, counts: list[int], activation: str, approximate: str = "none",
    use_grouped_gemm: bool | None = False, gated: bool = False,
) -> torch.Tensor:
    """Run L stacked MLP experts on their slices of packed rows; differentiable in x and every weight.

    With use_grouped_gemm=True every layer is one grouped product over all experts (kernels.grouped_gemm:
    torch's grouped GEMM, a Triton kernel or a loop); with False, products per expert; with None, on
    the CPU, whichever plan (per expert, grouped, experts side by side on worker threads) was measured
    fastest for this shape class (per expert elsewhere).

    Args:
        x_NM: packed rows, shape [N, M], expert 0's rows first.
        weight1: shape [L, H, M], gated [L, 2H, M] (each expert's gate rows, then its up rows); bias1:
            [L, H] ([L, 2H]) or None.
        weight2: shape [L, M_out, H]; bias2: [L, M_out] or None.
        counts: rows per expert, L ints summing to N; with use_grouped_gemm also an int tensor [L] on
            the rows' device summing to at most N (the rows after them are padding, their outputs unspecified).
        activation: one of ACTIVATIONS; approximate: GELU's approximation ("none" or "tanh").
        use_grouped_gemm: one grouped GEMM per layer (True), products per expert (False), or measured (None).
        gated: the gated MLP, y = (act(x W_gate^T) * (x W_up^T)) W2^T (biases added where given).

    Returns:
        y_NM: shape [N, M_out].

    Raises:
        ValueError: if the counts do not match the rows or experts, the activation is unknown, or the
            weights' hidden widths do not match (weight1's rows twice weight2's columns when gated).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if weight1.shape[1] != (2 if gated else 1) * weight2.shape[2]:
        raise ValueError(f"weight1 must have {'twice ' if gated else ''}weight2's hidden width ({weight2.shape[2]}) "
                         f"as its rows{' (gate, then up)' if gated else ''}, got weight1 {list(weight1.shape)} and "
                         f"weight2 {list(weight2.shape)}")
    if isinstance(counts, torch.Tensor):
        if not use_grouped_gemm or counts.shape != (weight1.shape[0],):
            raise ValueError(f"counts given as a tensor must have shape [{weight1.shape[0]}] and need "
                             f"use_grouped_gemm=True, got shape {list(counts.shape)}")
    elif len(counts) != weight1.shape[0] or sum(counts) != x_NM.shape[0]:
        raise ValueError(f"counts {counts} must have {weight1.shape[0]} entries summing to {x_NM.shape[0]}")
    if torch.compiler.is_compiling() and not isinstance(counts, torch.Tensor):
        return _traced_mlp(x_NM, weight1, bias1, weight2, bias2, counts, (activation, approximate, gated))
    plan = ("grouped" if use_grouped_gemm else "per_expert") if use_grouped_gemm is not None else \
        _measured_plan(x_NM, weight1, bias1, weight2, bias2, counts, (activation, approximate, gated))
    return _PLANS[plan].apply(x_NM, weight1, bias1, weight2, bias2, counts, (activation, approximate, gated))


_PLANS = {"per_expert": _PerExpertMLP, "grouped": _GroupedGemmMLP, "concurrent": _ConcurrentMLP}


def _measured_plan(x_NM, weight1, bias1, weight2, bias2, counts: list[int], activation: tuple) -> str:
    """The plan that ran this forward+backward fastest, each candidate run on the actual operands, timed
    once per shape class on the CPU (kernels.cpu); per expert elsewhere and for small layers.

    Candidates: per expert; the grouped GEMM where torch runs it natively; experts side by side on
    single-threaded workers where torch has more than one thread, on its OpenMP team, or on a pool of
    threads for a large layer (CONCURRENT_FROM).
    Products alone would mislead, since per expert the bias is added to rows still in cache.
    """
    L, H, M = weight1.shape
    if x_NM.device.type != "cpu" or isinstance(x_NM, FakeTensor):
        return "per_expert"
    # half precision without native products (cpu.widened_only): its products are not timed, the plans
    # are, all but the grouped GEMM, which would multiply in the half dtype itself, far slower than the others
    widened = cpu.widened_only(x_NM.dtype)
    if (not (cpu.measuring(x_NM.dtype) or widened)
            or not cpu.worth_measuring(x_NM.shape[0] * (M * H + weight2.shape[2] * weight2.shape[1]))):
        return "per_expert"
    operands = [t for t in (x_NM, weight1, bias1, weight2, bias2) if t is not None]
    # the gradients a training step asks for decide the backward's work (no input gradient: one
    # product fewer), so they are part of the class; read from requires_grad, not the grad mode, so an
    # evaluation forward (no_grad) takes the plan of the training forwards of the same layer; with
    # nothing requiring a gradient at all, a full backward is timed
    needs = [t.requires_grad for t in operands]
    needs = needs if any(needs) else [True] * len(operands)
    kind = "gated_mlp" if activation[2] else "mlp"  # a gated MLP's class apart from a plain one of its widths
    kind += "" if all(needs) else "@grads=" + "".join("01"[need] for need in needs)
    key = cpu.shape_key(kind, x_NM.shape[0], (L, M, H, weight2.shape[1]), x_NM.dtype, bias1)
    native = runs_natively(x_NM, weight1) and not widened
    kept = cpu.backend.kept(key)
    if kept in _PLANS and (kept != "grouped" or native):  # kept: it stands (concurrent runs on any thread count)
        return kept
    # the candidates depend on the shape class only (its rows, not this batch's), so every batch of a
    # class is offered the same plans and a choice once made is never measured again
    candidates = ["per_expert"] + ["grouped"] * native
    if cpu.workers() > 1 and (cpu.openmp_team() or cpu.class_rows(x_NM.shape[0]) * M * H >= CONCURRENT_FROM):
        candidates.append("concurrent")
    if len(candidates) == 1 or torch.is_inference_mode_enabled():  # inference: no backward can run to be timed
        return "per_expert"
    leaves = [t.detach().requires_grad_(need) for t, need in zip(operands, needs)]
    inputs = [t for t in leaves if t.requires_grad]

    def forward_backward(function):
        def run():
            with torch.enable_grad():
                operand = iter(leaves)
                args = [None if t is None else next(operand) for t in (x_NM, weight1, bias1, weight2, bias2)]
                y_NM = function.apply(*args, counts, activation)
                torch.autograd.grad(y_NM, inputs, y_NM.detach())
        return run

    return cpu.backend.choose(key, {name: forward_backward(_PLANS[name]) for name in candidates})
