"""Independent CPU work items run side by side on worker threads, each worker single-threaded.

On a CPU, one product multithreaded over the cores can be slower than the same products run one per
core: at the shapes of 64 experts of [~256, 512] x [512, 2048] on a 2-core AMD EPYC, two threads ran
one product 1.6x as fast as one thread did, while two single-threaded products side by side ran
1.9-2.0x. `run_each` hands items (e.g. experts) to as many workers as torch has intra-op threads;
torch's ops release the GIL, so the workers' products overlap. Each worker pulls the next item from
one shared order, so a slow item does not hold up the rest; every item writes only its own outputs,
and every product runs on one thread whichever worker takes it, so results do not depend on the
scheduling (bitwise repeatable). Workers take the caller's grad mode (thread-local in torch).

The pool is made on first use, again when torch's thread count changes, and again in a forked child
(the parent's threads do not exist there).
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["run_each", "workers"]

_pool: ThreadPoolExecutor | None = None
_pool_key: tuple[int, int] | None = None  # (process id, workers) the pool was made for
_pool_lock = threading.Lock()
_DONE = object()


def workers() -> int:
    """How many workers `run_each` uses: torch's intra-op thread count."""
    return torch.get_num_threads()


def _executor(count: int) -> ThreadPoolExecutor:
    global _pool, _pool_key
    key = (os.getpid(), count)
    with _pool_lock:
        if _pool_key != key:
            if _pool is not None and _pool_key[0] == key[0]:
                _pool.shutdown(wait=False)  # idle between calls; in a forked child its threads never existed
            _pool = ThreadPoolExecutor(count, thread_name_prefix="moe-cpu")
            _pool_key = key
            _start_single_threaded(_pool, count)
        return _pool


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
        arrived.wait()

    try:
        for future in [pool.submit(start) for _ in range(count)]:
            future.result()
    finally:
        torch.set_num_threads(before)


def run_each(work, items) -> None:
    """Call work(item) for every item of `items`, in that order of starting, on single-threaded workers.

    Args:
        work: a function of one item; it must write only what belongs to its item.
        items: the items, the costliest first for the best balance.

    Raises:
        Whatever a call of `work` raised (the first such, after every worker has stopped).
    """
    items = list(items)
    count = min(workers(), len(items))
    if count <= 1:
        for item in items:
            work(item)
        return
    order = iter(items)
    lock = threading.Lock()
    grad_enabled = torch.is_grad_enabled()  # thread-local state: the workers follow the caller

    def drain():
        torch.set_grad_enabled(grad_enabled)
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
