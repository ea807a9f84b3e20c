"""A simulated world of GPUs on this CPU: the "fake" process group at any world size, the model on meta.

The fake backend accepts every collective at any world size without moving data; meta tensors carry
shapes and devices but no values, run forward and backward, and raise on a host read (`.item()`,
`.tolist()`, `nonzero`) and when they meet a CPU tensor. So a training step on meta takes the branches
a CUDA run takes (every `device.type == "cpu"` test is false, the Triton launchers are custom ops
whose fake implementations give shapes) and fails where a GPU run would sync with the host or hand a
CPU tensor to NCCL. What it cannot check: values, speed, and the split sizes packed and grouped
expert parallelism read from the device; `even_splits` supplies those.

`simulated_world(world_size, rank)` sets this up and undoes it:
- the fake process group; the engine's device is meta (`optim.engine.local_device`);
- fully_shard on a "meta" mesh: FSDP asks the mesh's device module for streams and the current
  device, which meta lacks, so the CPU's (no-op) stream module stands in, and FSDP's check that no
  parameter is left on meta is skipped;
- MOE_KERNELS=triton, so the dispatch ops take their Triton (custom op) branches;
- `CollectiveLog`: every collective's tensors must be on the model's device, recorded by name.
"""

import contextlib
import functools

import torch
import torch.distributed as dist

COLLECTIVES = ("all_to_all_single", "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast",
               "all_gather", "reduce_scatter", "all_gather_single", "reduce_scatter_single", "all_to_all")
META = torch.device("meta")


class CollectiveLog:
    """Wraps torch.distributed's collectives: checks each tensor's device and counts the calls."""

    def __init__(self, device: torch.device):
        self.device, self.calls = device, []

    def _check(self, name, value):
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                assert local.device.type == self.device.type, \
                    f"{name} got a tensor on {local.device}, the model is on {self.device} (NCCL refuses it)"

    def wrap(self, name, function):
        @functools.wraps(function)
        def recorded(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                self._check(name, value)
            self.calls.append(name)
            return function(*args, **kwargs)

        return recorded

    def count(self, name: str) -> int:
        return self.calls.count(name)


def _patch_fsdp_for_meta(monkeypatch) -> None:
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state, _fully_shard,
    )

    original = device_mesh._get_device_handle

    def handle(device_type: str = "cuda"):
        return torch.cpu if device_type == "meta" else original(device_type)

    for module in (_fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state):
        if hasattr(module, "_get_device_handle"):
            monkeypatch.setattr(module, "_get_device_handle", handle)
    monkeypatch.setattr(_fully_shard, "_get_device_from_mesh", lambda mesh: torch.device(mesh.device_type))
    monkeypatch.setattr(_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params", lambda self: None)


@contextlib.contextmanager
def simulated_world(monkeypatch, world_size: int, rank: int):
    """The fake process group of `world_size` (this process is `rank`), the engine on meta; yields a CollectiveLog."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from parallel import reset_groups

    reset_groups()
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    log = CollectiveLog(META)
    try:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                monkeypatch.setattr(dist, name, log.wrap(name, getattr(dist, name)))
        monkeypatch.setattr("optim.engine.local_device", lambda: META)
        monkeypatch.setenv("MOE_KERNELS", "triton")
        _patch_fsdp_for_meta(monkeypatch)
        yield log
    finally:
        reset_groups()
        dist.destroy_process_group()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions by mesh, and meshes of two worlds compare equal whatever
    their process groups: without this a later world is handed a destroyed world's mesh."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, type(propagator)._propagate_tensor_meta_cached,
                   _redistribute._gen_transform_infos, _collective_utils.MeshTopoInfo.build_from_mesh):
        cached.cache_clear()


def even_splits(monkeypatch, rows_per_rank: int) -> list[str]:
    """Supply the split sizes packed and grouped layouts read from the device (meta holds none).

    Every rank is taken to keep `rows_per_rank` rows per MoE layer, spread evenly over experts and
    ranks. Returns the list that each host read appends to, so a test can count them.
    """
    from moe import expert_parallel

    reads = []

    def spread(total: int, parts: int) -> list[int]:
        return [total // parts + (i < total % parts) for i in range(parts)]

    def read_counts(counts_E):
        assert counts_E.device == META
        reads.append("counts")
        return spread(rows_per_rank, counts_E.shape[0])

    def read_exchange(send_RL, recv_RL):
        assert send_RL.device == META and recv_RL.device == META
        reads.append("exchange")
        ranks, local = send_RL.shape
        per_rank = spread(rows_per_rank, ranks)
        return per_rank, per_rank, spread(rows_per_rank, local)

    monkeypatch.setattr(expert_parallel, "read_counts", read_counts)
    monkeypatch.setattr(expert_parallel, "read_exchange", read_exchange)
    return reads


def no_overflow_read(monkeypatch) -> list:
    """The fp16 step's one host read (the overflow flag) answered False on meta; returns the reads."""
    reads = []

    def read_flag(flag):
        assert flag.device == META, f"the overflow flag is on {flag.device}"
        reads.append(flag)
        return False

    monkeypatch.setattr("optim.engine.read_flag", read_flag)
    return reads


def zero_stats_read(monkeypatch) -> list:
    """TensorBoard's once-per-step read of the summed statistics answered with zeros on meta."""
    reads = []

    def read_stats(flat):
        assert flat.device == META, f"the statistics are on {flat.device}"
        reads.append(flat)
        return torch.zeros(flat.shape, dtype=flat.dtype)

    monkeypatch.setattr("optim.monitor.read_stats", read_stats)
    return reads
