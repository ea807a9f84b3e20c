"""Pieces the recipes share: the console progress line, sums over all processes, the CPU's name."""

import platform
import sys
import time

import torch
import torch.distributed as dist


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

    Args:
        total_steps: the step the run ends at.
        first_step: the step the run starts from (after a resume).
        tokens_per_step: tokens (or samples) per optimizer step over all processes.
        unit: what tokens_per_step counts ("tok" or "img").
        enabled: False on every rank but 0.
    """

    def __init__(self, total_steps: int, first_step: int, tokens_per_step: int, unit: str = "tok",
                 enabled: bool = True):
        self.total_steps, self.first_step, self.tokens_per_step = total_steps, first_step, tokens_per_step
        self.unit, self.enabled = unit, enabled
        self.start = self.last_time = time.perf_counter()
        self.last_step = first_step
        self.live = enabled and sys.stdout.isatty()

    def rate(self, step: int) -> float:
        """Tokens per second since the previous call (restarts the interval)."""
        now = time.perf_counter()
        rate = (step - self.last_step) * self.tokens_per_step / max(now - self.last_time, 1e-9)
        self.last_step, self.last_time = step, now
        return rate

    def line(self, step: int, rate: float, **values: float) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        done = step - self.first_step
        eta = elapsed / done * (self.total_steps - step) if done else 0.0
        fields = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        text = (f"step {step}/{self.total_steps}  {fields}  {rate:,.0f} {self.unit}/s  "
                f"elapsed {duration(elapsed)}  ETA {duration(eta)}")
        print(("\r" + text.ljust(110)) if self.live else text, end="" if self.live else "\n", flush=True)

    def message(self, text: str) -> None:
        """A line that stays (after the live line, if any)."""
        if self.enabled:
            print(("\n" if self.live else "") + text, flush=True)


def cpu_name() -> str:
    """The CPU model (Linux's /proc/cpuinfo), so that a speed figure says where it was taken."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
