"""Reusable CPU memory for the dispatch path's large temporaries.

On a CPU, a fresh allocation of tens of MiB is served by mmap and first-touched page by page: every
page faults once, on every step, although the same sizes come back each step. CUDA has a caching
allocator; the CPU has none, so large temporaries (dispatch buffers, their gradients,
stacked expert gradients) come from this pool: it keeps the storages it handed out, by size class,
and gives one out again only when no tensor references it any more (its use count is the pool's
own), so reuse is safe by construction. Storages left idle for a while are released. Small or
non-CPU requests go straight to torch.empty. On first use the pool also asks glibc to keep freed
chunks of up to 32 MiB (see `_tune_malloc`); where glibc agrees, requests below 32 MiB go to
torch.empty too, since glibc then reuses them as cheaply as the pool. Where jemalloc serves the
process instead (LD_PRELOAD), it is asked to keep freed pages (`_tune_jemalloc`). Set
MOE_CPU_WORKSPACE=0 to turn all of this off.
"""

import ctypes
import ctypes.util
import errno
import functools
import math
import os
import threading

import torch

__all__ = ["Workspace", "allocator_reuses", "clear", "empty", "empty_like", "held_bytes", "keep_freed_memory"]

_MIN_BYTES = 1 << 20  # below this, the allocator's own free lists are fast enough
_KEPT_BYTES = 32 << 20  # below this, glibc tuned by _tune_malloc keeps and reuses freed chunks itself
_IDLE_REQUESTS = 512  # a free storage not reused for this many requests is released


def _enabled() -> bool:
    return os.environ.get("MOE_CPU_WORKSPACE", "1") != "0"


@functools.cache
def _tune_malloc() -> bool:
    """Keep the allocator from returning freed memory to the OS between steps: jemalloc's freed pages
    where jemalloc serves malloc (preloaded, `_tune_jemalloc`), else glibc's freed chunks of up to 32 MiB.

    The experts' products allocate their outputs inside torch ops, where the pool cannot serve them;
    glibc would otherwise trim those chunks and fault them in again every step. This keeps freed memory
    in the process for reuse, as tcmalloc does by default.
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    process = ctypes.CDLL(None) if os.name == "posix" else None  # the symbols the process resolves first
    mallctl = getattr(process, "mallctl", None)
    if mallctl is not None and _address(process.malloc) != _address(libc.malloc):
        return _tune_jemalloc(mallctl)
    if not hasattr(libc, "mallopt"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))


def _address(function) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value


def _tune_jemalloc(mallctl) -> bool:
    """Turn jemalloc's decay off in every arena, unless MALLOC_CONF names one; whether dirty pages stay."""
    # Its default decay gives freed pages back over ten seconds and faults them in again, tens of
    # thousands of pages a step in the GPT recipe's MoE model (docs/results.md). Only the environment
    # variable is read, not /etc/malloc.conf.
    mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    mallctl.restype = ctypes.c_int
    if "decay" not in os.environ.get("MALLOC_CONF", ""):
        arenas, size = ctypes.c_uint(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_uint))  # "unsigned" in jemalloc
        if mallctl(b"arenas.narenas", ctypes.byref(arenas), ctypes.byref(size), None, 0):
            return False
        never = ctypes.c_ssize_t(-1)  # milliseconds ("ssize_t")

        def turn_off(name: str) -> int:
            return mallctl(name.encode(), None, None, ctypes.byref(never), ctypes.sizeof(never))

        for kind in ("dirty", "muzzy"):
            # the default of arenas made from now on, then each arena made so far (an index not made
            # yet answers EFAULT and takes the new default when it is made)
            if turn_off(f"arenas.{kind}_decay_ms"):
                return False
            if any(turn_off(f"arena.{i}.{kind}_decay_ms") not in (0, errno.EFAULT) for i in range(arenas.value)):
                return False
    decay, size = ctypes.c_ssize_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
    return mallctl(b"arenas.dirty_decay_ms", ctypes.byref(decay), ctypes.byref(size), None, 0) == 0 and decay.value < 0


def keep_freed_memory() -> bool:
    """Ask glibc now to keep freed chunks of up to 32 MiB, or jemalloc its freed pages (`_tune_malloc`),
    unless MOE_CPU_WORKSPACE=0; whether it did.

    The pool does this on its first use, which a compiled model never makes: its buffers are
    Inductor's, allocated by torch from glibc, which untuned faults thousands of fresh pages in every
    step; so MoE layers call this when they are built.
    """
    return _enabled() and _tune_malloc()


def allocator_reuses(nbytes: int) -> bool:
    """Whether torch.empty serves this many bytes on the CPU from memory it reuses without fresh pages
    (small requests, or below 32 MiB with glibc tuned): where it does, ops that allocate their own
    output are as cheap as `empty`; beyond, their outputs fault in anew on every step."""
    return nbytes < _MIN_BYTES or (nbytes < _KEPT_BYTES and _enabled() and _tune_malloc())


def _unused(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1


def _round_up(nbytes: int) -> int:
    """Round up to one of 8 sizes per power of two, so that sizes that vary a little from step to step reuse storage."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class Workspace:
    """A pool of CPU storages by size class, each handed out again only when no tensor uses it."""

    def __init__(self):
        self._pool: dict[int, list[torch.UntypedStorage]] = {}  # size class -> storages of exactly that size
        self._last_use: dict[int, int] = {}  # id(storage) -> request number of its last use
        self._requests = 0
        self._lock = threading.Lock()

    def empty(self, shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised contiguous tensor, backed by pooled memory when it is large and on the CPU."""
        # Under torch.compile the pool's storage tricks (set_, use counts) cannot be traced, nor sizes be
        # compared (they may be symbolic); Inductor plans the graph's buffers itself. Below 32 MiB a tuned
        # glibc serves freed chunks again without faults, at a fraction of the pool's cost per call; the
        # layers ask for a dozen buffers per forward and backward, so this, the common case, is decided
        # in few steps.
        if torch.compiler.is_compiling():
            return torch.empty(shape, dtype=dtype, device=device)
        nbytes = math.prod(shape) * dtype.itemsize
        if allocator_reuses(nbytes):
            return torch.empty(shape, dtype=dtype, device=device)
        device = torch.device(device)
        if device.type != "cpu" or not _enabled():
            return torch.empty(shape, dtype=dtype, device=device)
        with self._lock:
            return self._take(_round_up(nbytes), dtype, tuple(shape))

    def _take(self, size: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """A tensor on a free storage of this size class, or on a new one; idle storages are released."""
        self._requests += 1
        if self._requests % 64 == 0:
            for storages in self._pool.values():
                storages[:] = [s for s in storages
                               if not _unused(s) or self._requests - self._last_use[id(s)] < _IDLE_REQUESTS]
        storages = self._pool.setdefault(size, [])
        storage = next((s for s in storages if _unused(s)), None)
        if storage is None:
            storage = torch.empty(size, dtype=torch.uint8).untyped_storage()
            storages.append(storage)
        self._last_use[id(storage)] = self._requests
        return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def clear(self) -> None:
        """Forget pooled storages (they are freed once no tensor uses them)."""
        with self._lock:
            self._pool.clear()
            self._last_use.clear()

    def held_bytes(self) -> int:
        """Bytes of the storages the pool holds now."""
        with self._lock:
            return sum(s.nbytes() for storages in self._pool.values() for s in storages)


_WORKSPACE = Workspace()  # the process's pool, which every layer shares


def empty(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`Workspace.empty` of the process's pool: an uninitialised contiguous tensor, pooled when large and on the CPU."""
    return _WORKSPACE.empty(shape, dtype, device)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, t.dtype, t.device)


def clear() -> None:
    """Forget the process pool's storages (they are freed once no tensor uses them)."""
    _WORKSPACE.clear()


def held_bytes() -> int:
    """Bytes of the storages the process's pool holds now."""
    return _WORKSPACE.held_bytes()
