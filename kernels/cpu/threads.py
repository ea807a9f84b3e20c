"""Independent CPU work items run side by side, each on one thread of its own.

On a CPU, one product multithreaded over the cores can be slower than the same products run one per
core, and a multithreaded op loses most when other processes share the cores (its threads wait for
each other at every parallel region). `run_each` hands items (e.g. experts) to as many workers as
torch has intra-op threads. Each worker pulls the next item from one shared order, so a slow item does
not hold up the rest; every item writes only its own outputs, and every product runs on one thread
whichever worker takes it, so results do not depend on the scheduling (bitwise repeatable). torch's
ops release the GIL, so the workers' products overlap.

The workers are torch's own intra-op threads where those are an OpenMP team whose runtime this
process can call (Linux builds of torch with GNU OpenMP, or a runtime with its entry points): the
items then run inside one OpenMP parallel region, the caller's thread being one of the workers, and
every torch op and BLAS call in a region runs on its calling thread alone. Elsewhere they are a pool
of Python threads, each set to one intra-op thread. The team matters for speed: while pool threads
work, the caller's idle OpenMP threads keep spinning for some milliseconds after its last parallel
region (GNU OpenMP's default wait policy) and take a core from them.

Workers take the caller's grad mode and inference mode (both thread-local in torch) and run with
autocast off, whichever thread they are. Other thread-local state does not reach the other workers:
torch function and dispatch modes (e.g. FlopCounterMode, optim.memory.LiveBytes), Python's tracing
and profiling hooks see only the share of the items that ran on the caller's thread. An OpenMP
team's threads have the stack size OMP_STACKSIZE gives them.

The workers' state (the pools, the jobs the team's members look up, which threads are workers) lives
in a `Workers` object; the functions of this module use the process's. A pool is made per process
and worker count on first use (a forked child makes its own: the parent's threads do not exist
there). A process forked from one that imported this module never uses the OpenMP team: GNU OpenMP
does not survive a fork once its threads have run (nor do torch's own multithreaded operations in
such a child).
"""

import ctypes
import functools
import itertools
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["Workers", "caller_threads", "on_worker", "openmp_team", "run_each", "workers"]

_DONE = object()
_PROCESS = os.getpid()  # the process that imported this module: its forked children use the pool
_MEMBER_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_size_t)


class Workers:
    """Single-threaded workers for `run_each`: torch's OpenMP team, or pools of threads made on first use."""

    def __init__(self):
        self._pools: dict[tuple[int, int], ThreadPoolExecutor] = {}  # (process id, workers) -> pool, never shut down
        self._pools_lock = threading.Lock()
        self._local = threading.local()  # on a worker while it runs items: caller_threads, its caller's intra-op count
        self._jobs: dict[int, _Job] = {}  # the running jobs by key, the key being what the team's members are given
        self._job_keys = itertools.count(1)
        self._kept = threading.local()  # `state` set on a team member whose Python thread state outlives each callback
        self._team_member = _MEMBER_FUNCTION(self._member)  # kept alive with this object

    def count(self) -> int:
        """How many workers `run_each` uses: torch's intra-op thread count; 1 on a worker (items run there)."""
        return 1 if self.on_worker() else torch.get_num_threads()

    def on_worker(self) -> bool:
        """Whether the calling thread is one of the single-threaded workers."""
        return hasattr(self._local, "caller_threads")

    def caller_threads(self) -> int:
        """torch's intra-op thread count of the code that runs the workers (on a worker: its caller's, not 1)."""
        return getattr(self._local, "caller_threads", None) or torch.get_num_threads()

    def run_each(self, work, items) -> None:
        """Call work(item) for every item of `items`, started in that order, on single-threaded workers.

        With one intra-op thread, or one item, or on a worker (a work item calling run_each), the items
        run in the calling thread, one after another; so do they where OpenMP gives a team of one
        thread (OMP_DYNAMIC on a loaded machine, OMP_THREAD_LIMIT=1), with the caller's threads.

        Args:
            work: a function of one item; it must write only what belongs to its item.
            items: the items, the costliest first for the best balance.

        Raises:
            Whatever a call of `work` raised (one of the errors when several calls failed), after every
            worker has stopped; a KeyboardInterrupt or other BaseException stops every worker at its next item.
        """
        items = list(items)
        count = min(self.count(), len(items))
        if count <= 1:
            for item in items:
                work(item)
            return
        job = _Job(work, items, self.caller_threads())
        if openmp_team():
            key = next(self._job_keys)
            self._jobs[key] = job
            try:
                # the whole team, whatever the items: a smaller one would make OpenMP end the threads left out
                # (and start them again later), each with the Python thread state it keeps (_keep_thread_state)
                _openmp_runtime().GOMP_parallel(self._team_member, key, self.count(), 0)  # returns when all have
            finally:
                del self._jobs[key]
            errors = job.errors
        else:
            futures = [self._executor(self.count()).submit(job.drain) for _ in range(count)]
            errors = [error for error in (future.exception() for future in futures) if error is not None]  # waits
        if errors:
            raise errors[0]

    # --- a pool of threads as the workers -------------------------------------------------------

    def _executor(self, count: int) -> ThreadPoolExecutor:
        key = (os.getpid(), count)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = ThreadPoolExecutor(count, thread_name_prefix="moe-cpu")
                self._start_single_threaded(pool, count)
            return pool

    def _start_single_threaded(self, pool: ThreadPoolExecutor, count: int) -> None:
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
            self._local.caller_threads = count  # a pool of `count` workers serves callers of `count` threads
            arrived.wait()

        try:
            for future in [pool.submit(start) for _ in range(count)]:
                future.result()
        finally:
            torch.set_num_threads(before)

    # --- torch's OpenMP team as the workers -----------------------------------------------------

    def _member(self, key: int) -> None:
        """One member of the OpenMP team drains the job (the caller's thread is member 0); errors are kept."""
        job = self._jobs[key]  # errors go to run_each, which raises them: none may leave a C callback
        # a team of one (OMP_DYNAMIC, OMP_THREAD_LIMIT) is no parallel region: the caller runs the items with its threads
        worker = bool(_openmp_runtime().omp_in_parallel())
        try:
            if threading.get_ident() != job.caller and not getattr(self._kept, "state", False):
                self._keep_thread_state()
            if worker:
                self._local.caller_threads = job.caller_threads  # not set before: run_each runs inline on a worker
            job.drain()
        except BaseException as error:  # noqa: BLE001
            job.errors.append(error)
        finally:
            if worker and hasattr(self._local, "caller_threads"):
                del self._local.caller_threads

    def _keep_thread_state(self) -> None:
        """Keep the calling team member's Python thread state from one callback to the next.

        ctypes runs a callback on a thread Python did not start under a thread state made for that call
        and deleted after it (PyGILState_Ensure, then Release): a member would make and delete one per
        run_each call, and start its items that much later. One more Ensure, never released, keeps it
        for the thread's life (the team is always started whole, so OpenMP keeps its threads; a thread
        that ends anyway, when torch.set_num_threads lowers the count, leaves its state behind: a few KB).
        A thread-local mark, not the thread's id, records it: a new thread may get an ended one's id.
        """
        ctypes.pythonapi.PyGILState_Ensure()
        self._kept.state = True


class _Job:
    """The items of one run_each call, taken in order by each worker that drains it."""

    def __init__(self, work, items: list, threads: int):
        self.work, self.order, self.lock, self.errors, self.stopped = work, iter(items), threading.Lock(), [], False
        self.caller_threads, self.caller = threads, threading.get_ident()
        self.grad_enabled, self.inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def drain(self) -> None:
        """Run items until none is left; an Exception stops this worker, another BaseException all of them."""
        with (torch.inference_mode(self.inference), torch.set_grad_enabled(self.grad_enabled),
              torch.autocast("cpu", enabled=False)):
            while not self.stopped:
                with self.lock:
                    item = next(self.order, _DONE)
                if item is _DONE:
                    return
                try:
                    self.work(item)
                except Exception:
                    raise
                except BaseException:  # KeyboardInterrupt, SystemExit: the other workers stop too
                    self.stopped = True
                    raise


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """torch's CPU library where its intra-op threads are GNU OpenMP's (or a runtime with its entry
    points) on Linux, None elsewhere; GOMP_parallel and omp_in_parallel looked up through it resolve to
    the runtime torch itself calls (its dependency), whatever other OpenMP runtimes the process loaded."""
    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # torch has loaded it: opening the same file again gives the loaded library
        library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        parallel, in_parallel = library.GOMP_parallel, library.omp_in_parallel
    except (OSError, AttributeError):
        return None
    parallel.argtypes, parallel.restype = [_MEMBER_FUNCTION, ctypes.c_size_t, ctypes.c_uint, ctypes.c_uint], None
    in_parallel.argtypes, in_parallel.restype = [], ctypes.c_int
    return library


def openmp_team() -> bool:
    """Whether `run_each` runs its items on torch's OpenMP team in this process (else on a pool of threads)."""
    return os.getpid() == _PROCESS and _openmp_runtime() is not None


_WORKERS = Workers()  # the process's workers, which every layer shares


def workers() -> int:
    """How many workers `run_each` uses: torch's intra-op thread count; 1 on a worker (items run there)."""
    return _WORKERS.count()


def on_worker() -> bool:
    """Whether the calling thread is one of `run_each`'s single-threaded workers."""
    return _WORKERS.on_worker()


def caller_threads() -> int:
    """torch's intra-op thread count of the code that runs the workers (on a worker: its caller's, not 1)."""
    return _WORKERS.caller_threads()


def run_each(work, items) -> None:
    """`Workers.run_each` on the process's workers."""
    _WORKERS.run_each(work, items)
