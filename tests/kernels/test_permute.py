"""permute against its torch reference: forward and gradient, empty buffer rows, and bad shapes.

Index layouts (tests/kernels/layouts.py) cover no tokens, one token, K = 1..3, dropped choices,
empty buffer rows (padded layout) and non-power-of-two widths. Every test runs on the torch path and
on the Triton kernel (interpreted on CPU, compiled on CUDA). Tolerance: fp32 1e-5.
"""

import pytest
import torch

from kernels import permute, permute_reference, unpermute_combine
from tests.devices import DEVICE
from tests.kernels.layouts import CASES, row_layout

FP32 = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("S,K,M,E,C,drop,packed", CASES)
def test_permute_matches_reference_forward_and_backward(S, K, M, E, C, drop, packed, kernel_backend):
    row_SK, num_rows = row_layout(S, K, E, C, drop, seed=S + K, packed=packed)
    x = torch.randn(S, M, requires_grad=True, device=DEVICE)
    x_ref = x.detach().clone().requires_grad_()
    out = permute(x, row_SK, num_rows)
    ref = permute_reference(x_ref, row_SK, num_rows)
    torch.testing.assert_close(out, ref, **FP32)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, **FP32)


@pytest.mark.slow
def test_compiled_permute_has_the_eager_gradient():
    """Under torch.compile the op's output is made out of place: torch 2.11's dynamo gives an
    autograd.Function's output that was written in place (out=, masked_fill_) a zero gradient."""
    import torch._dynamo

    row_SK, num_rows = row_layout(9, 2, 4, 3, 0.2, seed=5, packed=False)
    x = torch.randn(9, 6, device=DEVICE)
    grads = []
    for step in (lambda x: permute(x, row_SK, num_rows), torch.compile(lambda x: permute(x, row_SK, num_rows),
                                                                      backend="eager", fullgraph=True)):
        leaf = x.clone().requires_grad_()
        step(leaf).square().sum().backward()
        grads.append(leaf.grad)
    torch._dynamo.reset()
    assert bool(grads[0].abs().sum() > 0)
    torch.testing.assert_close(grads[1], grads[0], **FP32)


def test_empty_rows_are_zero_and_results_deterministic(kernel_backend):
    row_SK, num_rows = row_layout(10, 2, 4, 6, 0.0, seed=2, packed=False)
    x = torch.randn(10, 12, device=DEVICE)
    buffer = permute(x, row_SK, num_rows)
    empty = torch.ones(num_rows, dtype=torch.bool)
    empty[row_SK[row_SK >= 0]] = False
    assert bool((buffer[empty] == 0).all())
    weight = torch.rand(10, 2, device=DEVICE)
    assert torch.equal(unpermute_combine(buffer, row_SK, weight), unpermute_combine(buffer, row_SK, weight))


def test_bad_shapes_fail_with_the_shape():
    with pytest.raises(ValueError, match=r"row_SK must have shape \[4, K\], got \[3, 2\]"):
        permute(torch.randn(4, 8, device=DEVICE), torch.zeros(3, 2, dtype=torch.long, device=DEVICE), 6)
    with pytest.raises(TypeError, match="row_SK must be int64"):
        permute(torch.randn(4, 8, device=DEVICE), torch.zeros(4, 2, dtype=torch.int32, device=DEVICE), 6)
    with pytest.raises(ValueError, match=r"weight_SK must have shape \[4, 2\], got \[4, 3\]"):
        unpermute_combine(torch.randn(6, 8, device=DEVICE), torch.zeros(4, 2, dtype=torch.long, device=DEVICE), torch.rand(4, 3, device=DEVICE))

