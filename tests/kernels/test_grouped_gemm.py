"""Grouped GEMM backends (torch's, Triton interpreted on CPU, loop) against the per-slice reference."""

import pytest
import torch

from kernels.grouped_gemm import (
    _torch_grouped_mm_runs, grouped_mm, grouped_mm_reference, grouped_mm_t, grouped_mm_t_reference, grouped_sum,
    grouped_sum_reference,
)
from tests.devices import DEVICE

FP32 = {"rtol": 1e-4, "atol": 1e-4}
SUMS = {"rtol": 1e-5, "atol": 1e-4}  # fp32 sums of up to 300 rows, in another order than the reference's
BF16_OUT = {"rtol": 2e-2, "atol": 5e-2}  # products accumulated in fp32, rounded to bf16 (2^-8 of sums ~5)


@pytest.fixture(params=["torch", "triton", "loop"])
def gemm_backend(request, monkeypatch):
    if request.param == "torch" and not _torch_grouped_mm_runs(DEVICE, torch.float32):
        pytest.skip("torch's grouped GEMM does not run for fp32 on this device")  # e.g. some GPUs: bf16 only
    monkeypatch.setenv("MOE_GROUPED_GEMM", request.param)
    monkeypatch.setenv("MOE_KERNELS", "triton" if request.param == "triton" else "auto")
    return request.param


@pytest.mark.parametrize("counts,I,O", [([5, 0, 40, 3], 24, 40), ([8, 8], 16, 16), ([0, 0, 1], 7, 5), ([33], 33, 17)])
def test_grouped_mm_matches_reference(counts, I, O, gemm_backend):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), I, device=DEVICE)
    w = torch.randn(len(counts), O, I, device=DEVICE).transpose(1, 2)  # stacked Linear weights, as the experts pass them
    torch.testing.assert_close(grouped_mm(x, w, counts), grouped_mm_reference(x, w, counts), **FP32)


@pytest.mark.parametrize("counts,P,Q", [([5, 0, 40, 3], 24, 40), ([8, 8], 16, 16), ([0, 2, 1], 7, 5)])
def test_grouped_mm_t_matches_reference_with_empty_experts(counts, P, Q, gemm_backend):
    torch.manual_seed(1)
    a, b = torch.randn(sum(counts), P, device=DEVICE), torch.randn(sum(counts), Q, device=DEVICE)
    out = grouped_mm_t(a, b, counts)
    torch.testing.assert_close(out, grouped_mm_t_reference(a, b, counts), **FP32)
    for e, count in enumerate(counts):
        if count == 0:
            assert bool((out[e] == 0).all())


def test_bf16_accumulates_in_fp32(monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_GEMM", "triton")
    monkeypatch.setenv("MOE_KERNELS", "triton")
    torch.manual_seed(2)
    counts = [20, 12]
    x, w = torch.randn(32, 48, device=DEVICE), torch.randn(2, 48, 16, device=DEVICE)
    out = grouped_mm(x.bfloat16(), w.bfloat16(), counts)
    expected = grouped_mm_reference(x.bfloat16().float(), w.bfloat16().float(), counts).bfloat16()
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


@pytest.fixture(params=["triton", "torch"])
def sum_backend(request, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", request.param)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("counts,M", [([5, 0, 40, 3], 24), ([8, 8], 16), ([0, 0, 1], 7), ([300], 130), ([0, 0], 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_sum_matches_reference_and_leaves_padding_rows_out(counts, M, dtype, sum_backend):
    torch.manual_seed(3)
    counts_L = torch.tensor(counts, device=DEVICE)
    x = torch.randn(sum(counts) + 11, M, device=DEVICE).to(dtype)  # 11 padding rows after the counted ones
    x[sum(counts):] = float("nan")  # never read: NaN would reach any sum that took them
    out = grouped_sum(x, counts_L)
    assert out.dtype == torch.float32 and out.shape == (len(counts), M)
    torch.testing.assert_close(out, grouped_sum_reference(x[:sum(counts)], counts), **SUMS)
    for e, count in enumerate(counts):
        if count == 0:
            assert bool((out[e] == 0).all())
    assert torch.equal(out, grouped_sum(x, counts_L))  # a fixed summation order: the same bits every call


def test_grouped_sum_keeps_float64_and_takes_list_counts():
    torch.manual_seed(4)
    x = torch.randn(12, 5, dtype=torch.float64, device=DEVICE)
    out = grouped_sum(x, [4, 0, 8])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.stack([x[:4].sum(0), x.new_zeros(5), x[4:].sum(0)]), rtol=0, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_weight_gradient_reaches_torchs_kernel_through_the_opaque_op(dtype, monkeypatch):
    """Compiled, a^T goes to torch's grouped GEMM inside a custom op (Inductor would otherwise copy the
    transposed view row-major, and CUDA then needs expert row counts spanning multiples of 16 bytes:
    on a GPU, the bf16 case's counts 5 and 29 stopped with a device-side assert); same numbers."""
    if not _torch_grouped_mm_runs(DEVICE, dtype):
        pytest.skip(f"torch's grouped GEMM does not run for {dtype} on this device")
    monkeypatch.setenv("MOE_GROUPED_GEMM", "torch")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def weight_gradient(a, b, counts):  # a^T of a fresh pointwise result, counts not multiples of 8
        return grouped_mm_t(torch.nn.functional.gelu(a), b * 2, counts)

    torch.manual_seed(5)
    a, b = (torch.randn(37, width, device=DEVICE).to(dtype) for width in (16, 8))
    counts = torch.tensor([5, 0, 29, 3], device=DEVICE)
    torch._dynamo.reset()
    out = torch.compile(weight_gradient, backend=backend, fullgraph=True)(a, b, counts)
    assert any("exactmoe.grouped_mm_t_torch" in graph for graph in graphs)
    # the pointwise ops in the dtype, the products of their results in fp32
    expected = grouped_mm_t_reference(torch.nn.functional.gelu(a).float(), (b * 2).float(), counts.tolist())
    tolerance = FP32 if dtype == torch.float32 else BF16_OUT
    torch.testing.assert_close(out.float(), expected, **tolerance)
    compiled = torch.compile(weight_gradient, fullgraph=True)(a, b, counts)  # Inductor, as a user compiles
    torch.testing.assert_close(compiled.float(), expected, **tolerance)
