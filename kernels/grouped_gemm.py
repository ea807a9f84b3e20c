"""Grouped GEMM: one matrix product per expert over its slice of packed rows, in one launch.

    grouped_mm(x_NI, w_LIO, counts)    y[rows_e] = x[rows_e] @ w[e]            -> [N, O]
    grouped_mm_t(a_NP, b_NQ, counts)   out[e]    = a[rows_e]^T @ b[rows_e]     -> [L, P, Q]
    grouped_sum(x_NM, counts)          out[e]    = sum of x[rows_e]            -> [L, M], fp32

Shape legend: N packed rows (expert 0's first), L experts, I/O/P/Q widths, T row tiles; `counts`
gives each expert's rows, as a list or as an int tensor on the rows' device. With a tensor, the rows
may end in padding (sum(counts) <= N): padding rows of the output are left unspecified and take no
part in `grouped_mm_t`. The first form is a layer's forward and input gradient, the second its
weight gradient, the third its bias gradient. Backends of the products: torch's own grouped GEMM
(`torch._grouped_mm`) where it runs for the device and dtype; else a Triton kernel on CUDA (fp32
accumulation, no atomics); else a loop of torch products over slices, which is also the reference.
The torch and Triton backends take the counts on the device and never read them on the host (no
sync); the loop needs them on the host. The sums take a Triton kernel where `use_triton` says,
else torch's segment_reduce; neither reads the counts on the host.
"""

import functools
import os

import torch

from kernels.backend import launcher, use_triton

__all__ = ["group_offsets", "grouped_mm", "grouped_mm_reference", "grouped_mm_t", "grouped_mm_t_reference",
           "grouped_sum", "grouped_sum_reference", "torch_backend_runs"]

BLOCK = 32  # tile edge of the Triton kernels (rows, columns and reduction)


def _bounds(counts: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for count in counts:
        out.append((start, start + count))
        start += count
    return out


def _host_counts(counts) -> list[int]:
    """The counts as a list of ints (a host read when they are a tensor)."""
    return counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)


def _padded_output(pieces: list[torch.Tensor], rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """The per-expert results stacked, then zero rows up to `rows` (padding after the counted rows)."""
    out = torch.cat(pieces) if pieces else like.new_zeros(0, width)
    return torch.cat([out, out.new_zeros(rows - out.shape[0], width)]) if out.shape[0] < rows else out


def grouped_mm_reference(x_NI: torch.Tensor, w_LIO: torch.Tensor, counts) -> torch.Tensor:
    """The specification: one torch product per expert slice (padding rows: zeros)."""
    pieces = [x_NI[start:end] @ w_LIO[e] for e, (start, end) in enumerate(_bounds(_host_counts(counts)))]
    return _padded_output(pieces, x_NI.shape[0], w_LIO.shape[2], x_NI)


def grouped_mm_t_reference(a_NP: torch.Tensor, b_NQ: torch.Tensor, counts) -> torch.Tensor:
    """The specification: one torch product per expert slice, transposed on the left."""
    pieces = [a_NP[start:end].t() @ b_NQ[start:end] for start, end in _bounds(_host_counts(counts))]
    return torch.stack(pieces) if pieces else a_NP.new_zeros(0, a_NP.shape[1], b_NQ.shape[1])


@functools.cache
def _kernels():
    """The Triton kernels, built on first use so that CPU-only use never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, tile_expert_ptr, tile_row_ptr, tile_end_ptr, n_in, n_out,
                           stride_xn, stride_wl, stride_wi, stride_wo, stride_yn,
                           BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, UPCAST: tl.constexpr):
        # program (row tile, column tile); each row tile belongs to one expert (scheduled on the device);
        # spare tiles of the fixed grid have no rows (tile_end == tile_row) and store nothing
        tile = tl.program_id(0)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        rows = tl.load(tile_row_ptr + tile).to(tl.int64) + tl.arange(0, BLOCK_N)
        row_end = tl.load(tile_end_ptr + tile)
        cols = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
        acc = tl.zeros([BLOCK_N, BLOCK_O], dtype=tl.float32)
        for start in range(0, n_in, BLOCK_I):
            inner = start + tl.arange(0, BLOCK_I)
            x = tl.load(x_ptr + rows[:, None] * stride_xn + inner[None, :],
                        mask=(rows[:, None] < row_end) & (inner[None, :] < n_in), other=0.0)
            w = tl.load(w_ptr + expert * stride_wl + inner[:, None] * stride_wi + cols[None, :] * stride_wo,
                        mask=(inner[:, None] < n_in) & (cols[None, :] < n_out), other=0.0)
            if UPCAST:  # fp32 inputs (no TF32), and the interpreter, whose half-precision dot is unreliable
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:  # bf16 / fp16 on a GPU: tensor cores, fp32 accumulation
                acc = tl.dot(x, w, acc)
        tl.store(y_ptr + rows[:, None] * stride_yn + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < n_out))

    @triton.jit
    def _grouped_mm_t_kernel(a_ptr, b_ptr, out_ptr, row_start_ptr, row_end_ptr, n_p, n_q,
                             stride_an, stride_bn, stride_ol, stride_op,
                             BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
        # program (expert, P tile, Q tile): a reduction over the expert's rows, in a fixed order
        expert = tl.program_id(0).to(tl.int64)
        p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
        q = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_start = tl.load(row_start_ptr + expert)
        row_end = tl.load(row_end_ptr + expert)
        acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
        for start in range(row_start, row_end, BLOCK_N):
            rows = start + tl.arange(0, BLOCK_N)
            a = tl.load(a_ptr + rows[None, :] * stride_an + p[:, None],
                        mask=(rows[None, :] < row_end) & (p[:, None] < n_p), other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_bn + q[None, :],
                        mask=(rows[:, None] < row_end) & (q[None, :] < n_q), other=0.0)
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(out_ptr + expert * stride_ol + p[:, None] * stride_op + q[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(p[:, None] < n_p) & (q[None, :] < n_q))

    @triton.jit
    def _grouped_sum_kernel(x_ptr, offsets_ptr, partial_ptr, n_cols, stride_xn, chunks,
                            BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr):
        # program (expert, column block, chunk): the chunk-th of `chunks` equal runs of the expert's rows,
        # summed in fp32 in a fixed order into its own partial row (no atomics); the expert's rows end
        # at offsets[e] and start where the previous expert's end (0 for the first)
        expert = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(2)
        cols = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        row_end = tl.load(offsets_ptr + expert).to(tl.int64)
        per_chunk = tl.cdiv(row_end - row_start, chunks)
        first = row_start + chunk * per_chunk
        last = tl.minimum(first + per_chunk, row_end)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(first, last, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            x = tl.load(x_ptr + rows[:, None] * stride_xn + cols[None, :],
                        mask=(rows[:, None] < last) & (cols[None, :] < n_cols), other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
        tl.store(partial_ptr + (expert * chunks + chunk) * n_cols + cols, acc, mask=cols < n_cols)

    return _grouped_mm_kernel, _grouped_mm_t_kernel, _grouped_sum_kernel


def _forced() -> str:
    forced = os.environ.get("MOE_GROUPED_GEMM", "auto")
    if forced not in ("auto", "torch", "triton", "loop"):
        raise ValueError(f"MOE_GROUPED_GEMM must be auto, torch, triton or loop, got {forced!r}")
    return forced


def _constant_result(fn):
    """`torch.compiler.assume_constant_result(fn)` without importing Dynamo.

    That decorator imports torch._dynamo (a large share of `import moe`'s time) only to mark the
    function; the mark is set here (tests/test_packaging.py checks it is the one
    torch sets), so `import moe` costs what `import torch` costs.
    """
    fn._dynamo_marked_constant = True
    return fn


def _backend(t: torch.Tensor) -> str:
    """"torch" (torch._grouped_mm), "triton" or "loop"; MOE_GROUPED_GEMM forces one."""
    forced = _forced()
    if forced != "auto":
        return forced
    if _torch_grouped_mm_runs(t.device, t.dtype):
        return "torch"
    return "triton" if use_triton(t) else "loop"


@_constant_result  # torch.compile calls it outside the graph: a try/except cannot be traced
@functools.cache
def _torch_grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """torch's grouped GEMM is private and device-specific: one tiny trial of both forms."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(16, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offsets = torch.tensor([8, 16], device=device, dtype=torch.int32)
        for weight in (w, w.transpose(1, 2)):  # the layers pass both layouts (forward, input gradient)
            torch._grouped_mm(x, weight, offs=offsets)
        torch._grouped_mm(x.t(), x, offs=offsets)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def runs_natively(x_NI: torch.Tensor, w_LIO: torch.Tensor) -> bool:
    """Whether `grouped_mm(x_NI, w_LIO, ...)` runs torch's own grouped GEMM (not the loop of products)."""
    return _backend(x_NI) == "torch" and _torch_fits(x_NI, w_LIO)


def torch_backend_runs(device: torch.device, dtype: torch.dtype, widths) -> bool:
    """Whether `grouped_mm` on `device` in `dtype`, on rows of these widths, takes torch's own grouped GEMM."""
    forced = _forced()
    fits = _widths_fit(widths, dtype.itemsize)
    if forced != "auto":
        return forced == "torch" and fits
    return fits and _torch_grouped_mm_runs(device, dtype)


def _widths_fit(widths, itemsize: int) -> bool:
    """torch's grouped GEMM needs every row stride to be a multiple of 16 bytes."""
    return all(width * itemsize % 16 == 0 for width in widths)


def _torch_fits(*tensors: torch.Tensor) -> bool:
    return all(_widths_fit((t.shape[-1],), t.element_size()) for t in tensors)


def _upcast(t: torch.Tensor) -> bool:
    """Dot in fp32: for fp32 inputs, and in the interpreter (CPU tensors) for every dtype."""
    return t.dtype == torch.float32 or not t.is_cuda


def _device_counts(counts, device) -> torch.Tensor:
    """int64 counts on `device` (a host-to-device copy when given a list)."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int64)
    return torch.tensor(list(counts), dtype=torch.int64, device=device)


def group_offsets(counts_L: torch.Tensor) -> torch.Tensor:
    """The int32 running ends of the groups' rows (torch's grouped GEMM's `offs`) from int counts on
    the rows' device, for the `offsets` of grouped_mm, grouped_mm_t and grouped_sum."""
    return torch.cumsum(counts_L, 0, dtype=torch.int32)


def _given_or_made(offsets: torch.Tensor | None, counts, device: torch.device) -> torch.Tensor:
    return offsets if offsets is not None else group_offsets(_device_counts(counts, device))


def _tile_schedule(counts_L: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, row end) per row tile, computed on the device for a grid of fixed size.

    Expert e needs ceil(counts[e] / BLOCK) tiles, so ceil(N / BLOCK) + L tiles always suffice; tile t
    belongs to the expert whose cumulative tile count first exceeds t, and spare tiles get no rows.
    """
    L = counts_L.shape[0]
    num_tiles = -(-num_rows // BLOCK) + L
    tiles_L = (counts_L + BLOCK - 1) // BLOCK
    tile_end_L = torch.cumsum(tiles_L, 0)
    row_end_L = torch.cumsum(counts_L, 0)
    t_T = torch.arange(num_tiles, device=counts_L.device)
    expert_T = torch.searchsorted(tile_end_L, t_T, right=True).clamp(max=L - 1)
    used_T = t_T < tile_end_L[-1]
    row_T = row_end_L[expert_T] - counts_L[expert_T] + (t_T - (tile_end_L - tiles_L)[expert_T]) * BLOCK
    row_T = torch.where(used_T, row_T, 0)
    return expert_T, row_T, torch.where(used_T, row_end_L[expert_T], 0)


def grouped_mm(x_NI: torch.Tensor, w_LIO: torch.Tensor, counts, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows_e] = x[rows_e] @ w[e] for every expert e; not differentiable (used inside autograd functions).

    Args:
        x_NI: packed rows, shape [N, I]. w_LIO: shape [L, I, O] (any strides).
        counts: rows per expert, L ints summing to N, or an int tensor [L] on x's device summing to at
            most N (rows after them are padding).
        offsets: `group_offsets(counts)` when the caller has them (a layer's products share one set:
            two kernel launches fewer per product on a GPU); else computed here. Only torch's grouped
            GEMM takes them: the Triton kernel and the loop work from the counts.

    Returns:
        y_NO: shape [N, O], dtype of x_NI.
    """
    backend = _backend(x_NI)
    if backend == "torch" and _torch_fits(x_NI, w_LIO):
        return torch._grouped_mm(x_NI, w_LIO, offs=_given_or_made(offsets, counts, x_NI.device))
    if backend != "triton":
        return grouped_mm_reference(x_NI, w_LIO, counts)
    return _grouped_mm_triton(x_NI.contiguous(), w_LIO, _device_counts(counts, x_NI.device))


def _grouped_mm_launch(x_NI: torch.Tensor, w_LIO: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """Launch: the tile schedule on the device and a grid of fixed size (row tiles x column tiles)."""
    N, I = x_NI.shape
    L, O = w_LIO.shape[0], w_LIO.shape[2]
    y_NO = torch.empty(N, O, dtype=x_NI.dtype, device=x_NI.device)
    if L == 0 or O == 0 or N == 0:
        return y_NO
    tile_expert, tile_row, tile_end = _tile_schedule(counts_L, N)
    _kernels()[0][(tile_expert.shape[0], -(-O // BLOCK))](
        x_NI, w_LIO, y_NO, tile_expert, tile_row, tile_end, I, O, x_NI.stride(0), w_LIO.stride(0), w_LIO.stride(1),
        w_LIO.stride(2), y_NO.stride(0), BLOCK_N=BLOCK, BLOCK_O=BLOCK, BLOCK_I=BLOCK, UPCAST=_upcast(x_NI),
    )
    return y_NO


_grouped_mm_triton = launcher("exactmoe::grouped_mm", _grouped_mm_launch,
                              lambda x_NI, w_LIO, counts_L: x_NI.new_empty(x_NI.shape[0], w_LIO.shape[2]))


def grouped_mm_t(a_NP: torch.Tensor, b_NQ: torch.Tensor, counts, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """out[e] = a[rows_e]^T @ b[rows_e] for every expert e (zero for experts without rows).

    Args:
        a_NP: shape [N, P]. b_NQ: shape [N, Q].
        counts: rows per expert, L ints summing to N, or an int tensor [L] on a's device summing to at
            most N (padding rows after them are left out).
        offsets: `group_offsets(counts)`, or None (see grouped_mm).

    Returns:
        out_LPQ: shape [L, P, Q], dtype of a_NP.
    """
    backend = _backend(a_NP)
    if backend == "torch" and _torch_fits(a_NP, b_NQ):
        padding = -a_NP.shape[0] % 8  # the transposed operand's row stride must be a multiple of 8 rows
        if padding:  # zero rows after the counted ones, which the offsets leave out
            a_NP, b_NQ = (torch.cat([t, t.new_zeros(padding, t.shape[1])]) for t in (a_NP, b_NQ))
        offsets = _given_or_made(offsets, counts, a_NP.device)
        if torch.compiler.is_compiling():
            return _grouped_mm_t_torch(a_NP.contiguous(), b_NQ.contiguous(), offsets)
        return torch._grouped_mm(a_NP.t(), b_NQ, offs=offsets)
    if backend != "triton":
        return grouped_mm_t_reference(a_NP, b_NQ, counts)
    return _grouped_mm_t_triton(a_NP.contiguous(), b_NQ.contiguous(), _device_counts(counts, a_NP.device))


@torch.library.custom_op("exactmoe::grouped_mm_t_torch", mutates_args=())
def _grouped_mm_t_torch(a_NP: torch.Tensor, b_NQ: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM of a^T and b, opaque to torch.compile so that a reaches it transposed.

    Given `a_NP.t()` in a graph, Inductor may copy the transposed view into a fresh row-major [P, N]
    buffer; torch's CUDA kernel then requires every expert's rows to span a multiple of 16 bytes
    (row count x element size: 8 rows in bf16) and stops with a device-side assert (compiling the GPT
    recipe's bf16 MoE model).
    A custom op receives its inputs with the strides they had when traced (row-major [N, P]), so the
    transposed view is made here, as in eager mode, where no such alignment applies.
    """
    return torch._grouped_mm(a_NP.t(), b_NQ, offs=offsets_L)


@_grouped_mm_t_torch.register_fake
def _(a_NP, b_NQ, offsets_L):
    return a_NP.new_empty(offsets_L.shape[0], a_NP.shape[1], b_NQ.shape[1])


def _grouped_mm_t_launch(a_NP: torch.Tensor, b_NQ: torch.Tensor, counts_L: torch.Tensor) -> torch.Tensor:
    """Launch: one program per (expert, P tile, Q tile), row bounds read on the device."""
    P, Q, L = a_NP.shape[1], b_NQ.shape[1], counts_L.shape[0]
    out = torch.zeros(L, P, Q, dtype=a_NP.dtype, device=a_NP.device)
    if L == 0 or P == 0 or Q == 0:
        return out
    row_end = torch.cumsum(counts_L, 0)
    row_start = row_end - counts_L
    _kernels()[1][(L, -(-P // BLOCK), -(-Q // BLOCK))](
        a_NP, b_NQ, out, row_start, row_end, P, Q, a_NP.stride(0), b_NQ.stride(0), out.stride(0), out.stride(1),
        BLOCK_P=BLOCK, BLOCK_Q=BLOCK, BLOCK_N=BLOCK, UPCAST=_upcast(a_NP),
    )
    return out


_grouped_mm_t_triton = launcher(
    "exactmoe::grouped_mm_t", _grouped_mm_t_launch,
    lambda a_NP, b_NQ, counts_L: a_NP.new_empty(counts_L.shape[0], a_NP.shape[1], b_NQ.shape[1]))


def grouped_sum_reference(x_NM: torch.Tensor, counts) -> torch.Tensor:
    """The specification: each expert's rows summed by torch, in fp32 (float64 for float64)."""
    acc_dtype = torch.promote_types(x_NM.dtype, torch.float32)
    pieces = [x_NM[start:end].to(acc_dtype).sum(0) for start, end in _bounds(_host_counts(counts))]
    return torch.stack(pieces) if pieces else x_NM.new_zeros(0, x_NM.shape[1], dtype=acc_dtype)


def grouped_sum(x_NM: torch.Tensor, counts, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """out[e] = the sum of expert e's rows, accumulated in fp32 (float64 for float64); zero for experts
    without rows. Deterministic: a fixed summation order, no atomics.

    The Triton kernel runs where `kernels.backend.use_triton` says (CUDA tensors; MOE_KERNELS=triton
    forces it, on the CPU in the interpreter), reading the offsets on the device; elsewhere torch's
    segment_reduce, to which padding rows are one more segment that is cut off. (MOE_GROUPED_GEMM
    chooses the products' backend, not this one.) On a GPU the kernel replaces segment_reduce, which
    can take longer than the layer's grouped GEMMs together.

    Args:
        x_NM: packed rows, shape [N, M].
        counts: rows per expert, L ints summing to N, or an int tensor [L] on x's device summing to at
            most N (padding rows after them are left out).
        offsets: `group_offsets(counts)`, or None (see grouped_mm).

    Returns:
        out_LM: shape [L, M], fp32 (float64 for float64 rows).
    """
    if use_triton(x_NM):
        return _grouped_sum_triton(x_NM.contiguous(), _given_or_made(offsets, counts, x_NM.device))
    counts_L = _device_counts(counts, x_NM.device)
    acc_dtype = torch.promote_types(x_NM.dtype, torch.float32)
    L = counts_L.shape[0]
    lengths = torch.cat([counts_L, (x_NM.shape[0] - counts_L.sum()).reshape(1)])
    return torch.segment_reduce(x_NM.to(acc_dtype), "sum", lengths=lengths, unsafe=True).narrow(0, 0, L)


_SUM_BLOCK_R, _SUM_BLOCK_M = 32, 128  # rows and columns of one tile of the grouped sum
_SUM_PROGRAMS = 1024  # programs the grouped sum's grid aims for: experts x column blocks x chunks


def _grouped_sum_launch(x_NM: torch.Tensor, offsets_L: torch.Tensor) -> torch.Tensor:
    """Launch: each expert's rows cut into chunks (as many as fill the grid, from the shape alone), each
    chunk summed by one program per column block, then the chunks' partial sums added by torch."""
    M, L = x_NM.shape[1], offsets_L.shape[0]
    if L == 0 or M == 0:
        return torch.zeros(L, M, dtype=torch.float32, device=x_NM.device)
    column_blocks = -(-M // _SUM_BLOCK_M)
    chunks = max(1, min(64, _SUM_PROGRAMS // (L * column_blocks)))
    partial = torch.empty(L, chunks, M, dtype=torch.float32, device=x_NM.device)
    _kernels()[2][(L, column_blocks, chunks)](
        x_NM, offsets_L, partial, M, x_NM.stride(0), chunks, BLOCK_R=_SUM_BLOCK_R, BLOCK_M=_SUM_BLOCK_M,
    )
    return partial.sum(1)


_grouped_sum_triton = launcher(
    "exactmoe::grouped_sum", _grouped_sum_launch,
    lambda x_NM, offsets_L: x_NM.new_empty(offsets_L.shape[0], x_NM.shape[1], dtype=torch.float32))
