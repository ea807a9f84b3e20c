"""Triton's interpreter (the kernels on CPU tensors under TRITON_INTERPRET=1), fitted to the numpy beside it.

The interpreter holds a kernel's scalar arguments as one-element numpy arrays. Up to Triton 3.6 (the
version torch 2.11's CUDA builds bring) it turns one into a Python int, as `range(0, n_in, BLOCK)`
needs, with `int(array)`, which numpy 2.4 refuses for arrays that are not 0-dimensional; later Triton
reads the element. `fit_interpreter()` runs a one-program kernel with such a loop once per process and,
only where the interpreter fails it, has the interpreter read the element too. Compiled kernels (CUDA)
never come here.
"""

import functools

import torch

__all__ = ["fit_interpreter"]


@functools.cache
def _loop_kernel():
    """A kernel whose loop bound is a runtime argument, built on first use (triton imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _count_kernel(out_ptr, n):
        total = tl.zeros((1,), dtype=tl.int32)
        for _ in range(0, n):
            total += 1
        tl.store(out_ptr + tl.arange(0, 1), total)

    return _count_kernel


def _reads_loop_bounds() -> bool:
    """Whether the interpreter runs a loop whose bound is a kernel argument."""
    from triton.runtime.errors import InterpreterError

    out = torch.zeros(1, dtype=torch.int32, device="cpu")
    try:
        _loop_kernel()[(1,)](out, 3)
    except InterpreterError:
        return False
    return int(out) == 3


@functools.cache
def fit_interpreter() -> None:
    """Make the interpreter read runtime loop bounds, once per process (see the module docstring).

    Raises:
        RuntimeError: the interpreter still cannot run the loop after the fit.
    """
    if _reads_loop_bounds():
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_reading_the_element(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        # the scope restores its changes last-in first-out: the interpreter's own __index__, then the class's
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_tensor_reading_the_element
    if not _reads_loop_bounds():
        import numpy
        import triton

        raise RuntimeError(f"the Triton interpreter (triton {triton.__version__}, numpy {numpy.__version__}) cannot "
                           f"run a loop whose bound is a kernel argument; install numpy<2.4 or a newer triton")
