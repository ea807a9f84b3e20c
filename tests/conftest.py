"""Test settings: the Triton interpreter on machines without CUDA, and deterministic fp32 products."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # must be set before triton is first imported: kernels then run in the interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(params=["torch", "triton"])
def kernel_backend(request, monkeypatch):
    """Run a test once on the torch path and once on the Triton kernels (interpreted on CPU)."""
    monkeypatch.setenv("MOE_KERNELS", request.param)
    return request.param
