"""The distributed test helper itself: ranks see the caller's environment and fresh seeds; failures and
hangs name the rank."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parent.parent


def _check_environment(rank, world_size, expected):
    assert dist.get_rank() == rank and dist.get_world_size() == world_size
    assert os.environ.get("MOE_HELPER_SET") == expected
    assert "MOE_HELPER_UNSET" not in os.environ


def test_ranks_see_the_environment_as_it_is_at_each_call(monkeypatch):
    monkeypatch.delenv("MOE_HELPER_UNSET", raising=False)
    for value in ("first", "second"):  # ranks of both calls come from one fork server (on Linux)
        monkeypatch.setenv("MOE_HELPER_SET", value)
        run_distributed(_check_environment, 2, value)
    monkeypatch.setenv("MOE_HELPER_UNSET", "1")
    with pytest.raises(AssertionError, match=r"(?s)rank [01] failed:.*MOE_HELPER_UNSET"):  # whichever reports first
        run_distributed(_check_environment, 2, "second")


@pytest.mark.slow
def test_a_variable_the_caller_removed_is_gone_from_ranks_forked_later():
    # a fresh interpreter, so that its fork server certainly starts while the variable is set
    script = textwrap.dedent("""
        import os
        import pytest
        from tests.distributed import run_distributed
        from tests.test_distributed_helper import _check_environment
        os.environ["MOE_HELPER_SET"] = "set"
        os.environ["MOE_HELPER_UNSET"] = "1"
        with pytest.raises(AssertionError, match="MOE_HELPER_UNSET"):  # the ranks see it while it is set
            run_distributed(_check_environment, 2, "set")
        del os.environ["MOE_HELPER_UNSET"]
        run_distributed(_check_environment, 2, "set")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


# read when a process imports this module: in a rank, as the environment was when the rank imported it
_AT_IMPORT = os.environ.get("MOE_HELPER_AT_IMPORT")


def _check_seen_at_import(rank, world_size, expected):
    assert _AT_IMPORT == expected, (_AT_IMPORT, expected)


@pytest.mark.slow
def test_fresh_ranks_import_under_the_callers_environment(monkeypatch):
    monkeypatch.delenv("MOE_HELPER_AT_IMPORT", raising=False)
    run_distributed(_noop, 2)  # the fork server (on Linux) has started without the variable
    monkeypatch.setenv("MOE_HELPER_AT_IMPORT", "at the call")
    run_distributed(_check_seen_at_import, 2, "at the call", fresh=True)
    if sys.platform == "linux":  # ranks from the fork server import under its environment, not the caller's
        run_distributed(_check_seen_at_import, 2, None)
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: rank one's own error"):
        run_distributed(_fail_on_rank_1, 2, fresh=True)


def _write_seed(rank, world_size, folder, call):
    Path(folder, f"{call}-{rank}").write_text(str(torch.initial_seed()))


def test_every_rank_of_every_call_draws_its_own_seed(tmp_path):
    for call in range(2):
        run_distributed(_write_seed, 2, str(tmp_path), call)
    seeds = {path.read_text() for path in tmp_path.iterdir()}
    assert len(seeds) == 4, seeds


def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("rank one's own error")


def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 failed:.*ValueError: rank one's own error"):
        run_distributed(_fail_on_rank_1, 2)


def _noop(rank, world_size):
    """Nothing: a run of it times how long ranks take to start."""


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(600)  # terminated by the helper


@pytest.mark.slow
def test_a_hanging_rank_fails_within_the_timeout():
    start = time.perf_counter()
    run_distributed(_noop, 2)
    timeout_s = 2 + 3 * (time.perf_counter() - start)  # ranks must start first: seconds each without a fork server
    start = time.perf_counter()
    with pytest.raises(AssertionError, match=r"ranks \[1\] did not finish within"):
        run_distributed(_hang_on_rank_1, 2, timeout_s=timeout_s)
    assert time.perf_counter() - start < timeout_s + 15
