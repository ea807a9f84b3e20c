"""Pieces the recipes share: the console progress line, sums over all processes, the CPU's name."""

import collections
import os
import re
import shutil
import socket
import sys
import time
import warnings

import torch
import torch.distributed as dist

from kernels.cpu import gemm


class SetupError(Exception):
    """A bad value found while building data, model or engine: reported in one line like a bad flag."""


def all_sum(*values, device: torch.device | str = "cpu") -> list[float]:
    """Each value (a number or a one-element tensor) summed over all processes: one all-reduce on
    `device`, the model's (NCCL takes no CPU tensors), then one host read."""
    tensor = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor)
    return read_sums(tensor)


def read_sums(tensor: torch.Tensor) -> list[float]:
    """The summed values on the host: the recipes' evaluation reads device values here only."""
    return tensor.tolist()


def duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


class Progress:
    """One console line per report: step, loss, tokens/s, elapsed time and ETA (rewritten in place on a terminal).

    The ETA extrapolates the rate of the last few reports (`WINDOW`), not the whole run's average: the
    first steps are slower (compilation, measured products, caches), and a run's speed changes. For the
    first `WARMUP_STEPS` steps it shows "ETA --", then from the second report after them on.

    Args:
        total_steps: the step the run ends at.
        first_step: the step the run starts from (after a resume).
        tokens_per_step: tokens (or samples) per optimizer step over all processes.
        unit: what tokens_per_step counts ("tok" or "img").
        enabled: False on every rank but 0.
    """

    WARMUP_STEPS = 10
    WINDOW = 5

    def __init__(self, total_steps: int, first_step: int, tokens_per_step: int, unit: str = "tok",
                 enabled: bool = True):
        self.total_steps, self.first_step, self.tokens_per_step = total_steps, first_step, tokens_per_step
        self.unit, self.enabled = unit, enabled
        self.start = self.last_time = time.perf_counter()
        self.last_step = first_step
        self.marks = collections.deque(maxlen=self.WINDOW)  # (step, time) of the recent reports after warm-up
        self.live = enabled and sys.stdout.isatty()

    def rate(self, step: int) -> float:
        """Tokens per second since the previous call (restarts the interval)."""
        now = time.perf_counter()
        rate = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        self.last_step, self.last_time = step, now
        return rate

    def eta(self, step: int, now: float) -> float | None:
        """Record a report of `step` at `now`; the seconds left at the recent reports' pace, None in warm-up."""
        if step - self.first_step >= self.WARMUP_STEPS and (not self.marks or step > self.marks[-1][0]):
            self.marks.append((step, now))
        if step >= self.total_steps:
            return 0.0
        if len(self.marks) < 2:
            return None
        (first, then), (last, at) = self.marks[0], self.marks[-1]
        return (at - then) / (last - first) * (self.total_steps - step)

    def line(self, step: int, rate: float, **values: float) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        eta = self.eta(step, now)
        fields = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        text = (f"step {step}/{self.total_steps}  {fields}  {rate:,.0f} {self.unit}/s  "
                f"elapsed {duration(now - self.start)}  ETA {'--' if eta is None else duration(eta)}")
        print(("\r" + text.ljust(110)) if self.live else text, end="" if self.live else "\n", flush=True)

    def message(self, text: str) -> None:
        """A line that stays (after the live line, if any)."""
        if self.enabled:
            print(("\n" if self.live else "") + text, flush=True)


def resumed_line(path: str, where: str, done: int, flag: str, end: int) -> str:
    """The line a resumed run prints: its checkpoint and where it stands ("at step 20", "after epoch 1"),
    and that nothing is left to train when `done` has reached the run's `end` (the value of `flag`)."""
    return f"resumed from {path} {where} {done}" + (f"; {flag} {end} are done: nothing to train" if done >= end else "")


def cpu_name() -> str:
    """The CPU's model, family and vector extensions (`kernels.cpu.choices.cpu_model`), so that a speed figure
    says where it was taken."""
    return gemm.cpu_model()


# The checkpoint folder of a run: one writer at a time, interrupted saves cleared, old checkpoints pruned.

_LOCK = ".writer.lock"


def claim_for_run(folder: str, rank: int) -> bool:
    """Rank 0 claims `folder` (see claim_checkpoint_dir); every rank raises its SetupError if that failed.
    Returns whether this process holds the lock."""
    outcome = [None]
    if rank == 0 and folder:
        try:
            claim_checkpoint_dir(folder)
        except SetupError as error:
            outcome = [str(error)]
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise SetupError(outcome[0])
    return rank == 0 and bool(folder)


def claim_checkpoint_dir(folder: str) -> None:
    """Make this process the folder's one writer (rank 0 calls it before training), or raise SetupError.

    The lock file names the host and process (and, under torchrun, its agent); one left by a process of
    this host that no longer runs (a run that was killed, restarted by torchrun) is taken over with a
    warning, and one whose agent no longer runs once its process has stopped too (within 15 s). Interrupted saves (`.<tag>.partial`,
    and `.<tag>.old` beside a whole `<tag>`) are removed.
    """
    os.makedirs(folder, exist_ok=True)
    # under torchrun the lock also names the agent (this process's parent), whose end ends the run
    agent = f" {os.getppid()}" if "TORCHELASTIC_RUN_ID" in os.environ else ""
    path, me = os.path.join(folder, _LOCK), f"{socket.gethostname()} {os.getpid()}{agent}"
    for _ in range(2):
        try:
            handle = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            with open(path) as existing:
                holder = existing.read().strip()
            host, pid, agent_pid = (holder.split() + ["", "", ""])[:3]
            if not pid.isdigit():  # written by a process killed between creating the lock and writing it
                os.remove(path)
                continue
            if host == socket.gethostname() and agent_pid and _gone(agent_pid) and not _gone(pid):
                _wait_until_gone(int(pid), 15.0)  # its agent ended: it stops within seconds (parallel.distributed)
            if host == socket.gethostname() and (int(pid) == os.getpid() or _gone(pid)):
                if int(pid) != os.getpid():
                    warnings.warn(f"--checkpoint-dir {folder}: taking over the lock of process {pid}, whose run "
                                  "ended without releasing it", stacklevel=3)
                os.remove(path)
                continue
            raise SetupError(f"--checkpoint-dir {folder} is being written by another run (host {host}, process "
                             f"{pid}); stop that run, or remove {path} if it is not running") from None
        with os.fdopen(handle, "w") as lock:
            lock.write(me)
        break
    for name in os.listdir(folder):
        if name.startswith(".") and name.endswith(".partial"):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        elif name.startswith(".") and name.endswith(".old") and os.path.isdir(os.path.join(folder, name[1:-4])):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def release_checkpoint_dir(folder: str) -> None:
    """Remove this process's lock (at the end of a run)."""
    try:
        with open(os.path.join(folder, _LOCK)) as existing:
            mine = existing.read().strip().split(" ")[:2] == [socket.gethostname(), str(os.getpid())]
        if mine:
            os.remove(os.path.join(folder, _LOCK))
    except OSError:
        pass


def prune_checkpoints(folder: str, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints up to the one `latest` names (by global step; those of
    an earlier run past it, after --start-over, are left alone); returns the deleted tags."""
    if keep_last < 1:
        return []
    with open(os.path.join(folder, "latest")) as handle:
        latest = handle.read().strip()
    last = re.fullmatch(r"global_step(\d+)", latest)
    steps = sorted((int(m[1]), name) for name in os.listdir(folder)
                   if (m := re.fullmatch(r"global_step(\d+)", name)) and os.path.isdir(os.path.join(folder, name))
                   and (last is None or int(m[1]) <= int(last[1])))
    doomed = [name for _, name in steps[:-keep_last] if name != latest]
    for name in doomed:
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return doomed


def _wait_until_gone(pid: int, seconds: float) -> None:
    deadline = time.time() + seconds
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.2)


def _gone(pid: str) -> bool:
    """Whether the process `pid` (digits) of this host has ended."""
    return pid.isdigit() and not _alive(int(pid))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
