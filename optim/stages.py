"""The ZeRO stages behind one interface: the engine's units, how their gradients are reduced, and how
the stepped weights reach the model.

- `FlatStage`, stages 0, 1 and 2: each param group in one `optim.zero.FlatGroup`, its gradients
  reduced by `optim.buckets.GradientBuckets` during the backward (stage 2 at every micro-batch,
  stages 0/1 at the last of an accumulation window), or at the boundary where no bucket serves it.
  Stage 3 without a process group is this too: alone there is nothing to shard.
- `FullyShardedStage`, stage 3: torch's `fully_shard` shards the parameters (`optim.fsdp`) and reduces
  their gradients in the backward; each parameter is an `optim.zero.ShardedParam` whose local shard
  the optimizer steps on.

The engine calls, per micro-batch, `after_forward` and `micro_step`; at the accumulation boundary
`reduce`, then the optimizer step and `write_back`; `zero_grad` after it; `settle` before a collective
outside a training step. Also here, shared by both: the offload choice and the start from the same
values on every replica. Loss scaling and dtypes are `optim.precision`'s; nothing here reads a
device value on the host.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from optim import fsdp
from optim.buckets import GradientBuckets
from optim.config import ZeroConfig
from optim.zero import FlatGroup, ParamInfo, ShardedParam
from parallel import data_before_expert, groups_for_name, is_template_copy

__all__ = ["FlatStage", "FullyShardedStage", "ZeroStage", "broadcast_initial_state", "build_stage", "offload_wanted"]


class ZeroStage:
    """What every stage does with its units (`optim.zero.Unit`); a stage overrides the steps it adds to.

    Attributes:
        units: every unit, in param-group order.
        units_by_group: the units holding each param group's parameters.
        buckets: the gradient buckets, or None.
    """

    units: list
    units_by_group: list[list]
    buckets: GradientBuckets | None = None

    def after_forward(self, module: nn.Module) -> None:
        """After each forward: nothing to do unless the stage gathered parameters for it."""

    def micro_step(self, boundary: bool) -> None:
        """After each backward: the units take in the micro-batch's gradients."""
        for unit in self.units:
            unit.micro_step()

    def reduce(self, module: nn.Module) -> list[torch.Tensor]:
        """At the accumulation boundary: finish reducing; returns each unit's gradient, shaped like its weights."""
        for unit in self.units:
            unit.refresh(module)
            unit.reduce()
        return [unit.grad() for unit in self.units]

    def write_back(self) -> None:
        """After the optimizer step: the stepped weights (copied from the optimizer's own where it steps
        on a copy) into the model's parameters."""
        for unit in self.units:
            if unit.steps_on_copy:
                unit.weights.copy_(unit.proxy.detach())
            unit.write_back()

    def zero_grad(self) -> None:
        """Clear the gradients (their buffers are kept and zeroed)."""
        for unit in self.units:
            unit.zero_grad()

    def reshard(self, module: nn.Module) -> None:
        """Free parameters gathered for a forward: nothing is gathered unless the stage shards parameters."""

    def settle(self, module: nn.Module) -> None:
        """Before collectives outside a training step: parameters sharded, units on the live storage."""
        self.reshard(module)
        for unit in self.units:
            unit.refresh(module)


class FlatStage(ZeroStage):
    """Stages 0-2: each param group in one flat buffer, sharded (1, 2) over its reduction group.

    Args:
        config: zero_optimization (stage, reduce_bucket_size, overlap_comm).
        module: the model, on its device.
        groups: the engine's param groups, `params` a list of ParamInfo.
        precision: the dtypes (`model_dtype`, `master_dtype`, `state_dtype`; optim.precision.Precision).
        offload: master weights and optimizer states in host memory.
        world_size, rank: the data-parallel world and this rank.
        device: the model's device.
        boundary: whether the micro-batch being run ends an accumulation window.
    """

    def __init__(self, config: ZeroConfig, module: nn.Module, groups: list[dict], precision, offload: bool,
                 world_size: int, rank: int, device: torch.device, boundary):
        self.world_size, self.rank = world_size, rank
        if precision.model_dtype is not None:
            module.to(precision.model_dtype)
        master_device = torch.device("cpu") if offload else device
        self.units_by_group = [[FlatGroup(group["params"], *self._reduction_group(group["params"][0]),
                                          min(config.stage, 2), precision.master_dtype, precision.state_dtype,
                                          master_device, divisor=world_size)] for group in groups]
        self.units = [unit for group_units in self.units_by_group for unit in group_units]
        self.buckets = self._build_buckets(config, module, boundary)

    def _reduction_group(self, info: ParamInfo):
        """(group, size, this rank's position) over which this parameter's gradients are summed."""
        if self.world_size == 1:
            return None, 1, 0
        if info.expert:
            groups = groups_for_name(info.group_name, info.data_before_expert)
            return (groups.edp_group if groups.edp_size > 1 else None), groups.edp_size, groups.edp_rank
        return dist.group.WORLD, self.world_size, self.rank

    def _build_buckets(self, config: ZeroConfig, module: nn.Module, boundary) -> GradientBuckets | None:
        """One sending order of gradient buckets over every flat group (the same on every rank): stage 2
        reduces each micro-batch into the shards; stages 0/1 all-reduce in the window's last backward."""
        flats = [unit.flat_shard() for unit in self.units if unit.stage == 2 or unit.group is not None]
        if not flats:
            return None
        position = {id(param): i for i, param in enumerate(module.parameters())}
        self.reduce_every_micro_batch = any(flat.all_reduce is False for flat in flats)
        active = None if self.reduce_every_micro_batch else boundary
        return GradientBuckets(flats, position, self.world_size, config.reduce_bucket_size, config.overlap_comm,
                               active)

    def micro_step(self, boundary: bool) -> None:
        if self.buckets is not None and (self.reduce_every_micro_batch or boundary):  # the rest go out
            self.buckets.finish()
        super().micro_step(boundary)

    def zero_grad(self) -> None:
        if self.buckets is not None:
            self.buckets.discard()
        super().zero_grad()


class FullyShardedStage(ZeroStage):
    """Stage 3: `fully_shard` over the model (experts on their expert-data-parallel mesh), one unit per parameter.

    Args:
        module: the model, on its device.
        infos: its trainable parameters; `fully_shard` replaces them, and each info follows.
        groups: the engine's param groups, `params` a list of ParamInfo (from `infos`).
        precision: the dtypes (`model_dtype`, `master_dtype`, `state_dtype`; optim.precision.Precision).
        offload: parameters, gradients and optimizer states in host memory.
        world_size: the data-parallel world size, which every gradient is divided by.
        device: the model's device.
    """

    def __init__(self, module: nn.Module, infos: dict[int, ParamInfo], groups: list[dict], precision, offload: bool,
                 world_size: int, device: torch.device):
        fsdp.shard_model(module, infos, precision.model_dtype, precision.master_dtype, offload, world_size, device)
        self.units_by_group = [[ShardedParam(info, precision.state_dtype) for info in group["params"]]
                               for group in groups]
        self.units = [unit for group_units in self.units_by_group for unit in group_units]

    def after_forward(self, module: nn.Module) -> None:
        """A forward that no backward follows (evaluation, or without grad mode): shard again."""
        if not (torch.is_grad_enabled() and module.training):
            fsdp.reshard(module)

    def reshard(self, module: nn.Module) -> None:
        fsdp.reshard(module)


def build_stage(config: ZeroConfig, module: nn.Module, infos: dict[int, ParamInfo], groups: list[dict], precision,
                offload: bool, world_size: int, rank: int, device: torch.device, boundary) -> ZeroStage:
    """The stage the config names: stage 3 shards through fully_shard when there is a process group."""
    if config.stage == 3 and dist.is_available() and dist.is_initialized():
        return FullyShardedStage(module, infos, groups, precision, offload, world_size, device)
    return FlatStage(config, module, groups, precision, offload, world_size, rank, device, boundary)


def offload_wanted(config: ZeroConfig, device: torch.device) -> bool:
    """Whether to keep states in host memory: asked for (offload_optimizer or offload_param) with the
    model on an accelerator; asked for on the CPU, a warning says it changes nothing."""
    offloads = [name for name, o in (("offload_optimizer", config.offload_optimizer),
                                     ("offload_param", config.offload_param)) if o.device == "cpu"]
    if offloads and device.type == "cpu":
        warnings.warn(f"zero_optimization.{' and '.join(offloads)} has no effect: the model is already in host memory",
                      stacklevel=3)
    return bool(offloads) and device.type != "cpu"


def broadcast_initial_state(module: nn.Module, world_size: int, device: torch.device) -> None:
    """Start every replica from the same values: dense parameters and buffers from rank 0, experts from
    their edp rank 0; then copies of a layer's expert template (expert_init="copy") from rank 0, so the
    model starts as it would at any other layout, unless some rank wrote into them (a loaded state
    dict). Decided on the device: no host read."""
    if world_size == 1:
        return
    params = list(module.parameters())
    copies = [p for p in params if hasattr(p, "template_copy")]  # built alike on every rank
    untouched = torch.tensor([all(is_template_copy(p) for p in copies)], dtype=torch.int32, device=device)
    if copies:
        dist.all_reduce(untouched, op=dist.ReduceOp.MIN)
    with torch.no_grad():
        for param in params:
            if hasattr(param, "allreduce") and not param.allreduce:
                groups = groups_for_name(param.group_name, data_before_expert(param))
                dist.broadcast(param.data, src=dist.get_global_rank(groups.edp_group, 0), group=groups.edp_group)
            else:
                dist.broadcast(param.data, src=0)
        for param in copies:
            template = param.data.clone()
            dist.broadcast(template, src=0)
            param.data.copy_(torch.where(untouched.bool(), template, param.data))
        for buffer in module.buffers():
            dist.broadcast(buffer.data, src=0)
