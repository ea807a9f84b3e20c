"""`parallel.get_accelerator()`: DeepSpeed's accelerator names, values and return types.

Values marked "DeepSpeed 0.19.8" were read from `deepspeed.accelerator.get_accelerator()` (its
CPU_Accelerator, without oneCCL bindings, LOCAL_SIZE unset, one NUMA node) on this machine:
_name 'cpu'; device_name() and device_name(0) 'cpu'; current_device_name() 'cpu'; current_device() 0
without LOCAL_RANK (the string '3' with LOCAL_RANK=3, where ours gives the int 3); set_device(0) None;
device_count() 1; is_available() True; communication_backend_name() 'gloo'; is_bf16_supported() True;
synchronize() None; manual_seed(1) a torch.Generator; empty_cache() None; memory_allocated() and
max_memory_allocated() ints; reset_peak_memory_stats() None; pin_memory(t) is t; on_accelerator(cpu
tensor) True; get_accelerator() the same object on every call. DeepSpeed's device(0) on the CPU is
None where ours is torch.device("cpu"), and its is_fp16_supported() is None where ours is False.
The CUDA branch is exercised in a simulated GPU world: torch.cuda's queries patched, tensors on fake CUDA.
"""

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parallel
from parallel import accelerator as accelerator_module
from parallel import get_accelerator


@pytest.fixture
def fresh(monkeypatch):
    """A fresh process-wide accelerator for this test (get_accelerator makes it at the first call)."""
    monkeypatch.setattr(accelerator_module, "_accelerator", None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)


def test_exported_from_parallel():
    assert "get_accelerator" in parallel.__all__ and parallel.get_accelerator is get_accelerator


def test_cpu_values_and_types_match_deepspeed(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = get_accelerator()
    assert get_accelerator() is acc
    assert acc._name == "cpu" and acc.name == "cpu"
    assert acc.device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device_name() == "cpu"
    assert acc.current_device() == 0 and type(acc.current_device()) is int
    assert acc.set_device(0) is None
    assert acc.device_count() == 1 and type(acc.device_count()) is int
    assert acc.is_available() is True
    assert acc.communication_backend_name() == "gloo"
    assert acc.is_bf16_supported() is True
    assert type(acc.is_fp16_supported()) is bool
    assert acc.synchronize() is None and acc.synchronize(0) is None
    assert isinstance(acc.manual_seed(1), torch.Generator) and isinstance(acc.manual_seed_all(1), torch.Generator)
    assert acc.empty_cache() is None
    assert acc.device(0) == torch.device("cpu") and acc.device() == torch.device("cpu")
    t = torch.zeros(3)
    assert acc.pin_memory(t) is t
    assert acc.on_accelerator(t) is True


def test_cpu_seeds_the_default_generator(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    get_accelerator().manual_seed_all(7)
    first = torch.rand(4)
    get_accelerator().manual_seed(7)
    assert torch.equal(first, torch.rand(4))


def test_cpu_local_rank_and_local_size(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_SIZE", "4")
    acc = get_accelerator()
    assert acc.current_device() == 3 and type(acc.current_device()) is int
    assert acc.device_count() == 4


def test_cpu_memory_is_resident_set_and_peak_follows_it(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = get_accelerator()
    before = acc.memory_allocated()
    assert type(before) is int and before > 0
    assert acc.reset_peak_memory_stats() is None
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched, so resident
    during = acc.memory_allocated()
    assert during >= before + 32 * 2**20
    del block
    peak = acc.max_memory_allocated()
    assert type(peak) is int and peak >= during


class _FakeCuda:
    """torch.cuda's queries for an 8-GPU node, current device 3, Ampere; records what was called."""

    def __init__(self, monkeypatch):
        self.calls = []
        answers = {"is_available": True, "device_count": 8, "current_device": 3, "is_bf16_supported": True,
                   "get_device_capability": (8, 0), "memory_allocated": 1024, "max_memory_allocated": 4096,
                   "memory_reserved": 2048, "max_memory_reserved": 8192, "mem_get_info": (5 << 30, 80 << 30),
                   "get_device_properties": type("Properties", (), {"total_memory": 80 << 30})()}
        for name, value in answers.items():
            monkeypatch.setattr(torch.cuda, name, self._answer(name, value))
        for name in ("set_device", "synchronize", "manual_seed", "manual_seed_all", "empty_cache",
                     "reset_peak_memory_stats"):
            monkeypatch.setattr(torch.cuda, name, self._answer(name, None))

    def _answer(self, name, value):
        def call(*args):
            self.calls.append((name, *args))
            return value
        return call


def test_cuda_names_devices_and_backend(fresh, monkeypatch):
    cuda = _FakeCuda(monkeypatch)
    acc = get_accelerator()
    assert acc._name == "cuda" and get_accelerator() is acc
    assert acc.device_name() == "cuda" and acc.device_name(5) == "cuda:5"
    assert acc.current_device() == 3 and acc.current_device_name() == "cuda:3"
    assert acc.device(2) == torch.device("cuda", 2) and acc.device() == torch.device("cuda")
    assert acc.device_count() == 8 and acc.is_available() is True
    assert acc.communication_backend_name() == "nccl"
    assert acc.is_bf16_supported() is True and acc.is_fp16_supported() is True
    acc.set_device(1)
    acc.synchronize()
    acc.synchronize(2)
    acc.manual_seed(5)
    acc.manual_seed_all(6)
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    assert acc.memory_allocated() == 1024 and acc.max_memory_allocated(0) == 4096
    assert ("set_device", 1) in cuda.calls and ("synchronize", None) in cuda.calls and ("synchronize", 2) in cuda.calls
    assert ("manual_seed", 5) in cuda.calls and ("manual_seed_all", 6) in cuda.calls
    assert ("empty_cache",) in cuda.calls and ("reset_peak_memory_stats", None) in cuda.calls
    assert ("max_memory_allocated", 0) in cuda.calls
    assert (acc.memory_reserved(), acc.max_memory_reserved()) == (2048, 8192)
    assert (acc.total_memory(), acc.available_memory()) == (80 << 30, 5 << 30)
    assert ("get_device_properties", 3) in cuda.calls  # the current device's


def test_cuda_fp16_needs_volta(fresh, monkeypatch):
    _FakeCuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *device: (6, 1))
    assert get_accelerator().is_fp16_supported() is False


def test_cuda_on_accelerator_by_device_type(fresh, monkeypatch):
    with FakeTensorMode():  # made before torch.cuda is patched: on a real GPU machine too it names cuda:0
        on_gpu = torch.empty(4, device="cuda:0")
    _FakeCuda(monkeypatch)
    acc = get_accelerator()
    assert acc.on_accelerator(on_gpu) is True
    assert acc.on_accelerator(torch.zeros(4)) is False


def test_cpu_reserved_total_and_available_memory(fresh, monkeypatch):
    """As DeepSpeed's CPU accelerator: reserved is the resident set, total and available the machine's."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = get_accelerator()
    reserved = acc.memory_reserved()
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert abs(reserved - resident) < 8 << 20 and acc.max_memory_reserved() >= reserved
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    assert acc.total_memory() == fields["MemTotal"]
    assert 0 < acc.available_memory() <= acc.total_memory()


def test_ds_accelerator_cpu_keeps_a_gpu_machine_on_the_cpu(fresh, monkeypatch):
    """DeepSpeed's DS_ACCELERATOR=cpu: the CPU accelerator, gloo and CPU devices beside visible GPUs."""
    _FakeCuda(monkeypatch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_RANK", "5")
    acc = get_accelerator()
    assert acc._name == "cpu" and acc.communication_backend_name() == "gloo"
    assert parallel.local_device() == torch.device("cpu")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert parallel.accelerator_name() == "cuda" and parallel.local_device() == torch.device("cuda", 5)


def test_ds_accelerator_rejects_what_it_cannot_give(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR must be one of \['cuda', 'cpu'\] or unset, got 'xpu'"):
        get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='cuda', but torch sees no CUDA device"):
        parallel.local_device()
    monkeypatch.setenv("DS_ACCELERATOR", "")
    assert get_accelerator()._name == "cpu"


def test_init_distributed_takes_its_backend_from_the_accelerator(fresh, monkeypatch):
    """nccl on a (fake) 8-GPU node, on cuda:LOCAL_RANK; gloo with DS_ACCELERATOR=cpu, and nccl refused there."""
    from parallel import distributed

    cuda = _FakeCuda(monkeypatch)
    backends = []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda backend, timeout: backends.append(backend))
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 5)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 8)
    for name, value in (("RANK", "5"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1"),
                        ("LOCAL_RANK", "5")):
        monkeypatch.setenv(name, value)
    assert parallel.init_distributed() == (5, 8)
    assert backends == ["nccl"] and ("set_device", torch.device("cuda", 5)) in cuda.calls
    cuda.calls.clear()
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert parallel.init_distributed() == (5, 8)
    assert backends == ["nccl", "gloo"] and not any(name == "set_device" for name, *_ in cuda.calls)
    with pytest.raises(ValueError, match="backend 'nccl' needs GPUs, but this process runs on the CPU"):
        parallel.init_distributed(backend="nccl")
