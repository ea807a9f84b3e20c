"""Grouped GEMM backends (torch's, Triton interpreted on CPU, loop) against the per-slice reference."""

import pytest
import torch

from kernels.grouped_gemm import (
    _torch_grouped_mm_runs, grouped_mm, grouped_mm_reference, grouped_mm_t, grouped_mm_t_reference,
)
from tests.devices import DEVICE

FP32 = {"rtol": 1e-4, "atol": 1e-4}


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
