"""unpermute_combine against its torch reference: forward, every gradient, gradcheck, half precision.

Index layouts (tests/kernels/layouts.py) cover no tokens, one token, K = 1..3, dropped choices,
empty buffer rows (padded layout) and non-power-of-two widths. Every test runs on the torch path and
on the Triton kernel (interpreted on CPU, compiled on CUDA); the gradcheck and half-precision tests
run permute beside it. Tolerances: fp32 1e-5; bf16 and fp16 against the fp32 reference cast to the
dtype, 1e-2.
"""

import pytest
import torch

from kernels import permute, permute_reference, unpermute_combine, unpermute_combine_reference
from tests.devices import DEVICE
from tests.kernels.layouts import CASES, row_layout

FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 1e-2, "atol": 1e-2}


@pytest.mark.parametrize("S,K,M,E,C,drop,packed", CASES)
def test_unpermute_combine_matches_reference_forward_and_backward(S, K, M, E, C, drop, packed, kernel_backend):
    row_SK, num_rows = row_layout(S, K, E, C, drop, seed=S * 3 + K, packed=packed)
    buffer = torch.randn(num_rows, M, requires_grad=True, device=DEVICE)
    weight = torch.rand(S, K, requires_grad=True, device=DEVICE)
    buffer_ref = buffer.detach().clone().requires_grad_()
    weight_ref = weight.detach().clone().requires_grad_()
    out = unpermute_combine(buffer, row_SK, weight)
    ref = unpermute_combine_reference(buffer_ref, row_SK, weight_ref)
    torch.testing.assert_close(out, ref, **FP32)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(buffer.grad, buffer_ref.grad, **FP32)
    torch.testing.assert_close(weight.grad, weight_ref.grad, **FP32)
    if S:
        assert bool((weight.grad[row_SK < 0] == 0).all()), "dropped choices get no weight gradient"


def test_references_and_ops_pass_gradcheck_in_float64(kernel_backend):
    row_SK, num_rows = row_layout(6, 2, 3, 3, 0.25, seed=7, packed=False)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True, device=DEVICE)
    buffer = torch.randn(num_rows, 5, dtype=torch.float64, requires_grad=True, device=DEVICE)
    weight = torch.rand(6, 2, dtype=torch.float64, requires_grad=True, device=DEVICE)
    for fn in (permute, permute_reference):
        assert torch.autograd.gradcheck(lambda t: fn(t, row_SK, num_rows), (x,))
    for fn in (unpermute_combine, unpermute_combine_reference):
        assert torch.autograd.gradcheck(lambda b, w: fn(b, row_SK, w), (buffer, weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_in_fp32(dtype, kernel_backend):
    row_SK, num_rows = row_layout(24, 2, 4, 8, 0.1, seed=1, packed=False)
    buffer = torch.randn(num_rows, 40, device=DEVICE)
    weight = torch.rand(24, 2, device=DEVICE)
    out = unpermute_combine(buffer.to(dtype), row_SK, weight)
    assert out.dtype == dtype
    expected = unpermute_combine_reference(buffer.to(dtype).float(), row_SK, weight).to(dtype)
    torch.testing.assert_close(out, expected, **BF16)
    x = torch.randn(24, 40, device=DEVICE)
    torch.testing.assert_close(permute(x.to(dtype), row_SK, num_rows), permute_reference(x, row_SK, num_rows).to(dtype), **BF16)
    buffer_h = buffer.to(dtype).requires_grad_()
    weight_h = weight.clone().requires_grad_()
    grad = torch.randn(24, 40, device=DEVICE)
    unpermute_combine(buffer_h, row_SK, weight_h).backward(grad.to(dtype))
    buffer_f = buffer.to(dtype).float().requires_grad_()
    weight_f = weight.clone().requires_grad_()
    unpermute_combine_reference(buffer_f, row_SK, weight_f).backward(grad.to(dtype).float())
    torch.testing.assert_close(buffer_h.grad.float(), buffer_f.grad, **BF16)
    torch.testing.assert_close(weight_h.grad, weight_f.grad, **BF16)

