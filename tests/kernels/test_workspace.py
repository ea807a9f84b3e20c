"""The CPU workspace never hands out memory that a live tensor still uses."""

import torch

from kernels import workspace


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_storage_is_reused_only_after_every_reference_is_gone():
    workspace.clear()
    first = workspace.empty((8192, 1100), torch.float32)  # over 32 MiB: pooled whether or not glibc was tuned
    first.fill_(1.0)
    view = first[3:]
    del first
    second = workspace.empty((8192, 1100), torch.float32)
    assert _ptr(second) != _ptr(view), "a view keeps the storage in use"
    assert bool((view == 1.0).all())
    address = _ptr(view)
    del view
    third = workspace.empty((8192, 1080), torch.float32)
    assert _ptr(third) == address, "a released storage of the same size class is reused"
    assert third.shape == (8192, 1080) and third.is_contiguous()


def test_small_and_non_float_requests_work():
    small = workspace.empty((4, 4), torch.float32)
    assert small.shape == (4, 4)
    big = workspace.empty((4096, 4096), torch.bfloat16)
    assert big.dtype == torch.bfloat16 and big.numel() == 4096 * 4096
    assert workspace.held_bytes() >= 32 * 1024 * 1024
    workspace.clear()
    assert workspace.held_bytes() == 0


def test_requests_below_32_mib_go_to_glibc_once_it_keeps_freed_chunks():
    """With glibc tuned (kept chunks up to 32 MiB), mid-sized requests skip the pool, which would cost more per call."""
    workspace.clear()
    mid = workspace.empty((1024, 1024), torch.float32)  # 4 MiB
    assert mid.shape == (1024, 1024)
    if workspace._tune_malloc():
        assert workspace.held_bytes() == 0, "a 4 MiB request was pooled although glibc keeps such chunks"
    else:
        assert workspace.held_bytes() >= 4 * 1024 * 1024


def test_the_allocator_reuses_small_requests_and_not_the_largest():
    """Below 1 MiB torch.empty is served from the allocator's free lists; at 32 MiB and beyond a fresh
    request is page-faulted in, so ops that allocate their own output keep to the smaller sizes."""
    assert workspace.allocator_reuses(1 << 10)
    assert not workspace.allocator_reuses(64 << 20)
