"""moe.autocast: the dtype autocast computes in on a device (None where it is off, and on devices
autocast does not know, such as meta), and the context that turns it off for the fp32 router, checked
against the dtype of a plain torch matmul inside and around it."""

import contextlib

import pytest
import torch

from moe.autocast import autocast_dtype, no_autocast

CPU, META = torch.device("cpu"), torch.device("meta")


def _matmul_dtype() -> torch.dtype:
    a = torch.ones(2, 2)
    return (a @ a).dtype


def test_off_by_default():
    assert autocast_dtype(CPU) is None
    assert _matmul_dtype() == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_dtype_of_an_enabled_autocast_and_none_on_a_device_it_does_not_know(dtype):
    with torch.autocast("cpu", dtype=dtype):
        assert autocast_dtype(CPU) == dtype == _matmul_dtype()
        assert autocast_dtype(META) is None  # torch.is_autocast_enabled("meta") would raise
    assert autocast_dtype(CPU) is None
    with torch.autocast("cpu", dtype=dtype, enabled=False):
        assert autocast_dtype(CPU) is None


def test_no_autocast_turns_autocast_off_inside_and_leaves_it_on_around():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with no_autocast(CPU):
            assert autocast_dtype(CPU) is None and _matmul_dtype() == torch.float32
        assert autocast_dtype(CPU) == torch.bfloat16 == _matmul_dtype()
        with no_autocast(META):  # another device's context leaves the CPU's autocast alone
            assert _matmul_dtype() == torch.bfloat16


def test_no_autocast_where_it_is_off_is_a_plain_null_context():
    assert isinstance(no_autocast(CPU), contextlib.nullcontext)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not isinstance(no_autocast(CPU), contextlib.nullcontext)
        assert isinstance(no_autocast(META), contextlib.nullcontext)
