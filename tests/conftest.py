"""Test settings: the Triton interpreter on machines without CUDA, and deterministic fp32 products."""

import os

import pytest
import torch

# The engine and recipe tests compare against one-process CPU references over gloo ranks (several per
# machine, more than its GPUs): they run on the CPU on a GPU machine too. The kernel and layer tests
# name their device themselves (tests/devices.py) and run on CUDA where it is.
os.environ["DS_ACCELERATOR"] = "cpu"

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


def pytest_collection_modifyitems(items):
    """The tests that run on the GPU where there is one (their module takes `tests.devices.DEVICE`) carry
    the `gpu` marker beside those marked by hand, so `python -m pytest -m gpu` runs them all."""
    from tests.devices import DEVICE

    for item in items:
        if getattr(getattr(item, "module", None), "DEVICE", None) is DEVICE:
            item.add_marker(pytest.mark.gpu)
