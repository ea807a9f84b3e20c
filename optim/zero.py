"""ZeRO sharding of parameters, gradients and optimizer states, dense and expert alike.

Every optimizer param group is held by one of two kinds of unit, and the optimizer steps on each
unit's `proxy` parameter (this rank's piece of the master weights):

- `FlatGroup` (stages 0, 1, 2, written here; torch has no element-balanced ZeRO-1/2): the group's
  parameters become views into one flat buffer, padded to a multiple of the reduction group's size.
  Stage 0 all-reduces the flat gradient and steps on all of it; stage 1 all-reduces it and steps on
  this rank's slice; stage 2 keeps a persistent gradient shard, into which the engine's gradient
  buckets (`optim.buckets`) reduce during the backward, so a full gradient never outlives its bucket. After the step the updated slices are all-gathered.
- `ShardedParam` (stage 3): the parameter is a DTensor sharded by torch's `fully_shard`; the proxy
  is its local shard and its gradient FSDP's reduce-scattered local gradient.

Dense parameters reduce over the data-parallel group and expert parameters over their
expert-data-parallel group; either way the sum is divided by the data-parallel world size, because an
expert's gradient must be the average over every token of the global batch (the one-process run).
A unit's `weights` are this rank's piece of the weights the optimizer updates: a separate master copy
(fp32 when the model computes in fp16/bf16, or in host memory when offloaded), otherwise a view of the
model's own storage. Both kinds of unit implement the `Unit` protocol, through which the engine's step
and checkpoints reach them (the engine's gradient buckets reach into flat groups only).
"""

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from optim.buckets import FlatShard
from parallel import comm, data_before_expert, expert_ids, is_moe_param

__all__ = ["FlatGroup", "ParamInfo", "ShardedParam", "Unit", "describe_parameters", "row_major_boxes", "shard_placement"]


@dataclass
class ParamInfo:
    """A trainable parameter and the facts the engine needs about it."""

    name: str
    param: nn.Parameter
    expert: bool
    group_name: str | None
    ids: tuple[int, ...] | None
    axis: int | None
    global_name: str
    data_before_expert: bool = False  # the rank layout of the expert groups (parallel.groups)

    def keys(self) -> list[str]:
        """Checkpoint keys: one per global expert for stacked experts, else the one-process name."""
        if self.expert and self.axis is not None:
            return [f"{self.global_name}#expert{g}" for g in self.ids]
        return [self.global_name]

    def split(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The tensor cut into the pieces that `keys()` names."""
        if self.expert and self.axis is not None:
            return list(full.unbind(self.axis))
        return [full]

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        if self.expert and self.axis is not None:
            return torch.stack(pieces, self.axis)
        return pieces[0]


def describe_parameters(model: nn.Module, ep_rank_of) -> dict[int, ParamInfo]:
    """ParamInfo for every trainable parameter, by id; `ep_rank_of(param)` for experts tagged without ids."""
    infos = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in infos:
            continue
        expert = is_moe_param(param)
        tag = expert_ids(param) if expert else None
        ids = axis = None
        global_name = name
        if tag is not None:
            ids, axis, local_suffix, global_suffix = tag
            if local_suffix is not None and name.endswith(local_suffix):
                global_name = name[: -len(local_suffix)] + global_suffix
        elif expert:  # tagged by hand without ids: only the same expert-parallel layout can reload it
            global_name = f"{name}@ep_rank{ep_rank_of(param)}"
        infos[id(param)] = ParamInfo(name, param, expert, getattr(param, "group_name", None), ids, axis, global_name,
                                     data_before_expert(param))
    return infos


def _reduce(tensor: torch.Tensor, group, divisor: float) -> None:
    """All-reduce over `group` and divide, in fp32 on the wire."""
    wire = tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()
    if group is not None:
        dist.all_reduce(wire, group=group)
    if divisor != 1:  # alone, dividing by 1 would be a pass over every gradient that changes no bit
        wire.div_(divisor)
    if wire is not tensor:
        tensor.copy_(wire)


@runtime_checkable
class Unit(Protocol):
    """A holder of parameters, their gradients and this rank's piece of their weights (FlatGroup, ShardedParam).

    Attributes:
        infos: the parameters held, in order.
        expert: whether they are expert parameters.
        group_rank: this rank's position in the group the unit is sharded or reduced over.
        weights: this rank's piece of the weights the optimizer updates: a separate master copy or a
            view of the model's own storage.
        proxy: the parameter the optimizer steps on: `weights` itself, or, with `steps_on_copy`, an
            empty parameter that the engine fills with a copy in the optimizer's dtype at each step.
        steps_on_copy: the optimizer's states have another dtype than `weights` (bf16 master weights
            with fp32 optimizer states), so it steps on a copy that is written back after the step.

    The engine calls, per micro-batch, `micro_step`; at the accumulation boundary `refresh`, `reduce`,
    `grad`, then the optimizer step and `write_back`; `zero_grad` after it. A method with nothing to
    do for one kind of unit (stage 3's reduction is FSDP's) returns at once.
    """

    infos: list[ParamInfo]
    expert: bool
    group_rank: int
    weights: torch.Tensor
    proxy: nn.Parameter
    steps_on_copy: bool

    def refresh(self, module: nn.Module) -> None:
        """Follow parameters whose storage the user replaced, where the unit can."""

    def micro_step(self) -> None:
        """After each backward: take in the micro-batch's gradients."""

    def reduce(self) -> None:
        """At the accumulation boundary: finish reducing gradients over the reduction group."""

    def grad(self) -> torch.Tensor:
        """This rank's reduced gradient, shaped like `weights`."""

    def counts_once(self) -> bool:
        """Whether this rank's gradient counts in the global norm (a replicated one counts on one rank)."""

    def write_back(self) -> None:
        """After the step: the model's parameters take the stepped weights."""

    def zero_grad(self) -> None:
        """Clear the gradients (their buffers are kept)."""

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Full per-parameter tensors from this rank's piece of a tensor shaped like `weights` (collective)."""

    def boxes(self, local: torch.Tensor) -> list[tuple[ParamInfo, tuple[int, ...], torch.Tensor]]:
        """What `local` (shaped like `weights`) holds of each parameter: (info, offsets, view) per box."""

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors held, by kind ("parameters", "gradients", "master"), for the memory report."""


class FlatGroup:
    """One param group's parameters in one flat buffer, sharded over `group` (stages 0-2).

    Args:
        infos: the group's parameters, in order.
        group: the reduction process group (data-parallel or expert-data-parallel), None alone.
        group_size, group_rank: its size and this rank's position.
        stage: ZeRO stage 0, 1 or 2.
        master_dtype: dtype of the master weights (fp32, or bf16 with bf16 master weights).
        state_dtype: dtype the optimizer steps in (its states take this dtype).
        master_device: where master weights and optimizer states live (host memory when offloaded).
        divisor: reduced gradients are divided by this (the data-parallel world size).
    """

    def __init__(self, infos: list[ParamInfo], group, group_size: int, group_rank: int, stage: int,
                 master_dtype: torch.dtype, state_dtype: torch.dtype, master_device: torch.device,
                 divisor: float = 1.0):
        self.infos, self.group, self.stage, self.divisor = infos, group, stage, divisor
        self.group_size, self.group_rank = group_size, group_rank
        self.expert = infos[0].expert
        params = [info.param for info in infos]
        dtype, device = params[0].dtype, params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [0] + list(_cumsum(self.numels))[:-1]
        shards = group_size if stage >= 1 else 1
        self.total = sum(self.numels)
        self.shard = max(1, math.ceil(self.total / shards))
        self.lo = group_rank * self.shard if stage >= 1 else 0
        self.flat = torch.zeros(self.shard * shards, dtype=dtype, device=device)
        with torch.no_grad():
            for param, offset, numel in zip(params, self.offsets, self.numels):
                self.flat[offset : offset + numel].copy_(param.detach().reshape(-1))
                param.data = self.flat[offset : offset + numel].view_as(param)
        own = self.flat[self.lo : self.lo + self.shard]
        separate = self.separate = master_dtype != dtype or master_device != device
        self.weights = own.to(master_device, master_dtype, copy=True) if separate else own
        if separate and master_device.type == "cpu" and device.type == "cuda":
            self.weights = self.weights.pin_memory()
        self.state_dtype = state_dtype
        self.steps_on_copy = state_dtype != master_dtype
        self.proxy = nn.Parameter(self.weights if state_dtype == master_dtype
                                  else torch.empty(0, dtype=state_dtype, device=self.weights.device),
                                  requires_grad=True)
        # bf16 gradients accumulate over micro-batches in the master dtype (fp32 unless bf16 master
        # weights were asked for), as DeepSpeed's bf16 optimizer does: summing many bf16 micro-batch
        # gradients in bf16 loses their low bits. Autograd then writes each backward's gradients in
        # the model dtype, and micro_step adds them into the fp32 buffer.
        grad_dtype = master_dtype if dtype == torch.bfloat16 else dtype
        self.accumulate = grad_dtype != dtype
        self.bucketed = False  # set when gradient buckets reduce this group (flat_shard)
        self.flat_grad = torch.zeros_like(self.flat, dtype=grad_dtype) if stage <= 1 else None
        self.grad_shard = torch.zeros(self.shard, dtype=grad_dtype, device=device) if stage == 2 else None
        # each parameter's view of the flat gradient, made once (the buffer is never replaced): pointing
        # .grad at it again every step is then an identity check, not a slice and a view per parameter
        self._grad_views = [] if self.flat_grad is None else list(self._views(self.flat_grad))
        self._point_grads()

    def _views(self, buffer: torch.Tensor):
        for info, offset, numel in zip(self.infos, self.offsets, self.numels):
            yield info.param, buffer[offset : offset + numel].view_as(info.param)

    def _point_grads(self) -> None:
        """Stages 0/1: make every .grad a view into the flat gradient, keeping what it held."""
        if self.flat_grad is None or self.accumulate:
            return
        for param, view in self._grad_views:
            grad = param.grad
            if grad is view:
                continue
            if grad is None:
                view.zero_()
            elif grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            param.grad = view

    def flat_shard(self) -> FlatShard:
        """What the gradient buckets need: stage 2 reduces into this rank's shard, stages 0/1 all-reduce
        into the whole flat gradient (from then on `reduce` leaves the reduction to the buckets)."""
        grads = self.grad_shard if self.stage == 2 else self.flat_grad
        wire = grads.dtype if grads.dtype in (torch.float32, torch.float64) else torch.float32
        self.bucketed = True
        return FlatShard([info.param for info in self.infos], self.offsets, grads.numel() if self.stage <= 1 else self.shard,
                         grads, self.group, self.group_size, self.group_rank, wire, all_reduce=self.stage <= 1,
                         grads_are_views=self.stage <= 1 and not self.accumulate)

    def refresh(self, module: nn.Module) -> None:
        """Nothing done: the parameters stay views of the flat buffer unless their storage is replaced,
        which stages 0-2 do not follow."""

    def micro_step(self) -> None:
        """After each backward: stages 0/1 with a wider gradient buffer add the gradients into it (stage 2's
        gradients are already in its shard: the engine's buckets finish first)."""
        if self.stage != 2 and self.accumulate:
            with torch.no_grad():
                for param, view in self._grad_views:
                    if param.grad is not None:
                        view.add_(param.grad)
                        param.grad = None

    def reduce(self) -> None:
        """At the accumulation boundary: stages 0/1 all-reduce the flat gradient, unless buckets did."""
        if self.stage <= 1 and self.bucketed:  # reduced already; .grad points into the flat gradient again
            for param, view in self._grad_views:
                param.grad = None if self.accumulate else view
        elif self.stage <= 1:
            self._point_grads()
            _reduce(self.flat_grad, self.group, self.divisor)

    def grad(self) -> torch.Tensor:
        """This rank's reduced gradient slice (model dtype; fp32 for bf16 models with fp32 master weights)."""
        if self.stage == 2:
            return self.grad_shard
        return self.flat_grad[self.lo : self.lo + self.shard]

    def counts_once(self) -> bool:
        """Whether this rank's gradient slice counts in the global norm (stage 0 replicates it)."""
        return self.stage >= 1 or self.group_rank == 0

    def write_back(self) -> None:
        """Copy the stepped master into the model's flat buffer and share the slices."""
        own = self.flat[self.lo : self.lo + self.shard]
        if self.separate:
            own.copy_(self.weights)
        if self.stage >= 1 and self.group is not None:  # in place: this rank's slice is its own input (NCCL and gloo)
            comm.all_gather_single(self.flat, own, group=self.group)

    def zero_grad(self) -> None:
        if self.flat_grad is not None:
            self.flat_grad.zero_()
            self._point_grads()
        if self.accumulate:
            for info in self.infos:
                info.param.grad = None
        if self.grad_shard is not None:
            self.grad_shard.zero_()
            for info in self.infos:
                info.param.grad = None

    # Checkpoints: each parameter's part in this rank's slice, and the full tensors (consolidation).

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Full per-parameter tensors from this rank's slice of a flat tensor (collective in stages 1-2)."""
        if self.stage >= 1 and self.group is not None:
            full = torch.empty(self.shard * self.group_size, dtype=piece.dtype, device=piece.device)
            comm.all_gather_single(full, piece.contiguous(), group=self.group)
        else:
            full = piece
        return [full[o : o + n].view_as(i.param) for i, o, n in zip(self.infos, self.offsets, self.numels)]

    def boxes(self, local: torch.Tensor) -> list[tuple[ParamInfo, tuple[int, ...], torch.Tensor]]:
        """What `local` (this rank's slice of a flat tensor: the master or an optimizer state shaped like
        it) holds of each parameter: (info, offsets in the parameter, a view of `local`) per box.

        A slice of the flat buffer covers a run of each parameter's elements in row-major order; the run
        is cut into at most 2 * dims - 1 rectangular boxes, each a contiguous piece of `local`.
        """
        out = []
        for info, offset, numel in zip(self.infos, self.offsets, self.numels):
            start, stop = max(offset, self.lo), min(offset + numel, self.lo + self.shard)
            at = start - self.lo
            for offsets, sizes in row_major_boxes(tuple(info.param.shape), start - offset, stop - offset):
                count = math.prod(sizes)
                out.append((info, offsets, local[at : at + count].view(sizes)))
                at += count
        return out

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        """Bytes held, by kind, for the memory report."""
        grads = [self.flat_grad if self.flat_grad is not None else self.grad_shard]
        return {"parameters": [self.flat], "gradients": grads,
                "master": [self.weights] if self.separate else []}


def shard_placement(size: int):
    """fully_shard's choice of dimension per parameter: the first one `size` divides, else dim 0.

    FSDP's default cuts dim 0 into ceil-sized chunks, which leaves small or oddly shaped parameters
    spread unevenly (a [5, 8] weight over 4 ranks: 2, 2, 1, 0 rows); any dimension that divides evenly
    keeps every rank's share equal, as the ZeRO accounting assumes. When none divides, dim 0 it is:
    fully_shard pads uneven shards on dim 0 only (a [10, 84] weight on 8 ranks cannot go on dim 1).
    """
    from torch.distributed.tensor import Shard

    def placement(param: torch.Tensor):
        if param.dim() == 0:
            return Shard(0)
        for dim, length in enumerate(param.shape):
            if length % size == 0:
                return Shard(dim)
        return Shard(0)

    return placement


class ShardedParam:
    """A parameter sharded by fully_shard (stage 3): the optimizer steps on its local shard.

    Args:
        info: the parameter (a DTensor after fully_shard, cut along one dimension).
        state_dtype: dtype the optimizer steps in.
    """

    def __init__(self, info: ParamInfo, state_dtype: torch.dtype):
        self.infos = [info]
        self.expert = info.expert
        param = info.param
        self.mesh = param.device_mesh
        self.group = self.mesh.get_group()
        self.group_size, self.group_rank = self.mesh.size(), self.mesh.get_local_rank()
        self.dim = param.placements[0].dim if param.dim() else 0
        self.weights = param.detach().to_local()  # the live local shard, outside autograd
        self.state_dtype = state_dtype
        self.steps_on_copy = state_dtype != self.weights.dtype
        self.proxy = nn.Parameter(self.weights if state_dtype == self.weights.dtype
                                  else torch.empty(0, dtype=state_dtype, device=self.weights.device),
                                  requires_grad=True)
        self.rows = param.shape[self.dim] if param.dim() else 1
        self.chunk = math.ceil(self.rows / self.group_size)
        self.start = min(self.group_rank * self.chunk, self.rows)
        with torch.no_grad():  # a persistent sharded gradient, accumulated into by FSDP's reduce-scatter
            param.grad = torch.zeros_like(param)

    def refresh(self, module: nn.Module) -> None:
        """Follow the parameter when its storage was replaced (`load_state_dict(assign=True)`, `_apply`):
        the optimizer then steps on the live shard, with the state it had."""
        param = module.get_parameter(self.infos[0].name)
        if not hasattr(param, "to_local"):  # gathered for a forward no backward followed: nothing moved
            return
        local = param.detach().to_local()
        if param is self.infos[0].param and local.data_ptr() == self.weights.data_ptr() and local.shape == self.weights.shape:
            return
        self.infos[0].param, self.weights = param, local
        if not self.steps_on_copy:
            self.proxy.data = local
        if param.grad is None:
            with torch.no_grad():
                param.grad = torch.zeros_like(param)

    def micro_step(self) -> None:
        """Nothing to take in: FSDP's reduce-scatter accumulates into the sharded gradient."""

    def reduce(self) -> None:
        """Nothing left: FSDP reduced the gradients during the backward."""

    def grad(self) -> torch.Tensor:
        return self.infos[0].param.grad.to_local()

    def counts_once(self) -> bool:
        """Always: every rank holds a distinct shard."""
        return True

    def write_back(self) -> None:
        """Nothing to copy: the weights are the parameter's own local shard."""

    def zero_grad(self) -> None:
        param = self.infos[0].param
        if param.grad is None:
            with torch.no_grad():
                param.grad = torch.zeros_like(param)
        else:
            param.grad.to_local().zero_()

    def gather(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """The full tensor from this rank's chunk (fully_shard cuts one dimension in ceil-sized chunks)."""
        shape = self.infos[0].param.shape
        if not shape:
            return [piece]
        front = piece.movedim(self.dim, 0)
        padded = torch.zeros((self.chunk,) + tuple(front.shape[1:]), dtype=piece.dtype, device=piece.device)
        padded[: front.shape[0]].copy_(front)
        full = torch.empty((self.chunk * self.group_size,) + tuple(front.shape[1:]), dtype=piece.dtype, device=piece.device)
        comm.all_gather_single(full, padded, group=self.group)
        return [full[: self.rows].movedim(0, self.dim).contiguous()]

    def boxes(self, local: torch.Tensor) -> list[tuple[ParamInfo, tuple[int, ...], torch.Tensor]]:
        """What `local` (the local shard, or an optimizer state shaped like it) holds: one box."""
        shape = self.infos[0].param.shape
        if not shape:
            return [(self.infos[0], (), local)]
        if local.numel() == 0:
            return []
        offsets = [0] * len(shape)
        offsets[self.dim] = self.start
        return [(self.infos[0], tuple(offsets), local)]

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        grad = self.infos[0].param.grad
        return {"parameters": [self.weights], "gradients": [grad.to_local()] if grad is not None else [], "master": []}


def row_major_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Rectangular boxes (offsets, sizes), in order, covering elements [start, stop) of a row-major tensor.

    Each box is contiguous in memory: leading sizes 1, one partial dimension, full trailing dimensions.
    """
    if stop <= start:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = (0,) * (len(shape) - 1)
    boxes = []
    row = start // inner
    if start % inner:  # the first row, begun in the middle
        end = min(stop, (row + 1) * inner)
        boxes += [((row,) + o, (1,) + z) for o, z in row_major_boxes(shape[1:], start % inner, end - row * inner)]
        row += 1
    whole = stop // inner
    if whole > row:
        boxes.append(((row,) + rest, (whole - row,) + tuple(shape[1:])))
    if stop % inner and whole >= row:  # the last row, ended in the middle
        boxes += [((whole,) + o, (1,) + z) for o, z in row_major_boxes(shape[1:], 0, stop % inner)]
    return boxes


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def __getattr__(name: str):
    """`optim.zero.GatheredParameters`, where DeepSpeed scripts look for it (optim.gathered holds it)."""
    if name == "GatheredParameters":
        from optim.gathered import GatheredParameters

        return GatheredParameters
    raise AttributeError(f"module 'optim.zero' has no attribute {name!r}")
