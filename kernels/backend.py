"""Which implementation a dispatch op runs: the Triton kernel or the torch path.

MOE_KERNELS=auto (default): Triton on CUDA tensors when triton imports, torch elsewhere.
MOE_KERNELS=triton: always Triton; on CPU tensors this needs TRITON_INTERPRET=1 (the interpreter, for
tests at small shapes). MOE_KERNELS=torch: never Triton. The kernels cover fp32, bf16 and fp16; float64 (gradient checks)
always takes the torch path. Triton is imported only when first needed.

MOE_SYNC_CHECKS=1 turns on the input checks that read device values on the host (non-finite gate
logits, expert ids out of range, equal token counts across an expert-parallel group in the padded
layout). Each such read stalls a GPU until its queue drains, so they are off by default.
"""

import functools
import os

import torch

__all__ = ["block_size", "sync_checks", "use_triton"]

CHOICES = ("auto", "triton", "torch")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    """Whether ops on `t` run the Triton kernel.

    Raises:
        ValueError: MOE_KERNELS is not one of auto, triton, torch.
        RuntimeError: MOE_KERNELS=triton without triton, or on CPU tensors without TRITON_INTERPRET=1.
    """
    choice = os.environ.get("MOE_KERNELS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"MOE_KERNELS must be one of {CHOICES}, got {choice!r}")
    if choice == "torch" or t.dtype not in KERNEL_DTYPES:
        return False
    if choice == "auto":
        return t.is_cuda and _triton_importable()
    if not _triton_importable():
        raise RuntimeError("MOE_KERNELS=triton but triton is not installed")
    if not t.is_cuda and t.device.type != "meta" and os.environ.get("TRITON_INTERPRET") != "1":  # meta runs no kernel
        raise RuntimeError("MOE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return True


def block_size(n_cols: int) -> int:
    """Columns per program: the row width rounded up to a power of two, at most 1024."""
    return min(1024, max(16, 1 << (max(n_cols, 1) - 1).bit_length()))


def sync_checks() -> bool:
    """Whether checks that need a host sync run (MOE_SYNC_CHECKS=1; off by default).

    Raises:
        ValueError: MOE_SYNC_CHECKS is not 0 or 1.
    """
    value = os.environ.get("MOE_SYNC_CHECKS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"MOE_SYNC_CHECKS must be 0 or 1, got {value!r}")
    return value == "1"
