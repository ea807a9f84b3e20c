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
from torch._subclasses.fake_tensor import FakeTensor

from kernels.interpreter import fit_interpreter

__all__ = ["block_size", "cpu_eager", "launcher", "sync_checks", "use_triton"]

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
        RuntimeError: MOE_KERNELS=triton without triton (meta tensors excepted: they run no kernel), or on
            CPU tensors without TRITON_INTERPRET=1.
    """
    choice = os.environ.get("MOE_KERNELS", "auto")
    if choice not in CHOICES:
        raise ValueError(f"MOE_KERNELS must be one of {CHOICES}, got {choice!r}")
    if choice == "torch" or t.dtype not in KERNEL_DTYPES:
        return False
    if choice == "auto":
        return t.is_cuda and _triton_importable()
    if t.device.type == "meta":  # no kernel runs: the custom op's shape-only implementation, Triton or not
        return True
    if not _triton_importable():
        raise RuntimeError("MOE_KERNELS=triton but triton is not installed")
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("MOE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1 (the Triton interpreter)")
    return True


def cpu_eager(t: torch.Tensor) -> bool:
    """Whether CPU-only shortcuts apply to ops on `t`: a real CPU tensor in eager code on the torch path
    (tensors cached across calls, ops that would sync on a GPU). Not under torch.compile (sizes may be
    symbolic), not for fake tensors, and not with MOE_KERNELS=triton: the simulated GPU path on CPU
    tensors takes the GPU's branches."""
    return (t.device.type == "cpu" and not torch.compiler.is_compiling() and not isinstance(t, FakeTensor)
            and os.environ.get("MOE_KERNELS", "auto") != "triton")


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


_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY,
                  torch._C._TorchDispatchModeKey.FUNCTIONAL)


def _traced(t: torch.Tensor) -> bool:
    """Whether a call on `t` must go through the custom op: torch.compile, torch.jit.trace, fake,
    meta or wrapped tensors (a subclass such as FakeTensor), a fake, proxy or functional mode, or any
    Python dispatch mode (FlopCounterMode, a test's op counter, ...), which should see the op."""
    return (torch.compiler.is_compiling() or torch.jit.is_tracing() or type(t) is not torch.Tensor
            or t.device.type == "meta" or torch._C._len_torch_dispatch_stack() > 0
            or any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES))


def launcher(name: str, launch, fake):
    """A Triton launch function as the kernels call it: the torch custom op `name` (with its shape-only
    `fake`) where a trace needs an opaque op, else `launch` itself.

    The op is what torch.compile, torch.jit.trace, fake tensors, the meta device and dispatch modes
    see. Other eager calls on real tensors skip it: its dispatch costs several times a direct call's
    host time, and a small model on a GPU is bound by host time. The first tensor argument decides.
    On CPU tensors the kernel runs in Triton's interpreter, fitted first (`kernels.interpreter`).
    """
    @functools.wraps(launch)  # the op's schema is read from launch's signature
    def launch_here(t, *args):
        if not t.is_cuda:
            fit_interpreter()
        return launch(t, *args)

    op = torch.library.custom_op(name, launch_here, mutates_args=())
    op.register_fake(fake)

    def run(t, *args):
        return run.op(t, *args) if _traced(t) else run.launch(t, *args)

    run.op, run.launch = op, launch_here
    run.__doc__, run.__name__ = launch.__doc__, launch.__name__
    return run
