"""The CPU's speed choices: which implementation runs each shape class, measured once and kept.

A shape class (`shape_key`) names a kind of call ("linear", "linear_tn", a layer's plan "mlp"), its
rows N rounded up to a power of two, its widths, dtype and operand layouts. The first time a class is
met, every candidate runs on the actual operands, alternating, and the fastest minimum time wins (a
call of DROP_FROM_SECONDS or more over DROP_SLOWER_THAN times the fastest after a round is not timed
again, nor one over FIRST_SLOWER_THAN times the fastest at its first call). Timing expected to take
over NOTICE_SECONDS is announced once per process on stderr. Threads that meet a new class together
may each measure it; the first choice stored is the one every caller uses. A choice is kept for the
rest of the process and never revised, so two identical runs in one process make the same choices
and give bitwise equal results.

All of this state (the choices, their fast index, the locks, the cache file read) lives in one
`CpuBackend` object; `backend` is the process's. Checkpoints record `choices()` and a resumed run
adopts them (`adopt`). MOE_CPU_GEMM_CACHE=<file.json> keeps choices across processes (entries are
kept per CPU, as `cpu_model` describes it, torch version and thread count).
"""

import functools
import itertools
import json
import logging
import os
import platform
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from kernels.cpu import threads

__all__ = ["CpuBackend", "backend", "class_rows", "cpu_model", "shape_key"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float64: "float64"}
# timed calls per candidate, alternating, after one warm-up call each; the least of three, also for
# calls of seconds (a layer's plan): one timing on a shared machine picks at random between candidates
# 5% apart
_ROUNDS = 3
# after a round, a candidate this much slower than the fastest is timed no more, if its call takes at
# least DROP_FROM_SECONDS: at that length a gap three times the 5% above is not the machine's noise,
# and at a layer's size a candidate costs seconds a call; shorter calls are cheap to time every round
DROP_SLOWER_THAN = 1.15
DROP_FROM_SECONDS = 0.1
# a candidate whose first call took over this many times the fastest first call is not timed at all
# (a call of DROP_FROM_SECONDS or more that measured no products inside it: the first call of a layer's
# plan times its products' backends, seconds that say nothing of the plan). First calls carry one-time
# costs (fresh pages, worker threads starting, oneDNN's primitives) and a shared machine may stall one,
# hence a margin far wider than a round's; what it spares are candidates slower by orders of magnitude,
# such as torch's half-precision loops on a CPU without half-precision multiply-adds
FIRST_SLOWER_THAN = 4.0
NOTICE_SECONDS = 10.0  # measuring expected to take longer than this is announced (once per process)
_log = logging.getLogger("kernels.gemm")  # the name users filter its notice by


class CpuBackend:
    """The measured choices of one process: shape class -> implementation name, with the locks that
    keep them consistent across threads and the optional file that keeps them across processes."""

    def __init__(self):
        self._choices: dict[str, str] = {}
        self._fast: dict[tuple, str] = {}  # the hot path's index of _choices, by the parts of the key
        self._loaded_from: str | None = None
        self._noticed = False
        self._choosing = threading.Lock()  # concurrent workers may measure one class at once: the first result stands
        self._loading = threading.Lock()  # the cache file is read once, whichever thread gets there first
        self._tickets = itertools.count()  # one number per measurement begun and per first call, on any thread (atomic)

    def choose(self, key: str, runs: dict) -> str:
        """The implementation measured fastest for the shape class `key`, measured on its first call(s).

        Threads that meet a new class at once each measure it; the first choice stored is returned to all.

        Args:
            key: the shape class (see `shape_key`); a choice once made is kept for the process.
            runs: name -> a call without arguments that runs that implementation on the actual operands.

        Returns:
            The chosen name: the kept choice when there is one, else the fastest of `runs`.
        """
        self._load()
        choice = self._choices.get(key)
        if choice in runs:
            return choice
        measured = self._measure(runs)
        with self._choosing:  # another thread may have chosen meanwhile: its choice stands, so every call agrees
            choice = self._choices.get(key)
            if choice not in runs:
                choice = self._choices[key] = measured
                self._save()
        return choice

    def resolve(self, fast_key: tuple, key_parts: tuple, names: tuple[str, ...], run) -> str:
        """The choice among `names` for a product's shape class.

        `fast_key`, a tuple of exactly what the class's string key is made of, is looked up first,
        without building the string (`shape_key(*key_parts)`); one name is taken untimed; else the kept
        choice, or the fastest of run(name) for each name.
        """
        choice = self._fast.get(fast_key)
        if choice is not None:
            return choice
        key = shape_key(*key_parts)
        self._load()
        choice = self._choices.get(key)
        if len(names) == 1:  # one backend runs here (e.g. widened half precision): taken untimed
            if choice is not None and choice != names[0]:  # adopted or read from elsewhere, never run here
                with self._choosing:
                    self._choices[key] = names[0]
            choice = names[0]
        elif choice not in names:
            choice = self.choose(key, {name: functools.partial(run, name) for name in names})
        self._fast[fast_key] = choice  # a choice once made is never revised (see adopt), so it may be kept here
        return choice

    def kept(self, key: str) -> str | None:
        """The choice kept for the shape class `key` (made here, adopted or read from the cache file), or None."""
        self._load()
        return self._choices.get(key)

    def choices(self) -> dict[str, str]:
        """The implementation chosen for each shape class met so far ("kind|rows|widths|dtype|layouts" -> name)."""
        return dict(self._choices)

    def adopt(self, chosen: dict[str, str]) -> None:
        """Use `chosen` (a `choices()` of another process, e.g. the one that wrote a checkpoint) for every
        shape class this process has not met yet; a choice already used here stays (invariant: two
        identical runs in one process multiply alike).

        Raises:
            ValueError: `chosen` is not a mapping of shape-class strings to implementation names.
        """
        if not isinstance(chosen, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in chosen.items()):
            raise ValueError(f"GEMM choices must map shape classes to implementation names, got {chosen!r}")
        self._load()
        for key, value in chosen.items():
            self._choices.setdefault(key, value)

    def clear(self) -> None:
        """Forget every choice (tests; a later call measures again)."""
        self._choices.clear()
        self._fast.clear()
        self._loaded_from = None

    # --- measuring ------------------------------------------------------------------------------

    def _measure(self, runs: dict) -> str:
        """The name in `runs` whose call took the least time: each called once to warm up, then alternately;
        after the warm-up, a candidate over FIRST_SLOWER_THAN times the fastest first call, and after each
        round, one over DROP_SLOWER_THAN times the fastest so far, is timed no more (calls of
        DROP_FROM_SECONDS or more; at the warm-up only calls that measured nothing inside them)."""
        next(self._tickets)
        started = time.perf_counter()
        first, clean = {}, set()
        for done, (name, run) in enumerate(runs.items(), 1):
            ticket, start = next(self._tickets), time.perf_counter()
            run()
            first[name] = time.perf_counter() - start
            if next(self._tickets) == ticket + 1:  # no measurement began inside this call, on any thread
                clean.add(name)
            self._notice((time.perf_counter() - started) / done * len(runs) * (_ROUNDS + 1))
        fastest_first = min(first.values())
        slow = {name for name in clean
                if first[name] >= DROP_FROM_SECONDS and first[name] > FIRST_SLOWER_THAN * fastest_first}
        best = {name: first[name] if name in slow else float("inf") for name in runs}
        timed = {name: run for name, run in runs.items() if name not in slow}
        for _ in range(_ROUNDS):
            for name, run in timed.items():
                start = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - start)
            fastest = min(best.values())
            timed = {name: run for name, run in timed.items()
                     if best[name] <= DROP_SLOWER_THAN * fastest or best[name] < DROP_FROM_SECONDS}
        return min(runs, key=lambda name: best[name])  # ties: the first listed

    def _notice(self, expected_seconds: float) -> None:
        """Say once per process (rank 0 only, under torch.distributed), on stderr (logging's warning), that a
        first call is slow because it is timing candidates: measuring expected to take at most NOTICE_SECONDS
        passes unannounced."""
        if self._noticed or expected_seconds < NOTICE_SECONDS:
            return
        self._noticed = True
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:  # one line per job, not per rank
            return
        _log.warning("exactmoe: timing the CPU products and expert plans for a new layer shape; this first call "
                     "takes several times a normal one, once per shape class and process "
                     "(MOE_CPU_GEMM_CACHE=<file.json> keeps the choices for later runs, MOE_CPU_GEMM=blas skips "
                     "the timing; see kernels.cpu.gemm)")

    # --- the optional file of choices -----------------------------------------------------------

    def _load(self) -> None:
        """Read MOE_CPU_GEMM_CACHE once per path: choices measured earlier on this machine."""
        path = os.environ.get("MOE_CPU_GEMM_CACHE")
        if not path or path == self._loaded_from:
            return
        with self._loading:  # another thread may be reading it: marked read only once its entries are in
            if path == self._loaded_from:
                return
            try:
                with open(path) as f:
                    stored = json.load(f)
            except FileNotFoundError:
                stored = {}
            except (OSError, ValueError) as error:
                raise ValueError(f"MOE_CPU_GEMM_CACHE={path!r} is not a readable JSON file of GEMM choices: "
                                 f"{error}") from None
            entries = stored.get(machine(), {}) if isinstance(stored, dict) else None
            if not isinstance(entries, dict) or not all(isinstance(value, str) for value in entries.values()):
                raise ValueError(f"MOE_CPU_GEMM_CACHE={path!r} must map machines to "
                                 "{shape class: implementation name}")
            for key, value in entries.items():
                self._choices.setdefault(key, value)  # a choice already used in this process stays
            self._loaded_from = path

    def _save(self) -> None:
        """Write this process's choices into MOE_CPU_GEMM_CACHE atomically (other machines' entries kept)."""
        path = os.environ.get("MOE_CPU_GEMM_CACHE")
        if not path:
            return
        try:
            with open(path) as f:
                stored = json.load(f)
        except (OSError, ValueError):
            stored = {}
        stored = stored if isinstance(stored, dict) else {}
        stored[machine()] = {**stored.get(machine(), {}), **self._choices}
        folder = os.path.dirname(os.path.abspath(path))
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".gemm-", suffix=".tmp", delete=False) as f:
            json.dump(stored, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(f.name, path)


backend = CpuBackend()  # the process's choices, which every layer and product shares


# --- shape classes --------------------------------------------------------------------------------

def shape_key(kind: str, n: int, widths: tuple, dtype: torch.dtype, *operands) -> str:
    """A shape class: `kind`, N rounded up to a power of two, the widths, dtype and operand layouts."""
    layouts = "".join(map(layout_code, operands))
    return f"{kind}|{class_rows(n)}|{'x'.join(map(str, widths))}|{_DTYPE_NAMES[dtype]}|{layouts}"


def rows_class(n: int) -> int:
    """log2 of N rounded up to a power of two (0 for N <= 1)."""
    return (n - 1).bit_length() if n > 1 else 0


def class_rows(n: int) -> int:
    """N rounded up to a power of two, as a shape class counts rows."""
    return 1 << rows_class(n)


def layout_code(t: torch.Tensor | None) -> str:
    """An operand's layout in a shape class: "-" absent, "t" a transposed view, "n" row-major."""
    return "-" if t is None else "t" if t.stride(0) == 1 and t.shape[0] > 1 else "n"


# --- the machine ------------------------------------------------------------------------------------

def machine() -> str:
    """The cache file's entry for this process: on a worker of `threads.run_each`, its caller's thread count."""
    return f"{platform.machine()} {cpu_model()} torch {torch.__version__} threads {threads.caller_threads()}"


# the vector extensions that decide which products are fast: /proc/cpuinfo's flag -> its name
_CPU_FEATURES = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_bf16", "AMX"))


@functools.cache
def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, family, model number and vector extensions, as benchmarks print it and the
    cache file keys its choices: "AMD EPYC (family 25 model 17; AVX2, AVX-512, AVX512-BF16, no AMX)".

    CPUs sold under one name differ in what decides the products' speed (an "AMD EPYC" may have AVX2
    only, or AVX-512 with bf16 products). Read from Linux's /proc/cpuinfo (its first processor);
    elsewhere the platform's processor name.

    Args:
        cpuinfo: the file to read (tests give their own).
    """
    fields = {}
    try:
        with open(cpuinfo) as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends here
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "flags" not in fields:
        return name
    flags = set(fields["flags"].split())
    features = [label if flag in flags else "no " + label for flag, label in _CPU_FEATURES
                if flag in flags or label in ("AVX2", "AVX-512", "AMX")]
    numbered = "cpu family" in fields and "model" in fields
    where = f"family {fields['cpu family']} model {fields['model']}; " if numbered else ""
    return f"{name} ({where}{', '.join(features)})"
