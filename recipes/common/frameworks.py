"""Our MoE layer beside DeepSpeed's and torchtitan's, with the same weights: builders, one timed comparison.

Shape legend: S tokens, M model dim, H expert hidden dim, E experts, K choices per token.

The experts are SwiGLU MLPs, down(silu(x W_gate) * (x W_up)), the only experts torchtitan's MoE has
(`GroupedExperts`: stacked w1, w3 [E, H, M] and w2 [E, M, H], one grouped GEMM per product). Both
layers take a `moe.SwiGLU` module: ours holds its copies as stacked gated weights (gate and up in one
weight1 [E, 2H, M]), DeepSpeed's as a module per expert. Every layer routes by
softmax top-K with the kept weights renormalised, from the same fp32 router weight:

- ours (dropless) and torchtitan's route every choice;
- ours (capacity) and DeepSpeed's drop choices beyond capacity, DeepSpeed's rule, with top-2's
  second-expert sampling off so that both choose alike.

`compare` checks each pair's outputs on one input and times forward+backward in alternating rounds
(`recipes.bench.moe.time_interleaved`). A layer whose library is not importable, or whose step
fails, is a row with the reason instead of figures. torchtitan and DeepSpeed are optional: neither
is a dependency of this project.
"""

import traceback
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe import MoE, SwiGLU
from recipes.bench.moe import peak_memory, time_interleaved

# an output agrees with ours when the norm of the difference is within this share of our output's norm:
# torchtitan multiplies its experts in bf16 and combines in bf16, ours and DeepSpeed's combine in fp32
# (a norm, not the largest difference, so that a token whose near-tied choices flip does not decide it)
AGREEMENT = 2e-2


@dataclass(kw_only=True)
class LayerSize:
    """One layer shape of the comparison."""

    name: str
    hidden: int
    ffn: int
    experts: int
    k: int
    tokens: int
    capacity_factor: float = 1.25


def ours(size: LayerSize, device: torch.device, dtype: torch.dtype, dropless: bool) -> MoE:
    """Our layer on `size`, experts seeded apart (per_expert_seed), the gate in fp32."""
    torch.manual_seed(0)
    with device:
        layer = MoE(size.hidden, SwiGLU(size.hidden, size.ffn, nn.SiLU()), size.experts, k=size.k,
                    capacity_factor=size.capacity_factor, dropless=dropless, norm_topk_prob=True,
                    top2_2nd_expert_sampling=False, expert_init="per_expert_seed")
    layer.to(device, dtype)
    layer.deepspeed_moe.gate.float()
    return layer


class _Fp32Gate(nn.Linear):
    """torchtitan's router gate as it runs on CUDA, where autocast to fp32 computes it in fp32; CPU
    autocast takes only bf16 and fp16, so elsewhere the gate casts its input itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class _Tokens(nn.Module):
    """A layer of [B, L, M] tokens seen as one of [S, M] tokens returning (output, l_aux, counts), as ours."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x_SM: torch.Tensor):
        return self.layer(x_SM.unsqueeze(0)).squeeze(0), None, None


def torchtitan_layer(mine: MoE, size: LayerSize) -> nn.Module:
    """torchtitan's MoE with the weights of our layer `mine` (on its device and dtype, router in fp32).

    No load-balancing bias (load_balance_coeff None), so it routes as ours by the scores alone.

    Raises:
        ImportError: torchtitan (or one of its imports) is not importable.
    """
    from torchtitan.models.common.linear import Linear  # optional: only for side-by-side figures
    from torchtitan.models.common.moe import MoE as TitanMoE
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    E, M, H, K = size.experts, size.hidden, size.ffn, size.k
    config = TitanMoE.Config(
        num_experts=E, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=M, hidden_dim=H, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K)),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=M, out_features=E), top_k=K,
                                            score_func="softmax", route_norm=True))
    weight = mine.deepspeed_moe.gate.wg.weight
    with weight.device:
        layer = config.build()
        if weight.device.type != "cuda":
            layer.router.gate = _Fp32Gate(M, E, bias=False)
    experts = _expert_tensors(mine)
    inner = layer.routed_experts.inner_experts
    with torch.no_grad():
        layer.to(experts[0]["down_proj.weight"].dtype)
        layer.router.gate.float().weight.copy_(weight)
        for stacked, name in ((inner.w1_EFD, "gate_proj"), (inner.w3_EFD, "up_proj"), (inner.w2_EDF, "down_proj")):
            stacked.copy_(torch.stack([expert[f"{name}.weight"] for expert in experts]))
    return _Tokens(layer)


def open_deepspeed() -> bool:
    """DeepSpeed's init, on a one-process gloo group made here where the process has none (its layer
    needs torch.distributed).

    Returns:
        whether the group was made here (`close_deepspeed` then destroys it).

    Raises:
        ImportError: deepspeed is not importable.
    """
    import deepspeed  # optional: only for side-by-side figures

    made = not (dist.is_available() and dist.is_initialized())
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")
    return made


def close_deepspeed(made: bool) -> None:
    """Forget DeepSpeed's expert groups (a later layer makes them anew); destroy the group if `open_deepspeed`
    made it."""
    from deepspeed.utils import groups

    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
        getattr(groups, name, {}).clear()
    groups._WORLD_GROUP = None
    if made and dist.is_initialized():
        dist.destroy_process_group()


def deepspeed_layer(mine: MoE, size: LayerSize) -> nn.Module:
    """DeepSpeed's MoE with the weights of our capacity layer `mine` (after `open_deepspeed`).

    Raises:
        ImportError: deepspeed is not importable.
    """
    from deepspeed.moe.layer import MoE as DeepSpeedMoE  # optional: only for side-by-side figures

    reference = _expert_tensors(mine)[0]["down_proj.weight"]
    with reference.device:
        layer = DeepSpeedMoE(size.hidden, SwiGLU(size.hidden, size.ffn, nn.SiLU()), num_experts=size.experts, k=size.k,
                             capacity_factor=size.capacity_factor, min_capacity=4, top2_2nd_expert_sampling=False)
    layer.set_deepspeed_parallelism()
    layer.to(reference.dtype)
    layer.deepspeed_moe.gate.float()
    theirs = dict(layer.named_parameters())
    with torch.no_grad():
        theirs["deepspeed_moe.gate.wg.weight"].copy_(mine.deepspeed_moe.gate.wg.weight)
        for e, tensors in enumerate(_expert_tensors(mine)):  # DeepSpeed's experts: a module each
            for name, tensor in tensors.items():
                theirs[f"deepspeed_moe.experts.deepspeed_experts.{e}.{name}"].copy_(tensor)
    return layer


def _expert_tensors(layer: MoE) -> list[dict[str, torch.Tensor]]:
    """Each expert's tensors of our layer under its SwiGLU module's names (views of the stacked weights)."""
    experts = layer.deepspeed_moe.experts
    return [experts.expert_tensors(e) for e in range(experts.num_local_experts)]


def _step(layer: nn.Module, x: torch.Tensor, grad: torch.Tensor):
    """One forward+backward (output, and l_aux where the layer has one), gradients set to None first."""

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, l_aux, _ = layer(x)
        tensors, grads = ([out, l_aux], [grad, torch.ones_like(l_aux)]) if l_aux is not None else ([out], [grad])
        torch.autograd.backward(tensors, grads)

    return step


def step_peak(step, device: torch.device) -> int:
    """Bytes a step holds at its peak beyond what was allocated before it (on a CPU,
    `recipes.bench.moe.peak_memory`: the storages the step creates)."""
    if device.type != "cuda":
        return peak_memory(step, device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _build_all(size: LayerSize, device, dtype) -> tuple[dict, dict, bool | None]:
    """(name -> layer, name -> reason it is not run, `open_deepspeed`'s answer or None where it did not run)."""
    layers, missing, opened = {"ours (dropless)": ours(size, device, dtype, dropless=True)}, {}, None
    try:
        layers["torchtitan (dropless)"] = torchtitan_layer(layers["ours (dropless)"], size)
    except ImportError as error:
        missing["torchtitan (dropless)"] = f"torchtitan is not importable here ({error})"
    layers["ours (capacity)"] = ours(size, device, dtype, dropless=False)
    layers["ours (capacity)"].load_state_dict(layers["ours (dropless)"].state_dict())
    try:
        opened = open_deepspeed()
        layers["deepspeed (capacity)"] = deepspeed_layer(layers["ours (capacity)"], size)
    except ImportError as error:
        missing["deepspeed (capacity)"] = f"deepspeed is not importable here ({error})"
    return layers, missing, opened


REFERENCE = {"torchtitan (dropless)": "ours (dropless)", "deepspeed (capacity)": "ours (capacity)"}
ORDER = ("ours (dropless)", "torchtitan (dropless)", "ours (capacity)", "deepspeed (capacity)")


def failure_row(error: BaseException) -> dict:
    """A row's status and reason for an error being handled (its traceback printed)."""
    traceback.print_exc()
    return {"status": "failed", "reason": f"{type(error).__name__}: {error}".splitlines()[0][:300]}


def compare(size: LayerSize, device: torch.device, dtype: torch.dtype, steps: int, warmup: int) -> list[dict]:
    """The four layers on `size`, one row each: ms per step, tokens/s, the step's peak bytes beyond what
    was allocated before it, and for DeepSpeed's and torchtitan's the difference of their output from
    ours on the same input (largest, and its norm over ours) and whether it is within AGREEMENT. A layer whose
    first step fails (out of memory, say) is a row with the error; the others are timed.

    Args:
        size: the layer shape and number of tokens.
        device: where the layers run.
        dtype: the layers' and the tokens' dtype (routers stay in fp32).
        steps: timed steps of each layer, after `warmup` untimed ones.
        warmup: untimed steps of each layer before.

    Returns:
        one row per name of ORDER: the size's fields, layer, status ("ran", "not run" or "failed"),
        ms, tokens_per_s, step_peak_mib, and reason, max_abs_diff, rel_diff and agrees where they apply.
    """
    base = {"size": size.name, "hidden": size.hidden, "ffn": size.ffn, "experts": size.experts, "k": size.k,
            "tokens": size.tokens, "dtype": str(dtype).removeprefix("torch.")}
    rows = {name: {**base, "layer": name, "status": None, "ms": None, "tokens_per_s": None, "step_peak_mib": None}
            for name in ORDER}
    layers, missing, opened = _build_all(size, device, dtype)
    try:
        for name, reason in missing.items():
            rows[name].update(status="not run", reason=reason)
        torch.manual_seed(1)
        x = torch.randn(size.tokens, size.hidden, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn_like(x)
        outputs, steps_of = {}, {}
        for name, layer in layers.items():
            step = _step(layer, x, grad)
            try:
                with torch.no_grad():
                    outputs[name] = layer(x)[0].float()
                rows[name]["step_peak_mib"] = step_peak(step, device) / 2**20  # also the layer's first step
                steps_of[name] = step
            except Exception as error:  # out of memory, say: a row saying so, not a lost report
                rows[name].update(failure_row(error))
                outputs.pop(name, None)
                layer.zero_grad(set_to_none=True)
        for name, reference in REFERENCE.items():
            if name in outputs and reference in outputs:
                difference = outputs[name] - outputs[reference]
                relative = (difference.norm() / outputs[reference].norm()).item()
                rows[name].update(max_abs_diff=difference.abs().max().item(), rel_diff=relative,
                                  agrees=relative <= AGREEMENT)
        del outputs
        ms = time_interleaved(steps_of, SimpleNamespace(steps=steps, warmup=warmup), device)
        for name in steps_of:
            rows[name].update(status="ran", ms=ms[name], tokens_per_s=size.tokens / ms[name] * 1e3)
    finally:
        if opened is not None:
            close_deepspeed(opened)
    return [rows[name] for name in ORDER]
