"""The distributed test helper itself: ranks see the caller's environment, failures and hangs name the rank."""

import os
import time

import pytest
import torch.distributed as dist

from tests.distributed import run_distributed


def _check_environment(rank, world_size, expected):
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert os.environ.get("MOE_HELPER_SET") == expected
    assert "MOE_HELPER_UNSET" not in os.environ


def test_ranks_see_the_environment_as_it_is_at_each_call(monkeypatch):
    monkeypatch.delenv("MOE_HELPER_UNSET", raising=False)
    for value in ("first", "second"):  # the fork server started at the first call; the second must still see it
        monkeypatch.setenv("MOE_HELPER_SET", value)
        run_distributed(_check_environment, 2, value)
    monkeypatch.setenv("MOE_HELPER_UNSET", "1")
    with pytest.raises(AssertionError, match=r"(?s)rank [01] failed:.*MOE_HELPER_UNSET"):  # whichever reports first
        run_distributed(_check_environment, 2, "second")


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one's own error")


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: rank one's own error"):
        run_distributed(_fail_on_rank_1, 2)


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(60)


def test_a_hanging_rank_fails_within_the_timeout():
    start = time.perf_counter()
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not finish within 2 s"):
        run_distributed(_hang_on_rank_1, 2, timeout_s=2)
    assert time.perf_counter() - start < 30
