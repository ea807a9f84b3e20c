"""kernels.interpreter: Triton's interpreter runs a loop whose bound is a kernel argument, whatever numpy
sits beside it (the fit applies only where the interpreter needs it, and once)."""

import os

import pytest
import torch

from kernels import interpreter

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs CPU tensors only")


def test_a_loop_bound_given_as_an_argument_runs_in_the_interpreter():
    pytest.importorskip("triton")
    interpreter.fit_interpreter()
    interpreter.fit_interpreter()  # once per process: a second call changes nothing
    for n in (0, 1, 7):
        out = torch.full((1,), -1, dtype=torch.int32)
        interpreter._loop_kernel()[(1,)](out, n)
        assert int(out) == n
