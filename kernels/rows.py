"""Row primitives shared by permute and unpermute_combine: gather rows, combine rows, row dots.

The two dispatch ops are duals. permute gathers token rows into the expert-sorted buffer and its
backward combines buffer rows back to tokens with unit weights; unpermute_combine combines buffer rows
to tokens with the gate's weights and its backward gathers token rows into the buffer, scaled by the
weights, plus one row dot product per choice. Every primitive here is a gather with a fixed summation
order: no atomics, deterministic.

Shape legend: S tokens, K choices per token, M model dim, N rows of the dispatch buffer. `row_SK` is
the buffer row per (token, choice), -1 where the choice was dropped. On CUDA each primitive is a Triton
kernel behind a torch custom op (fake and meta tensors and torch.compile see a shape-only
implementation); elsewhere torch index ops into the CPU workspace (see kernels.backend to force either).
"""

import functools

import torch
import torch.nn.functional as F

from kernels import cpu
from kernels.backend import block_size, cpu_eager, launcher, use_triton


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types; fp32 and float64 stay as they are."""
    return torch.promote_types(dtype, torch.float32)


def scatter_kept(row_SK: torch.Tensor, values_P: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """out[row_SK[p]] = values_P[p] for kept choices, `fill` elsewhere; shape [N].

    Dropped choices write to a spare row N that is cut off: a scatter of fixed size, where boolean
    indexing would sync with the host to learn how many choices were kept.
    """
    rows_P = row_SK.reshape(-1)
    out = torch.full((num_rows + 1,), fill, dtype=values_P.dtype, device=row_SK.device)
    return out.scatter_(0, torch.where(rows_P >= 0, rows_P, num_rows), values_P).narrow(0, 0, num_rows)


def source_tokens(row_SK: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse map: the token each buffer row comes from, -1 for empty rows; shape [N]."""
    S, K = row_SK.shape
    if cpu_eager(row_SK) and K:
        token_P = _bags(S, K)[1]  # made once per shape: no integer division per choice and step
    else:
        token_P = torch.arange(row_SK.numel(), device=row_SK.device) // max(K, 1)
    return scatter_kept(row_SK, token_P, num_rows, -1)


@functools.cache
def _kernels():
    """The Triton kernels, built on first use so that CPU-only use never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows_kernel(x_ptr, token_ptr, scale_ptr, out_ptr, n_cols, stride_xm, stride_om,
                           HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr):
        # one program per (buffer row, block of columns): a gather, so no two programs write one place
        row = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = offsets < n_cols
        token = tl.load(token_ptr + row)
        keep = token >= 0
        source = tl.where(keep, token, 0)
        values = tl.load(x_ptr + source * stride_xm + offsets, mask=mask, other=0.0).to(tl.float32)
        values = tl.where(keep, values, 0.0)  # empty rows read token 0 (so S > 0) and write zeros
        if HAS_SCALE:
            values = values * tl.load(scale_ptr + row).to(tl.float32)
        tl.store(out_ptr + row * stride_om + offsets, values.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def combine_rows_kernel(buffer_ptr, row_ptr, weight_ptr, out_ptr, n_cols, K, stride_bm, stride_om,
                            BLOCK_M: tl.constexpr):
        # one program per (token, block of columns); choices summed in a fixed order, in fp32
        token = tl.program_id(0).to(tl.int64)
        offsets = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = offsets < n_cols
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in range(K):
            row = tl.load(row_ptr + token * K + j)
            keep = row >= 0
            weight = tl.where(keep, tl.load(weight_ptr + token * K + j).to(tl.float32), 0.0)
            values = tl.load(buffer_ptr + tl.where(keep, row, 0) * stride_bm + offsets, mask=mask, other=0.0)
            acc += tl.where(keep, weight * values.to(tl.float32), 0.0)  # a dropped choice adds nothing, not 0 * nan
        tl.store(out_ptr + token * stride_om + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def row_dots_kernel(grad_ptr, buffer_ptr, row_ptr, out_ptr, n_cols, K, stride_gm, stride_bm,
                        BLOCK_M: tl.constexpr):
        # one program per (token, choice): <grad_out[token], buffer[row]> in fp32, 0 when dropped
        choice = tl.program_id(0).to(tl.int64)
        token = choice // K
        row = tl.load(row_ptr + choice)
        keep = row >= 0
        source = tl.where(keep, row, 0)
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_M):
            offsets = start + tl.arange(0, BLOCK_M)
            mask = offsets < n_cols
            g = tl.load(grad_ptr + token * stride_gm + offsets, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(buffer_ptr + source * stride_bm + offsets, mask=mask, other=0.0).to(tl.float32)
            acc += tl.where(keep, g * b, 0.0)
        tl.store(out_ptr + choice, tl.sum(acc, axis=0))

    return gather_rows_kernel, combine_rows_kernel, row_dots_kernel


def _gather_rows_launch(x_SM: torch.Tensor, token_N: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """Launch: checks, output allocation and the grid (rows x column blocks)."""
    assert x_SM.stride(1) == 1 and token_N.is_contiguous()
    num_rows, n_cols = token_N.shape[0], x_SM.shape[1]
    out_NM = torch.empty(num_rows, n_cols, dtype=x_SM.dtype, device=x_SM.device)
    if num_rows == 0 or n_cols == 0:
        return out_NM
    if x_SM.shape[0] == 0:
        return out_NM.zero_()
    BLOCK_M = block_size(n_cols)
    grid = (num_rows, -(-n_cols // BLOCK_M))
    scale = scale_N.contiguous() if scale_N is not None else token_N
    _kernels()[0][grid](x_SM, token_N, scale, out_NM, n_cols, x_SM.stride(0), out_NM.stride(0),
                        HAS_SCALE=scale_N is not None, BLOCK_M=BLOCK_M)
    return out_NM


gather_rows_triton = launcher("exactmoe::gather_rows", _gather_rows_launch,
                              lambda x_SM, token_N, scale_N: x_SM.new_empty(token_N.shape[0], x_SM.shape[1]))


def _combine_rows_launch(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor) -> torch.Tensor:
    """Launch: output allocation and the grid (tokens x column blocks)."""
    S, K = row_SK.shape
    n_cols = buffer_NM.shape[1]
    out_SM = torch.empty(S, n_cols, dtype=buffer_NM.dtype, device=buffer_NM.device)
    if S == 0 or n_cols == 0:
        return out_SM
    if K == 0 or buffer_NM.shape[0] == 0:  # nothing to gather (and no row 0 to read)
        return out_SM.zero_()
    BLOCK_M = block_size(n_cols)
    _kernels()[1][(S, -(-n_cols // BLOCK_M))](
        buffer_NM, row_SK.contiguous(), weight_SK.contiguous(), out_SM, n_cols, K, buffer_NM.stride(0),
        out_SM.stride(0), BLOCK_M=BLOCK_M,
    )
    return out_SM


combine_rows_triton = launcher(
    "exactmoe::combine_rows", _combine_rows_launch,
    lambda buffer_NM, row_SK, weight_SK: buffer_NM.new_empty(row_SK.shape[0], buffer_NM.shape[1]))


def _row_dots_launch(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor) -> torch.Tensor:
    """Launch: one program per (token, choice)."""
    S, K = row_SK.shape
    dots_SK = torch.zeros(S, K, dtype=torch.float32, device=buffer_NM.device)
    if S * K == 0 or buffer_NM.shape[0] == 0:
        return dots_SK
    n_cols = buffer_NM.shape[1]
    _kernels()[2][(S * K,)](
        grad_SM, buffer_NM, row_SK.contiguous(), dots_SK, n_cols, K, grad_SM.stride(0), buffer_NM.stride(0),
        BLOCK_M=block_size(n_cols),
    )
    return dots_SK


row_dots_triton = launcher("exactmoe::row_dots", _row_dots_launch,
                           lambda grad_SM, buffer_NM, row_SK: grad_SM.new_empty(row_SK.shape, dtype=torch.float32))


def gather_rows(x_SM: torch.Tensor, token_N: torch.Tensor, scale_N: torch.Tensor | None) -> torch.Tensor:
    """buffer[n] = scale[n] * x[token[n]], zero where token[n] == -1 (Triton or torch)."""
    x_SM = x_SM.contiguous()
    if use_triton(x_SM):
        return gather_rows_triton(x_SM, token_N, scale_N)
    if x_SM.shape[0] == 0:
        return cpu.empty((token_N.shape[0], x_SM.shape[1]), x_SM.dtype, x_SM.device).zero_()
    if torch.compiler.is_compiling():
        # out of place, rows no choice points at masked to zero (no host sync): torch 2.11's dynamo loses
        # the gradient of an autograd.Function's output that was written in place (out=, masked_fill_)
        buffer_NM = x_SM.index_select(0, token_N.clamp(min=0))
        if scale_N is not None:
            buffer_NM = buffer_NM * scale_N.to(buffer_NM.dtype).unsqueeze(1)
        return buffer_NM.masked_fill((token_N < 0).unsqueeze(1), 0)
    # eager on the CPU a host read costs nothing: when every row has a token (the packed layout's rows
    # always do), the gather needs no clamped index and leaves no empty rows to zero
    full = cpu_eager(token_N) and (token_N.numel() == 0 or int(token_N.min()) >= 0)
    num_rows, width = token_N.shape[0], x_SM.shape[1]
    if (full and scale_N is not None and x_SM.dtype == accumulation_dtype(x_SM.dtype) and num_rows and width
            and cpu.allocator_reuses(num_rows * width * x_SM.element_size())):
        # scaled (fp32, float64): bags of one row with per-sample weights, one pass over the rows where a
        # gather and a scaling pass took two (the combine's backward); the same products, a negative zero aside (a bag's sum starts from +0). The bag allocates its
        # own output: only where the allocator reuses memory (larger ones stay in the workspace)
        return F.embedding_bag(token_N, x_SM, _range(num_rows), per_sample_weights=scale_N.to(x_SM.dtype), mode="sum")
    out = cpu.empty((num_rows, width), x_SM.dtype, x_SM.device)
    buffer_NM = torch.index_select(x_SM, 0, token_N if full else token_N.clamp(min=0), out=out)
    if scale_N is not None:
        buffer_NM.mul_(scale_N.to(buffer_NM.dtype).unsqueeze(1))
    if full:
        return buffer_NM
    if buffer_NM.device.type != "cpu":  # rows no choice points at are zero: a mask, no host sync
        return buffer_NM.masked_fill_((token_N < 0).unsqueeze(1), 0)
    empty_N = (token_N < 0).nonzero().squeeze(1)  # eager on the CPU a host read costs nothing and skips a pass
    if empty_N.numel():
        buffer_NM.index_fill_(0, empty_N, 0)
    return buffer_NM


def combine_rows(buffer_NM: torch.Tensor, row_SK: torch.Tensor, weight_SK: torch.Tensor | None) -> torch.Tensor:
    """out[s] = sum_j w[s, j] * buffer[row[s, j]], fp32 accumulation (Triton, torch's embedding_bag, or
    one gather per choice). weight_SK None: unit weights (permute's backward).

    On the CPU in fp32 and float64 the weighted sum is one embedding_bag call (bags of K rows with
    per-choice weights, a dropped choice weighted 0): in fp32 the same bits as the gathers per
    choice (in float64 within an ulp: its products round differently), in one pass over the rows.
    """
    buffer_NM = buffer_NM.contiguous()
    if use_triton(buffer_NM):
        if weight_SK is None:
            weight_SK = torch.ones(row_SK.shape, dtype=torch.float32, device=row_SK.device)
        return combine_rows_triton(buffer_NM, row_SK, weight_SK)
    S, K = row_SK.shape
    acc_dtype = accumulation_dtype(buffer_NM.dtype)
    if K == 0:
        return buffer_NM.new_zeros(S, buffer_NM.shape[1])
    kept_SK = row_SK >= 0
    rows_SK = row_SK.clamp(min=0)
    # a dropped choice weighted 0 (unit weights: the mask itself)
    w_SK = (kept_SK if weight_SK is None else torch.where(kept_SK, weight_SK, 0.0)).to(acc_dtype)
    if cpu_eager(buffer_NM) and buffer_NM.dtype == acc_dtype and buffer_NM.shape[0]:
        # (compiled, the gathers below trace with symbolic row counts); bags of K: the offsets made once per shape
        return F.embedding_bag(rows_SK.reshape(-1), buffer_NM, _bags(S, K)[0], per_sample_weights=w_SK.reshape(-1),
                               mode="sum")
    # half precision (or off the CPU): fp32 sums over chunks of tokens, so on the CPU each widened copy of
    # gathered rows stays small (mixed-dtype ops would widen an operand into a fresh [S, M] temporary,
    # page-faulted in every step)
    out_SM = cpu.empty((S, buffer_NM.shape[1]), buffer_NM.dtype, buffer_NM.device)
    for part in _row_chunks(buffer_NM, S):
        rows_CK, w_CK = rows_SK[part], w_SK[part]
        acc_CM = buffer_NM.index_select(0, rows_CK[:, 0]).to(acc_dtype).mul_(w_CK[:, :1])
        for j in range(1, K):
            acc_CM.addcmul_(buffer_NM.index_select(0, rows_CK[:, j]).to(acc_dtype), w_CK[:, j : j + 1])
        out_SM[part].copy_(acc_CM)
    return out_SM


def fused_dots(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor) -> bool:
    """Whether `row_dots` takes its fused CPU pass (`_bag_dots`), which needs no gathered `g_NM`."""
    return (cpu_eager(buffer_NM) and buffer_NM.dtype == accumulation_dtype(buffer_NM.dtype) == grad_SM.dtype
            and buffer_NM.shape[0] > 0 and row_SK.shape[1] > 0)


def row_dots(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor, g_NM: torch.Tensor | None = None):
    """<grad_out[s], buffer[row(s, j)]> in fp32 per (token, choice), 0 for dropped choices; shape [S, K].

    On the CPU in fp32 and float64 one fused pass (`_bag_dots`). In half precision `g_NM` may give
    grad_out already gathered into buffer order (the buffer gradient's gather); the dots are then
    products into an [N, M] workspace buffer and a sum along rows.
    """
    if use_triton(buffer_NM):
        return row_dots_triton(grad_SM, buffer_NM, row_SK)
    num_rows = buffer_NM.shape[0]
    acc_dtype = accumulation_dtype(buffer_NM.dtype)
    if fused_dots(grad_SM, buffer_NM, row_SK):
        return _bag_dots(grad_SM, buffer_NM, row_SK)
    if g_NM is None:
        g_NM = gather_rows(grad_SM, source_tokens(row_SK, num_rows), None)
    # products into the workspace, then a sum along rows: faster than a batched [1, M] x [M, 1] product
    products_NM = cpu.empty(g_NM.shape, acc_dtype, g_NM.device)
    if g_NM.dtype == acc_dtype:
        torch.mul(g_NM, buffer_NM, out=products_NM)
    else:  # widened a chunk of rows at a time: a whole fp32 copy of [N, M] would be fresh memory every step
        for part in _row_chunks(g_NM, num_rows):
            torch.mul(g_NM[part].to(acc_dtype), buffer_NM[part].to(acc_dtype), out=products_NM[part])
    dots_N = products_NM.sum(1)
    dots_N1 = torch.cat([dots_N, dots_N.new_zeros(1)])  # row N: the dropped choices' zero
    return dots_N1[torch.where(row_SK >= 0, row_SK, num_rows)]


@functools.lru_cache(maxsize=8)
def _bags(S: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU embedding bags of K >= 1 choices per token: each bag's first sample, and each sample's bag.

    Kept across calls and only ever read, so made as plain CPU tensors whatever the first caller runs
    under (a default device or device context, inference mode)."""
    with torch.inference_mode(False):
        return (torch.arange(0, S * K, K, device="cpu"),
                torch.arange(S, device="cpu").repeat_interleave(K))


_ranges = [torch.empty(0, dtype=torch.int64, device="cpu")]


def _range(n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 on the CPU (one-row bags' offsets): a view of one kept range, made anew (a plain
    CPU tensor, as `_bags`) only when a longer one is asked for, to the next power of two: the packed
    layout's row count changes from step to step with the dropped choices."""
    if _ranges[0].numel() < n:
        with torch.inference_mode(False):
            _ranges[0] = torch.arange(1 << (n - 1).bit_length(), device="cpu")
    return _ranges[0][:n]


def _bag_dots(grad_SM: torch.Tensor, buffer_NM: torch.Tensor, row_SK: torch.Tensor) -> torch.Tensor:
    """row_dots on the CPU in fp32 and float64: the per-sample-weight gradient of an embedding bag (bag s
    is token s, its samples the buffer rows of its choices), one BLAS dot per choice in one pass.

    The products-then-sum form writes and reads back an [N, M] temporary, which this avoids. The same
    dots summed in another order.
    """
    S, K = row_SK.shape
    kept_SK = row_SK >= 0
    offsets_S, bag_P = _bags(S, K)
    dots_P = torch.ops.aten._embedding_bag_per_sample_weights_backward(
        grad_SM.contiguous(), buffer_NM.contiguous(), torch.where(kept_SK, row_SK, 0).reshape(-1), offsets_S, bag_P,
        0, -1)  # mode sum, no padding index: a dropped choice's dot (with row 0) is zeroed below
    return torch.where(kept_SK, dots_P.view(S, K), 0.0)


_CHUNK_ELEMENTS = 1 << 18  # fp32 elements per chunk of widened rows: 1 MiB


def _row_chunks(t: torch.Tensor, n_rows: int) -> list[slice]:
    """Rows [0, n_rows) of a computation on `t`'s device in chunks of about 1 MiB of fp32 (CPU, eager),
    else in one piece (a GPU wants few large ops; a compiled graph, no loop over a symbolic size).

    On the CPU half-precision rows are widened a chunk at a time into reused memory: widened whole, they
    would fault in fresh pages every step.
    """
    if t.device.type != "cpu" or torch.compiler.is_compiling():
        return [slice(0, n_rows)]
    step = max(1, _CHUNK_ELEMENTS // max(t.shape[1], 1))
    return [slice(start, min(start + step, n_rows)) for start in range(0, n_rows, step)]
