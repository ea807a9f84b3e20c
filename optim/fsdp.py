"""Stage 3's parameter sharding through torch's `fully_shard`.

Expert modules are sharded over their expert-data-parallel mesh, then the whole model over the
data-parallel mesh (which takes every parameter not already sharded). Gradients of both are summed
over their mesh and divided by the data-parallel world size, as stages 0-2 do.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from optim.gathered import register_sharded
from optim.zero import ParamInfo, shard_placement
from parallel import data_meshes, groups_for_name

__all__ = ["reshard", "shard_model"]


def shard_model(module: nn.Module, infos: dict[int, ParamInfo], compute_dtype: torch.dtype | None,
                master_dtype: torch.dtype, offload: bool, world_size: int, device: torch.device) -> None:
    """fully_shard each outermost all-expert module over its edp mesh, then `module` over the dp mesh.

    Args:
        module: the model (moved to its device).
        infos: its trainable parameters (optim.zero.describe_parameters); their `param` is updated to
            the sharded parameters fully_shard puts in place.
        compute_dtype: fp16/bf16 for a low-precision model, None for fp32.
        master_dtype: bf16 when bf16 master weights were asked for (the model itself is then bf16).
        offload: keep parameters, gradients and optimizer states in host memory (CPUOffloadPolicy).
        world_size: the data-parallel world size, which every gradient is divided by.
        device: the model's device.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    _quiet_view_warning()
    if compute_dtype is not None and master_dtype == torch.bfloat16:
        module.to(torch.bfloat16)
        policy = MixedPrecisionPolicy()
    elif compute_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    else:
        policy = MixedPrecisionPolicy()
    kwargs = {"mp_policy": policy, **({"offload_policy": CPUOffloadPolicy(pin_memory=True)} if offload else {})}
    by_name = {info.name: info for info in infos.values()}
    for name, expert_module in _outermost_expert_modules(module, by_name):
        first = by_name[_first_name(name, expert_module)]
        groups = groups_for_name(first.group_name, first.data_before_expert)
        _, edp_mesh = data_meshes(groups.ep_size, groups.use_data_before_expert_parallel, device.type)
        fully_shard(expert_module, mesh=edp_mesh, shard_placement_fn=shard_placement(edp_mesh.size()), **kwargs)
        expert_module.set_gradient_divide_factor(float(world_size))
        if dist.get_backend() == "gloo" and edp_mesh.size() > 1:
            # gloo has no PREMUL_SUM (NCCL divides on the wire), so sum, then divide. Not on a mesh of one
            # rank: there fully_shard divides the unreduced gradient by the factor and then again after
            # its (skipped) reduction, which would halve an expert's gradient at world 2 / ep 2.
            expert_module.set_force_sum_reduction_for_comms(True)
    dp_mesh, _ = data_meshes(1, device_type=device.type)
    fully_shard(module, mesh=dp_mesh, shard_placement_fn=shard_placement(dp_mesh.size()), **kwargs)
    for name, param in module.named_parameters():  # fully_shard replaced the parameters
        if name in by_name:
            by_name[name].param = param
    register_sharded(module)


def reshard(module: nn.Module) -> None:
    """Shard the parameters again after a forward that no backward follows (an evaluation pass, with
    or without grad mode), and before a checkpoint's collectives.

    fully_shard leaves the root module's parameters gathered after its forward, for the backward; a
    collective that every rank must enter with sharded parameters (a checkpoint's) would otherwise
    see some ranks gathered and others not. A backward that does follow gathers them again.
    """
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


# fully_shard warns when a module returns a view, since an in-place op on that view would skip the
# parameters' all-gather before backward. The padded layout's experts return their [L, C, M] product
# viewed as [N, M], and the layer only reads it (the combine's gather, the all-to-all), so for them the
# warning is a false alarm that every stage-3 process printed; other modules' warnings stay.
_EXPERTS_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPExperts\) returned a view tensor"


def _quiet_view_warning() -> None:
    """Silence fully_shard's view warning for the MoE experts' module (see _EXPERTS_VIEW_WARNING)."""
    warnings.filterwarnings("ignore", message=_EXPERTS_VIEW_WARNING, category=UserWarning)


def _outermost_expert_modules(module: nn.Module, by_name: dict[str, ParamInfo]):
    """(name, module) for each module whose trainable parameters are all expert ones, and whose parent's are not."""
    all_expert = {}
    for name, sub in module.named_modules():
        names = [f"{name}.{n}" if name else n for n, p in sub.named_parameters() if p.requires_grad]
        all_expert[name] = bool(names) and all(n in by_name and by_name[n].expert for n in names)
    for name, sub in module.named_modules():
        parent = name.rpartition(".")[0] if name else None
        if all_expert[name] and (parent is None or not all_expert.get(parent, False)):
            yield name, sub


def _first_name(prefix: str, module: nn.Module) -> str:
    name = next(n for n, p in module.named_parameters() if p.requires_grad)
    return f"{prefix}.{name}" if prefix else name
