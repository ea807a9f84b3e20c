"""A simulated world of GPUs on this CPU: the "fake" process group at any world size, the model on meta.

The fake backend accepts every collective at any world size without moving data; meta tensors carry
shapes and devices but no values, run forward and backward, and raise on a host read (`.item()`,
`.tolist()`, `nonzero`) and when they meet a CPU tensor. So a training step on meta takes the branches
a CUDA run takes (every `device.type == "cpu"` test is false; the Triton launchers are torch custom
ops whose fake implementations give shapes) and fails where a GPU run would read a device value on
the host. What it cannot show: values, speed, and the numbers a run must read on the host. Those
reads go through a few named functions, which `HostReads` answers here:

- the split sizes of packed and grouped layouts (`moe.dispatch.local.read_counts`,
  `moe.dispatch.expert_parallel.read_exchange`, `moe.dispatch.per_rank.read_pair_exchange`):
  every rank is taken to keep `rows_per_rank` rows per MoE layer, spread evenly;
- the overflow flag (`optim.nonfinite.read_flag`: fp16's, or the non-finite guard of fp32/bf16 steps): no overflow;
- a capturable step's skip counters (`optim.nonfinite.read_skip_counts`, when the engine reports): none skipped;
- TensorBoard's summed statistics (`optim.monitor.read_stats`): zeros;
- the recipes' evaluation sums (`recipes.common.training.read_sums`): ones.

The optimizer is torch's fused one, as on a GPU: meta counts as a device its fused kernels run on,
and the in-place fused steps torch registers no meta kernel for (a tensor learning rate, SGD) get one
that checks their tensors' devices and changes nothing.

`simulated_world(world_size, rank)` also points the engine at the meta device and lets fully_shard
work on a "meta" mesh (FSDP asks the mesh's device module for streams and its current device, which
meta lacks, so the CPU's no-op stream module stands in; its check that no parameter is left on meta
is skipped). Used by `recipes.estimate` and by the simulated GPU tests.
"""

import contextlib
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.distributed as dist

__all__ = ["META", "HostReads", "simulated_world"]

META = torch.device("meta")


def _spread(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


@dataclass
class HostReads:
    """Answers, and records, the host reads of a simulated step.

    Args:
        rows_per_rank: rows each rank keeps per MoE layer (tokens x top-k without dropping).
    """

    rows_per_rank: int = 0
    reads: list = field(default_factory=list)

    def read_counts(self, counts_E: torch.Tensor) -> list[int]:
        assert counts_E.device == META, f"counts on {counts_E.device}"
        self.reads.append("counts")
        return _spread(self.rows_per_rank, counts_E.shape[0])

    def read_exchange(self, send_RL: torch.Tensor, recv_RL: torch.Tensor):
        assert send_RL.device == META and recv_RL.device == META, "exchanged counts must stay on the device"
        self.reads.append("exchange")
        ranks, local = send_RL.shape
        per_rank = _spread(self.rows_per_rank, ranks)
        return per_rank, per_rank, _spread(self.rows_per_rank, local)

    def read_pair_exchange(self, send_RX: torch.Tensor, recv_RX: torch.Tensor):
        assert send_RX.device == META and recv_RX.device == META, "exchanged counts must stay on the device"
        self.reads.append("pair exchange")
        ranks, local = send_RX.shape[0], send_RX.shape[1] - 1
        per_rank = _spread(self.rows_per_rank, ranks)
        return per_rank, per_rank, _spread(self.rows_per_rank, local)

    def read_flag(self, flag: torch.Tensor) -> bool:
        assert flag.device == META, f"the overflow flag is on {flag.device}"
        self.reads.append("overflow flag")
        return False

    def read_skip_counts(self, counts: torch.Tensor) -> list[int]:
        assert counts.device == META, f"the skip counters are on {counts.device}"
        self.reads.append("skips")
        return [0] * counts.numel()

    def read_stats(self, flat: torch.Tensor) -> torch.Tensor:
        assert flat.device == META, f"the statistics are on {flat.device}"
        self.reads.append("statistics")
        return torch.zeros(flat.shape, dtype=flat.dtype)

    def read_sums(self, tensor: torch.Tensor) -> list[float]:
        assert tensor.device == META, f"the recipe's sums are on {tensor.device}"
        self.reads.append("sums")
        return [1.0] * tensor.numel()  # no values on meta: ones keep the recipe's divisions finite

    def count(self, what: str) -> int:
        return self.reads.count(what)


def _fsdp_on_meta(stack: contextlib.ExitStack) -> None:
    from torch.distributed import device_mesh
    from torch.distributed.fsdp._fully_shard import (
        _fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state, _fully_shard,
    )

    original = device_mesh._get_device_handle

    def handle(device_type: str = "cuda"):
        return torch.cpu if device_type == "meta" else original(device_type)

    # device_mesh's own: DTensor's redistribution costs (torch 2.14) ask it for the devices per host
    for module in (device_mesh, _fsdp_collectives, _fsdp_init, _fsdp_param_group, _fsdp_state):
        if hasattr(module, "_get_device_handle"):
            stack.enter_context(mock.patch.object(module, "_get_device_handle", handle))
    stack.enter_context(mock.patch.object(_fully_shard, "_get_device_from_mesh",
                                          lambda mesh: torch.device(mesh.device_type)))
    stack.enter_context(mock.patch.object(_fsdp_param_group.FSDPParamGroup, "_validate_no_meta_params",
                                          lambda self: None))


_FUSED_STEPS = ("_fused_adamw_.tensor_lr", "_fused_adam_.tensor_lr", "_fused_sgd_", "_fused_sgd_.tensor_lr")
_meta_steps = None  # the library holding their meta kernels, registered once per process


def _fused_step_on_meta(*args, **kwargs) -> None:
    tensors = [t for arg in (*args, *kwargs.values()) for t in (arg if isinstance(arg, (list, tuple)) else [arg])
               if isinstance(t, torch.Tensor)]
    assert all(t.device == META for t in tensors), "a fused optimizer step met a tensor off the device"


def _fused_optimizers_on_meta(stack: contextlib.ExitStack) -> None:
    global _meta_steps
    from torch.optim import optimizer as torch_optimizer

    from optim import optimizer

    if _meta_steps is None:
        _meta_steps = torch.library.Library("aten", "IMPL")
        for name in _FUSED_STEPS:
            overload = getattr(getattr(torch.ops.aten, name.split(".")[0]), (name.split(".") + ["default"])[1])
            if not torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), "Meta"):
                _meta_steps.impl(name, _fused_step_on_meta, "Meta")
    devices = torch_optimizer._get_fused_kernels_supported_devices
    stack.enter_context(mock.patch.object(torch_optimizer, "_get_fused_kernels_supported_devices",
                                          lambda: [*devices(), "meta"]))
    stack.enter_context(mock.patch.object(optimizer, "_FUSED_DEVICES", {*optimizer._FUSED_DEVICES, "meta"}))


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding decisions by mesh, and meshes of two worlds compare equal."""
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, type(propagator)._propagate_tensor_meta_cached,
                   _redistribute._gen_transform_infos, _collective_utils.MeshTopoInfo.build_from_mesh):
        cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:  # the C++ fast path keeps its own cache of sharding decisions
        clear_native()


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0, rows_per_rank: int = 0):
    """The fake process group of `world_size` (this process is `rank`), the engine on meta; yields HostReads.

    Raises:
        RuntimeError: a process group is already initialised.
        ValueError: rank is not in [0, world_size).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from moe.dispatch import expert_parallel, local, per_rank
    from optim import engine, monitor, nonfinite
    from parallel import reset_groups
    from recipes.common import training

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the simulated world needs its own process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    reset_groups()
    _clear_dtensor_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    reads = HostReads(rows_per_rank)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(engine, "local_device", lambda: META))
            stack.enter_context(mock.patch.dict("os.environ", {"MOE_KERNELS": "triton"}))
            for module, name in ((local, "read_counts"), (expert_parallel, "read_exchange"),
                                 (per_rank, "read_pair_exchange"),
                                 (nonfinite, "read_flag"), (nonfinite, "read_skip_counts"), (monitor, "read_stats"),
                                 (training, "read_sums")):
                stack.enter_context(mock.patch.object(module, name, getattr(reads, name)))
            _fsdp_on_meta(stack)
            _fused_optimizers_on_meta(stack)
            yield reads
    finally:
        reset_groups()
        dist.destroy_process_group()
