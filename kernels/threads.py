"""Independent CPU work items run side by side, each on one thread of its own.

On a CPU, one product multithreaded over the cores can be slower than the same products run one per
core. On a 2-core AMD EPYC, two threads ran one [256, 512] x [512, 2048] product only 1.6x as fast as
one thread (4.8 against 7.6 ms), and sixteen such products took 62-66 ms side by side on two
single-threaded workers against 74-80 ms one after another on two threads. `run_each` hands items
(e.g. experts) to as many workers as torch has intra-op threads. Each worker pulls the next item from
one shared order, so a slow item does not hold up the rest; every item writes only its own outputs,
and every product runs on one thread whichever worker takes it, so results do not depend on the
scheduling (bitwise repeatable). torch's ops release the GIL, so the workers' products overlap.

The workers are torch's own intra-op threads where those are an OpenMP team whose runtime this
process can call (Linux builds of torch with GNU OpenMP, or a runtime with its entry points): the
items then run inside one OpenMP parallel region, the caller's thread being one of the workers, and
every torch op and BLAS call in a region runs on its calling thread alone. Elsewhere they are a pool
of Python threads, each set to one intra-op thread. The team matters for speed: while pool threads
work, the caller's idle OpenMP threads keep spinning for some milliseconds after its last parallel
region (GNU OpenMP's default wait policy) and take a core from them. The GPT recipe's expert MLP (8
experts of [~1024, 128] x [128, 256], forward and backward, on a 2-core AMD EPYC with AVX-512) took
24.4-25.2 ms on the team against 29.9-32.5 ms on the pool and 27.6-28.5 ms one expert after another
on two threads (medians of 60 alternating calls in one process).

Workers take the caller's grad mode and inference mode (both thread-local in torch). Other
thread-local state does not reach the other workers: torch function and dispatch modes (e.g.
FlopCounterMode) see only the caller's thread's share of the items.

A pool is made per process and worker count on first use (a forked child makes its own: the
parent's threads do not exist there); a forked child never uses the parent's OpenMP team either.
"""

import ctypes
import functools
import itertools
import os
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["caller_threads", "on_worker", "openmp_team", "run_each", "workers"]

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

    With one intra-op thread, or one item, the items run in the calling thread; so do they inside an
    OpenMP parallel region (a worker calling run_each), where the team of a nested region has one thread.

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
    job = _Job(work, items, caller_threads())
    if openmp_team():
        key = next(_job_keys)
        _jobs[key] = job
        try:
            _openmp_parallel()(_TEAM_MEMBER, key, count, 0)  # returns when every member has
        finally:
            del _jobs[key]
        errors = job.errors
    else:
        futures = [_executor(workers()).submit(job.drain) for _ in range(count)]
        errors = [error for error in (future.exception() for future in futures) if error is not None]  # waits for all
    if errors:
        raise errors[0]


class _Job:
    """The items of one run_each call, taken in order by each worker that drains it."""

    def __init__(self, work, items: list, caller_threads: int):
        self.work, self.order, self.lock, self.errors = work, iter(items), threading.Lock(), []
        self.caller_threads = caller_threads
        self.grad_enabled, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def drain(self) -> None:
        """Run items until none is left; an error stops this worker (the others go on) and is raised."""
        with torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad_enabled):
            while True:
                with self.lock:
                    item = next(self.order, _DONE)
                if item is _DONE:
                    return
                self.work(item)


# --- torch's OpenMP team as the workers ---------------------------------------------------------

_jobs: dict[int, _Job] = {}  # the running jobs by key, the key being what the team's members are given
_job_keys = itertools.count(1)


def _member(key: int) -> None:
    """One member of the OpenMP team drains the job; the caller's thread is member 0. An error is kept
    for run_each to raise (none may leave a C callback)."""
    job = _jobs[key]
    before = getattr(_local, "caller_threads", None)
    _local.caller_threads = job.caller_threads
    try:
        job.drain()
    except BaseException as error:  # noqa: BLE001 (raised by run_each once the region is over)
        job.errors.append(error)
    finally:
        if before is None:
            del _local.caller_threads
        else:
            _local.caller_threads = before


_MEMBER_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_size_t)
_TEAM_MEMBER = _MEMBER_FUNCTION(_member)  # kept alive for the process's life


@functools.cache
def _openmp_runtime() -> tuple[int, ctypes.CDLL] | None:
    """(process id, the OpenMP runtime torch's intra-op threads run on) where that runtime is loaded
    from a file this process can name (Linux) and has GNU OpenMP's entry points; None elsewhere.

    The file is found among the process's mapped libraries: the one in torch's own library folder
    where there is one (the wheels ship GNU OpenMP there), else the only OpenMP runtime loaded.
    """
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = set(re.findall(r"(/\S*/lib[gi]?omp[^/\s]*\.so[^/\s]*)$", maps.read(), re.MULTILINE))
    except OSError:
        return None
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib") + os.sep
    own = [path for path in paths if path.startswith(torch_lib)]
    chosen = own if own else sorted(paths)
    if len(chosen) != 1:
        return None
    try:
        runtime = ctypes.CDLL(chosen[0])  # the loaded library itself: dlopen of its path adds a reference
        runtime.GOMP_parallel.argtypes = [_MEMBER_FUNCTION, ctypes.c_size_t, ctypes.c_uint, ctypes.c_uint]
        runtime.GOMP_parallel.restype = None
    except (OSError, AttributeError):
        return None
    return os.getpid(), runtime


def _openmp_parallel():
    """GOMP_parallel(function, data, threads, flags): runs function(data) on a team of that many threads."""
    return _openmp_runtime()[1].GOMP_parallel


def openmp_team() -> bool:
    """Whether `run_each` runs its items on torch's OpenMP team in this process (else on a pool of threads)."""
    runtime = _openmp_runtime()
    return runtime is not None and runtime[0] == os.getpid()
