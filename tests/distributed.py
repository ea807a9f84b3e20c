"""Run a test function on N gloo processes on this machine, failing fast with the rank's traceback."""

import os
import queue
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
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


def run_distributed(fn, world_size: int, *args, timeout_s: float = 240.0) -> None:
    """Spawn `world_size` processes running fn(rank, world_size, *args) in a gloo group.

    Raises:
        AssertionError: naming the first rank that failed, with its traceback, or the ranks that timed out.
    """
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    procs = [context.Process(target=_worker, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
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
