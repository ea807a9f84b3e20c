"""Run a test function on N gloo processes on this machine, failing fast with the rank's traceback.

On Linux, ranks start from a fork server that has imported torch and the project once
(multiprocessing's "forkserver" context; "spawn" elsewhere, where forking a process that imported
torch is not safe): a rank then starts in a fraction of the time a fresh interpreter takes to import
torch. The fork server is a
clean single-threaded process, so forking it is safe where forking the test process (with its
OpenMP threads) would not be. Each rank takes the caller's environment as it is at the call and a
fresh random seed, as a spawned process would. What differs from spawn: settings read when a library
loads (OMP_NUM_THREADS, TORCHINDUCTOR_*, TMPDIR, TRITON_INTERPRET) are those of the fork server's
start (`fresh=True` starts ranks that import under the caller's environment instead), ranks print
to the fork server's stdout and stderr (capfd does not see them), and the arguments may hold at most
about 250 tensor storages (one file descriptor each).
"""

import os
import queue
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# imported once by the fork server, before it forks any rank: torch and the packages under test, which
# read their settings (MOE_* variables) when called, never when imported, and what the packages import
# only when used (DCP for checkpoints, torch._dynamo which it reaches): without them every rank of a
# checkpoint test would import them anew
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "kernels", "parallel", "moe", "optim",
            "torch.distributed.checkpoint", "torch._dynamo"]


def _worker(rank, world_size, port, fn, args, results, environ):
    os.environ.clear()  # the caller's environment at the call (the fork server's is from its start)
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    torch.seed()  # the fork server's generator state is every rank's otherwise
    try:
        import datetime

        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=60))
        fn(rank, world_size, *args)
        results.put((rank, None))
    except BaseException:  # report every failure, assertion or not, with its traceback
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0, fresh: bool = False) -> None:
    """Start `world_size` processes running fn(rank, world_size, *args) in a gloo group.

    fresh=True starts each rank in a new interpreter (spawn), which imports the project under the
    caller's environment at the call: for settings read at import, such as TRITON_INTERPRET, which
    the fork server took from its own start.

    Raises:
        AssertionError: naming the first rank that failed, with its traceback, or the ranks that timed out.
    """
    if sys.platform == "linux" and not fresh:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(_PRELOAD)
    else:  # a fresh interpreter per rank
        context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    environ = dict(os.environ)
    procs = [context.Process(target=_worker, args=(r, world_size, port, fn, args, results, environ))
             for r in range(world_size)]
    for p in procs:
        p.start()
    reports = {}
    try:
        for _ in range(world_size):
            rank, error = results.get(timeout=timeout_s)
            reports[rank] = error
            if error is not None:
                break
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5 if len(reports) == world_size else 1)
            if p.is_alive():
                p.terminate()
    failed = {r: e for r, e in reports.items() if e is not None}
    if failed:
        rank, error = sorted(failed.items())[0]
        raise AssertionError(f"rank {rank} failed:\n{error}")
    missing = sorted(set(range(world_size)) - set(reports))
    assert not missing, f"ranks {missing} did not finish within {timeout_s} s (hang?)"
