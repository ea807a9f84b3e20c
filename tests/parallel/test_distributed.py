"""`parallel.init_distributed` with DeepSpeed's arguments (`deepspeed.init_distributed`), in one process."""

import datetime
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

import parallel

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_method_rank_world_size_and_timeout_as_deepspeed_takes_them(no_torchrun):
    got = parallel.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=30), auto_mpi_discovery=False,
                                    distributed_port=1234, verbose=False)
    assert got == (0, 1) and dist.is_initialized() and dist.get_backend() == "gloo"
    assert parallel.init_distributed(dist_init_required=False) == (0, 1)  # a group exists: nothing to do


def test_without_torchrun_or_init_method_nothing_is_initialised(no_torchrun):
    assert parallel.init_distributed() == (0, 1) and not dist.is_initialized()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"init_method": "tcp://127.0.0.1:1"}, ValueError,
     r"init_method 'tcp://127.0.0.1:1' needs rank and world_size with 0 <= rank < world_size, got rank=-1, world_size=-1"),
    ({"init_method": "tcp://127.0.0.1:1", "rank": 2, "world_size": 2}, ValueError, r"got rank=2, world_size=2"),
    ({"dist_init_required": False}, RuntimeError, r"dist_init_required=False, but torch.distributed is not initialised"),
    ({"timeout": 30}, TypeError, r"timeout must be a datetime.timedelta, got int; timeout_s takes seconds"),
    ({"dist_backend": "gloo", "backend": "nccl"}, ValueError, r"dist_backend \('gloo'\) and backend \('nccl'\)"),
])
def test_bad_arguments_fail_before_joining(no_torchrun, kwargs, error, match):
    with pytest.raises(error, match=match):
        parallel.init_distributed(**kwargs)
    assert not dist.is_initialized()


_EXIT_SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    import torch, torch.distributed as dist
    import parallel

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    atexit.register(lambda: print("after the exit hooks:", dist.is_initialized(), threads() - before, flush=True))
    parallel.init_distributed(dist_backend="gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = parallel.expert_groups(1)  # cached by the package, as a model's MoE layers make them
    total = torch.ones(3)
    dist.all_reduce(total)  # a collective whose tensors a gloo worker thread drops after the main thread goes on
    dist.all_reduce(total, group=groups.ep_group)
    cycle = [groups]
    cycle.append(cycle)  # a reference cycle holding the groups, as a model and its engine do
    del groups, cycle
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed")
""")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)")
@pytest.mark.parametrize("ending, destroyed", [("return", True), ("raise", False)])
def test_groups_the_script_never_destroys_are_destroyed_at_a_normal_exit_only(no_torchrun, ending, destroyed):
    """DeepSpeed scripts never call destroy_process_group; gloo groups left to the interpreter's
    finalisation can abort the process (SIGABRT) as their worker threads drop their last tensors. The
    exit hook destroys them first, the package's cached expert groups and groups held in reference
    cycles included: no worker thread is left. After an uncaught exception they are left alone, so a
    collective still pending on a peer cannot hold the failing process until the timeout."""
    done = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT.format(port=_port()), ending], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert done.returncode == (0 if destroyed else 1), done.stderr[-2000:]
    left = re.search(r"after the exit hooks: (True|False) (\d+)", done.stdout)
    assert left, done.stdout + done.stderr[-2000:]
    assert left.group(1) == str(not destroyed)
    assert (int(left.group(2)) == 0) == destroyed, done.stdout  # the gloo workers joined, or still there


_PENDING_SCRIPT = textwrap.dedent("""
    import atexit, sys, time
    import torch, torch.distributed as dist
    import parallel, parallel.distributed

    parallel.distributed._EXIT_DESTROY_S = 2.0
    left = [0.0]
    atexit.register(lambda: print(f"exit hooks took {{time.time() - left[0]:.1f}} s", flush=True))
    rank = int(sys.argv[1])
    parallel.init_distributed(dist_backend="gloo", init_method="tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(60)  # never joins rank 0's collective
    work = dist.all_reduce(torch.ones(3), async_op=True)
    left[0] = time.time()
    sys.exit(1)  # a failure that leaves as an exit, its collective still pending
""")


@pytest.mark.slow
def test_an_exit_with_a_collective_still_pending_waits_for_the_destroy_a_bounded_time(no_torchrun):
    """sys.exit looks like a normal exit to the hook, whose destroy would wait for the pending
    collective until the group's timeout: the exit gives up on it after _EXIT_DESTROY_S."""
    script = _PENDING_SCRIPT.format(port=_port())
    silent = subprocess.Popen([sys.executable, "-c", script, "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              cwd=ROOT)
    try:
        done = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
    finally:
        silent.kill()
        silent.wait()
    assert done.returncode == 1, done.stderr[-2000:]
    took = re.search(r"exit hooks took ([0-9.]+) s", done.stdout)
    assert took and 1.5 <= float(took.group(1)) < 10.0, done.stdout + done.stderr[-2000:]
