"""The CPU workspace never hands out memory that a live tensor still uses."""

import torch

from kernels import workspace


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_storage_is_reused_only_after_every_reference_is_gone():
    workspace.clear()
    first = workspace.empty((512, 1024), torch.float32)
    first.fill_(1.0)
    view = first[3:]
    del first
    second = workspace.empty((512, 1024), torch.float32)
    assert _ptr(second) != _ptr(view), "a view keeps the storage in use"
    assert bool((view == 1.0).all())
    address = _ptr(view)
    del view
    third = workspace.empty((512, 1000), torch.float32)
    assert _ptr(third) == address, "a released storage of the same size class is reused"
    assert third.shape == (512, 1000) and third.is_contiguous()


def test_small_and_non_float_requests_work():
    small = workspace.empty((4, 4), torch.float32)
    assert small.shape == (4, 4)
    big = workspace.empty((1024, 1024), torch.bfloat16)
    assert big.dtype == torch.bfloat16 and big.numel() == 1024 * 1024
    assert workspace.held_bytes() >= 2 * 1024 * 1024
    workspace.clear()
    assert workspace.held_bytes() == 0
