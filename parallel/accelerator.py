"""The process's accelerator: device names, seeds, memory figures and the backend, one object per process.

`get_accelerator()` answers the questions a training script asks about its device without naming CUDA
or the CPU: `torch.device(get_accelerator().current_device_name())`, `get_accelerator().manual_seed_all(s)`,
`get_accelerator().memory_allocated()`. It is CUDA when `torch.cuda.is_available()` at the first call,
else the CPU, and stays that for the life of the process. DeepSpeed's variable `DS_ACCELERATOR=cpu`
keeps a process off the GPUs (gloo, CPU tensors), as there; `DS_ACCELERATOR=cuda` insists on CUDA.

The names, arguments and return types are DeepSpeed's accelerator surface, so scripts written against
it run with the import renamed. Where the CPU answers differ (DeepSpeed's CPU accelerator prefers the
"ccl" backend and counts NUMA nodes as devices), the CPU accelerator here says what this project does:
gloo, one device unless LOCAL_SIZE says more. Each method's docstring states its CPU meaning.
"""

import os

import torch

__all__ = ["Accelerator", "accelerator_name", "get_accelerator"]

ACCELERATOR_NAMES = ("cuda", "cpu")


class Accelerator:
    """What both accelerators share: names, the device for an index, and tensor placement.

    Attributes:
        _name: "cuda" or "cpu" (the attribute DeepSpeed scripts compare); `name` is the same.
    """

    _name = ""

    @property
    def name(self) -> str:
        return self._name

    def device(self, device_index: int | None = None) -> torch.device:
        """The torch.device for an index (the current device's type when None)."""
        return torch.device(self._name, device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether the tensor lives on this accelerator's device type."""
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CudaAccelerator(Accelerator):
    """The accelerator when CUDA is available: thin calls into torch.cuda, collectives over nccl."""

    _name = "cuda"

    def device_name(self, device_index: int | None = None) -> str:
        """ "cuda", or "cuda:i" for an index."""
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        """fp16 tensor cores: compute capability 7 (Volta) or newer."""
        return torch.cuda.get_device_capability()[0] >= 7

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.get_device_properties(self.current_device() if device_index is None else device_index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        return torch.cuda.mem_get_info(device_index)[0]

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked copy, so host-to-device copies can overlap compute."""
        return tensor.pin_memory()


class CpuAccelerator(Accelerator):
    """The accelerator without CUDA: the CPU is the device, gloo carries the collectives.

    Memory figures are the process's resident set size (what a CPU run holds), read from
    /proc/self/statm where there is one, else 0; the peak is the largest value seen by calls since
    construction or the last reset.
    """

    _name = "cpu"

    def __init__(self):
        self._peak_rss = self._rss()

    def device_name(self, device_index: int | None = None) -> str:
        """ "cpu", whatever the index."""
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        """torch.device("cpu") whatever the index (DeepSpeed's CPU accelerator returns None here)."""
        return torch.device("cpu")

    def current_device(self) -> int:
        """LOCAL_RANK as an int (0 without it): the process's slot on the node."""
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, device_index: int) -> None:
        """Nothing to select on the CPU."""

    def device_count(self) -> int:
        """LOCAL_SIZE when set and positive (processes on this node), else 1."""
        count = int(os.environ.get("LOCAL_SIZE", 0))
        return count if count > 0 else 1

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        """ "gloo": the backend this project runs on the CPU (DeepSpeed's CPU accelerator prefers "ccl")."""
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has fast fp16 kernels on this CPU; fp16 still computes without them, slowly."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU work is synchronous: nothing to wait for."""

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to empty."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        """The process's resident set size in bytes."""
        rss = self._rss()
        self._peak_rss = max(self._peak_rss, rss)
        return rss

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """The largest resident set size seen since construction or the last reset, in bytes."""
        return max(self._peak_rss, self.memory_allocated())

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._peak_rss = self._rss()

    def memory_reserved(self, device_index: int | None = None) -> int:
        """What the process holds: its resident set size, as `memory_allocated`."""
        return self.memory_allocated(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        """The machine's physical memory in bytes (0 where the system does not say)."""
        return self._meminfo("MemTotal:") or _sysconf_bytes("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        """Memory the system could give without swapping, in bytes (Linux MemAvailable; 0 where unknown)."""
        return self._meminfo("MemAvailable:") or _sysconf_bytes("SC_AVPHYS_PAGES")

    @staticmethod
    def _meminfo(field: str) -> int:
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith(field):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor itself: pinning is for copies to a GPU, and there is none."""
        return tensor

    @staticmethod
    def _rss() -> int:
        """Resident set size in bytes from /proc (Linux), 0 where that file is missing."""
        try:
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0


def _sysconf_bytes(pages: str) -> int:
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


_accelerator: Accelerator | None = None


def accelerator_name() -> str:
    """"cuda" or "cpu": DS_ACCELERATOR when it is set, else "cuda" when torch.cuda.is_available().

    Raises:
        ValueError: DS_ACCELERATOR names another accelerator, or "cuda" where torch sees no GPU.
    """
    forced = os.environ.get("DS_ACCELERATOR", "")
    if not forced:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if forced not in ACCELERATOR_NAMES:
        raise ValueError(f"DS_ACCELERATOR must be one of {list(ACCELERATOR_NAMES)} or unset, got {forced!r}")
    if forced == "cuda" and not torch.cuda.is_available():
        raise ValueError("DS_ACCELERATOR='cuda', but torch sees no CUDA device here; unset it or use 'cpu'")
    return forced


def get_accelerator() -> Accelerator:
    """The process's accelerator, made at the first call: see `accelerator_name`.

    Returns:
        The same `CudaAccelerator` or `CpuAccelerator` object on every call.
    """
    global _accelerator
    if _accelerator is None:
        _accelerator = CudaAccelerator() if accelerator_name() == "cuda" else CpuAccelerator()
    return _accelerator
