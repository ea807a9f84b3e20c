"""Independent CPU work items run side by side on worker threads, each worker single-threaded.

On a CPU, one product multithreaded over the cores can be slower than the same products run one per
core. On a 2-core AMD EPYC, two threads ran one [256, 512] x [512, 2048] product only 1.6x as fast as
one thread (4.8 against 7.6 ms), and sixteen such products took 62-66 ms side by side on two
single-threaded workers against 74-80 ms one after another on two threads. `run_each` hands items
(e.g. experts) to as many workers as torch has intra-op threads; torch's ops release the GIL, so the
workers' products overlap. Each worker pulls the next item from one shared order, so a slow item
does not hold up the rest; every item writes only its own outputs, and every product runs on one
thread whichever worker takes it, so results do not depend on the scheduling (bitwise repeatable).

Workers take the caller's grad mode and inference mode (both thread-local in torch). Other
thread-local state does not reach them: torch function and dispatch modes (e.g. FlopCounterMode)
do not see the workers' ops.

A pool is made per process and worker count on first use (a forked child makes its own: the
parent's threads do not exist there).
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["caller_threads", "on_worker", "run_each", "workers"]

_pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process id, workers) -> pool, never shut down
_pools_lock = threading.Lock()
_local = threading.local()  # on a pool's threads: caller_threads, the intra-op count of the code using the pool
_DONE = object()


def workers() -> int:
    """How many workers `run_each` uses: torch's intra-op thread count."""
    return torch.get_num_threads()


def on_worker() -> bool:
    """Whether the calling thread is one of `run_each`'s single-threaded workers."""
    return hasattr(_local, "caller_threads")


def caller_threads() -> int:
    """torch's intra-op thread count of the code that runs the workers (on a worker: its caller's, not 1)."""
    return getattr(_local, "caller_threads", None) or torch.get_num_threads()


def _executor(count: int) -> ThreadPoolExecutor:
    key = (os.getpid(), count)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = ThreadPoolExecutor(count, thread_name_prefix="moe-cpu")
            _start_single_threaded(pool, count)
        return pool


def _start_single_threaded(pool: ThreadPoolExecutor, count: int) -> None:
    """Start the pool's `count` threads, each set to one intra-op thread (OpenMP and BLAS).

    torch sets a thread up lazily from a process-wide count on its first parallel call, and
    torch.set_num_threads sets that count as well as the calling thread's: so each worker is set up
    first, then set to one thread, and the process-wide count is put back afterwards.
    """
    before = torch.get_num_threads()
    arrived = threading.Barrier(count, timeout=60)  # every task waits for all: one task per thread

    def start():
        torch.get_num_threads()  # torch's per-thread set-up, which would otherwise undo the next line
        torch.set_num_threads(1)
        _local.caller_threads = count  # a pool of `count` workers serves callers of `count` threads
        arrived.wait()

    try:
        for future in [pool.submit(start) for _ in range(count)]:
            future.result()
    finally:
        torch.set_num_threads(before)


def run_each(work, items) -> None:
    """Call work(item) for every item of `items`, started in that order, on single-threaded workers.

    With one intra-op thread, or one item, the items run in the calling thread.

    Args:
        work: a function of one item; it must write only what belongs to its item.
        items: the items, the costliest first for the best balance.

    Raises:
        Whatever a call of `work` raised (the first worker's error when several failed), after every
        worker has stopped.
    """
    items = list(items)
    count = min(workers(), len(items))
    if count <= 1:
        for item in items:
            work(item)
        return
    order = iter(items)
    lock = threading.Lock()
    grad_enabled, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def drain():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
            while True:
                with lock:
                    item = next(order, _DONE)
                if item is _DONE:
                    return
                work(item)

    pool = _executor(workers())
    futures = [pool.submit(drain) for _ in range(count)]
    errors = [future.exception() for future in futures]  # waits for every worker
    for error in errors:
        if error is not None:
            raise error
