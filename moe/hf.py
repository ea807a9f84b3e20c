"""Hugging Face MoE models on our layer: `convert` swaps each sparse MoE block for a `moe.MoE` with the
same weights and routing, `restore` puts the original blocks back for `save_pretrained` (gathering the
experts of a model converted at ep_size > 1 over each layer's expert-parallel group).

Shape legend: S tokens, M model dim, H expert hidden dim, E experts.

Supported (transformers >= 5, whose blocks hold their experts as stacked tensors; imported lazily, so
`import moe` never needs it): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE and GPT-OSS. The
experts of these models are gated MLPs, `down(act(x W_gate) * (x W_up))`: our stacked gated experts
(`moe.SwiGLU`, weight1 [E, 2H, M] as the block's gate_up_proj, gate rows then up rows, and weight2
[E, M, H] as its down_proj) where the model's activation is one the stacked path computes (silu,
gelu, relu, tanh, sigmoid), module copies otherwise. GPT-OSS's, with biases, interleaved gate and up
columns and clamps (`ClampedSwiGLU`), are module copies. Routing maps onto the router options: softmax or
sigmoid scores, `norm_topk_prob`, `routed_scaling_factor`, the expert bias (DeepSeek-V3's
`e_score_correction_bias`, moved after each optimizer step by `bias_update_speed`), group-limited
top-k, and a router bias (GPT-OSS); nothing is dropped (`dropless`). GPT-OSS takes the softmax over
the k largest logits, which is the softmax over all experts renormalised over the k chosen
(`norm_topk_prob`): the same weights up to rounding.

The converted block returns what the original does (the hidden states; GPT-OSS's also each token's k
routing weights); our `l_aux`, `z_loss` and routing statistics stay on the layer (`block.moe`).
transformers records router logits by hooking its own router class, which a converted block no longer
holds: `l_aux` replaces `output_router_logits`. A config that sets it is set to False (restore sets it
back), and a forward asking for it fails with the reason.
"""

import warnings

import torch
import torch.distributed as dist
from torch import nn

from moe.experts import SwiGLU
from moe.layer import MoE

__all__ = ["DEEPSEEK_V3_BIAS_UPDATE_SPEED", "SUPPORTED", "ClampedSwiGLU", "HFMoEBlock", "SwiGLU", "convert",
           "restore"]

# the sparse block of each supported architecture, by class name, and its model_type
_BLOCKS = {
    "MixtralSparseMoeBlock": "mixtral", "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe", "DeepseekV3MoE": "deepseek_v3", "OlmoeSparseMoeBlock": "olmoe",
    "GptOssMLP": "gpt_oss",
}
SUPPORTED = tuple(_BLOCKS.values())

# DeepSeek-V3's bias update speed (gamma in its report): the default for a converted DeepSeek-V3
DEEPSEEK_V3_BIAS_UPDATE_SPEED = 1e-3


# transformers' hidden_act names whose ACT2FN function is a torch activation the stacked experts compute
_HIDDEN_ACTS = {"silu": nn.SiLU, "swish": nn.SiLU, "relu": nn.ReLU, "gelu": nn.GELU,
                "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's expert: g = gate(x) clamped above at limit, u = up(x) clamped to [-limit, limit],
    down((u + 1) * g * sigmoid(alpha * g)); every projection has a bias.

    Args:
        hidden_size: M.
        intermediate_size: H.
        alpha: the sigmoid's slope (config.swiglu_alpha).
        limit: the clamp (config.swiglu_limit).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * self.alpha))


class HFMoEBlock(nn.Module):
    """A transformers sparse MoE block run by `moe.MoE`; forward returns what the original block returns.

    Args:
        moe: the MoE layer holding the block's router, experts and shared expert.
        block_class: the original block's class (for `restore`).
        config: the model's config (for `restore`).
        model_type: the architecture (its config's model_type).
    """

    def __init__(self, moe: MoE, block_class: type, config, model_type: str):
        super().__init__()
        self.moe = moe
        self.block_class = block_class
        self.config = config
        self.model_type = model_type
        self.router_hooks: list[tuple] = []  # the original router's forward hooks, for restore

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        output, _, _ = self.moe(hidden_states)
        if self.model_type != "gpt_oss":
            return output
        # GPT-OSS's block also returns each token's k routing weights, [S, k] (its decoder layer drops them)
        return output, self.moe.deepspeed_moe.routing.weight_SK.to(output.dtype)


def _check_model(model: nn.Module) -> str:
    """The model's architecture (its config's model_type), or ValueError when it is not supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"convert supports transformers models of {', '.join(SUPPORTED)}, got model_type "
                         f"{model_type!r}")
    return model_type


def _router(block: nn.Module) -> nn.Module:
    return block.router if hasattr(block, "router") else block.gate


def _routing_options(block: nn.Module, model_type: str, config, bias_update_speed: float | None) -> dict:
    """The MoE keywords that route as the block's router does."""
    router = _router(block)
    if model_type == "deepseek_v3":
        speed = DEEPSEEK_V3_BIAS_UPDATE_SPEED if bias_update_speed is None else bias_update_speed
        return {"scoring_func": "sigmoid", "norm_topk_prob": bool(router.norm_topk_prob),
                "routed_scaling_factor": float(router.routed_scaling_factor), "n_group": router.num_group,
                "topk_group": router.topk_group, "bias_update_speed": speed}
    if bias_update_speed is not None and bias_update_speed != 0:
        raise ValueError(f"bias_update_speed ({bias_update_speed}) moves an expert bias, which of the supported "
                         f"architectures only deepseek_v3 has; {model_type} has none to save it in: leave it None")
    if model_type == "gpt_oss":  # softmax over the k largest logits = softmax renormalised over the k chosen
        return {"norm_topk_prob": True, "router_bias": True}
    options = {"norm_topk_prob": bool(getattr(router, "norm_topk_prob", True))}  # Mixtral always renormalises
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        if jitter != 0.01:
            raise ValueError(f"router_jitter_noise ({jitter}) must be 0 or 0.01 (our Jitter policy's epsilon)")
        options["noisy_gate_policy"] = "Jitter"
    return options


def _expert(experts: nn.Module, model_type: str, config) -> tuple[nn.Module, int]:
    """A module computing one of the block's experts (weights to be copied in), and E."""
    if model_type == "gpt_oss":  # gate_up_proj [E, M, 2H] (gate and up columns interleaved), down_proj [E, H, M]
        num_experts, intermediate, hidden = experts.down_proj.shape
        return ClampedSwiGLU(hidden, intermediate, experts.alpha, experts.limit), num_experts
    num_experts, hidden, intermediate = experts.down_proj.shape  # gate_up_proj [E, 2H, M], down_proj [E, M, H]
    # the block's act_fn is ACT2FN[config.hidden_act]: the same function as a torch module where there is
    # one, so that the experts are stacked; any other stays the block's module, run per expert
    act = getattr(config, "hidden_act", None)
    return SwiGLU(hidden, intermediate, _HIDDEN_ACTS[act]() if act in _HIDDEN_ACTS else experts.act_fn), num_experts


def _block_expert(experts: nn.Module, e: int, model_type: str) -> dict[str, torch.Tensor]:
    """Expert e of the block's stacked tensors, under our expert module's parameter names."""
    if model_type == "gpt_oss":
        gate_up_MX, bias_X = experts.gate_up_proj[e], experts.gate_up_proj_bias[e]
        return {"gate_proj.weight": gate_up_MX[:, 0::2].t(), "gate_proj.bias": bias_X[0::2],
                "up_proj.weight": gate_up_MX[:, 1::2].t(), "up_proj.bias": bias_X[1::2],
                "down_proj.weight": experts.down_proj[e].t(), "down_proj.bias": experts.down_proj_bias[e]}
    w_gate, w_up = experts.gate_up_proj[e].chunk(2, dim=0)
    return {"gate_proj.weight": w_gate, "up_proj.weight": w_up, "down_proj.weight": experts.down_proj[e]}


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's layout of the last dimension: gate and up alternate (g0, u0, g1, u1, ...)."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _stacked(experts: list[dict[str, torch.Tensor]], model_type: str) -> dict[str, torch.Tensor]:
    """The block's stacked expert tensors, by name, from each expert's tensors under our module's parameter
    names (`Experts.expert_tensors`), in their order."""
    def stack(tensor) -> torch.Tensor:
        return torch.stack([tensor(t) for t in experts])

    if model_type == "gpt_oss":
        return {"gate_up_proj": stack(lambda t: _interleaved(t["gate_proj.weight"].t(), t["up_proj.weight"].t())),
                "gate_up_proj_bias": stack(lambda t: _interleaved(t["gate_proj.bias"], t["up_proj.bias"])),
                "down_proj": stack(lambda t: t["down_proj.weight"].t()),
                "down_proj_bias": stack(lambda t: t["down_proj.bias"])}
    return {"gate_up_proj": stack(lambda t: torch.cat([t["gate_proj.weight"], t["up_proj.weight"]])),
            "down_proj": stack(lambda t: t["down_proj.weight"])}


def _build(block: nn.Module, model_type: str, config, ep_size: int, expert_layout: str,
           bias_update_speed: float | None, **kwargs) -> HFMoEBlock:
    """The MoE layer for one block, with the block's weights; this rank's experts only under ep_size > 1."""
    if not hasattr(block.experts, "gate_up_proj"):
        raise ValueError(f"{type(block).__name__} holds its experts as modules (transformers < 5); convert reads the "
                         f"stacked gate_up_proj and down_proj of transformers >= 5")
    router = _router(block)
    expert, num_experts = _expert(block.experts, model_type, config)
    hidden = expert.down_proj.out_features
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    options = {**_routing_options(block, model_type, config, bias_update_speed), **kwargs}
    moe = MoE(hidden, expert, num_experts, ep_size=ep_size, k=router.top_k, dropless=True, expert_layout=expert_layout,
              shared_expert=shared, shared_expert_gate=hasattr(block, "shared_expert_gate"), **options)
    if moe._pending:
        raise RuntimeError(f"convert with ep_size ({ep_size}) > 1 needs torch.distributed initialised first, so "
                           f"that each rank loads its own experts")
    dtype, device = block.experts.down_proj.dtype, block.experts.down_proj.device
    moe.to(device)
    moe.deepspeed_moe.experts.to(dtype)
    gate = moe.deepspeed_moe.gate
    with torch.no_grad():
        gate.wg.weight.copy_(router.weight)
        if gate.wg.bias is not None:
            gate.wg.bias.copy_(router.bias)
        first = moe.ep_rank * moe.num_local_experts
        experts = moe.deepspeed_moe.experts
        for local in range(moe.num_local_experts):  # into module copies, or views of the stacked weights
            mine = experts.expert_tensors(local)
            for name, tensor in _block_expert(block.experts, first + local, model_type).items():
                mine[name].copy_(tensor)
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.to(device=device, dtype=dtype)
            moe.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is not None:
        if gate.expert_bias is None:  # a fixed bias: the counts buffer lets update_routing run (moving it by 0)
            gate.expert_bias = torch.zeros(num_experts, device=device)
            gate.step_counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        gate.expert_bias.copy_(bias.float())
    return HFMoEBlock(moe, type(block), config, model_type)


def convert(model: nn.Module, ep_size: int = 1, expert_layout: str = "auto", bias_update_speed: float | None = None,
            **kwargs) -> nn.Module:
    """Replace every sparse MoE block of a transformers model, in place, by our layer with the same weights.

    Dense layers (DeepSeek-V3's first layers, Qwen's mlp_only_layers) stay as they are. The converted
    model computes what the original does: the same routing (softmax or sigmoid scores, expert bias,
    group limits, router bias, renormalisation, scaling), no dropped tokens, the same experts and
    shared experts.

    Args:
        model: a Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE or GPT-OSS transformers model.
        ep_size: expert-parallel size; > 1 needs torch.distributed initialised (each rank keeps its experts).
        expert_layout: our layer's expert layout ("auto", "packed" or "grouped"; dropless excludes "padded").
        bias_update_speed: DeepSeek-V3's expert bias moves by this much after each optimizer step
            (auxiliary-loss-free balancing: the engine advances it; a plain-torch loop calls
            `moe.update_routing(model)`); 0 keeps it fixed. None: DEEPSEEK_V3_BIAS_UPDATE_SPEED for
            DeepSeek-V3; the other architectures have no expert bias and take only None or 0.
        **kwargs: further `moe.MoE` keywords (load_balancing_type, exchange, ...).

    Returns:
        the model, its blocks replaced by `HFMoEBlock`s. A config with `output_router_logits` set is set
        to False (with a warning) until `restore`, and a forward passing `output_router_logits=True`
        raises ValueError: each layer's `l_aux` replaces transformers' load-balancing loss.

    Raises:
        ValueError: the model's architecture is not supported; a bias_update_speed for a model without an
            expert bias.
    """
    model_type = _check_model(model)
    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in _BLOCKS]
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        adapter = _build(block, model_type, model.config, ep_size, expert_layout, bias_update_speed, **kwargs)
        adapter.router_hooks = _forward_hooks(_router(block))
        setattr(parent, child, adapter)
    _replace_router_logits(model)
    return model


def _forward_hooks(module: nn.Module) -> list[tuple]:
    """The module's forward hooks as (hook, with_kwargs, always_call): transformers records router
    logits by such hooks on its router modules, installed at the model's first forward that records
    an output."""
    return [(hook, key in module._forward_hooks_with_kwargs, key in module._forward_hooks_always_called)
            for key, hook in module._forward_hooks.items()]


def _replace_router_logits(model: nn.Module) -> None:
    """Our `l_aux` replaces transformers' `output_router_logits`: transformers records router logits,
    for its load-balancing loss, from its own router modules, and a converted model has none (the loss
    would fail on an empty tuple). A config asking for them is set to False, with a warning, until
    `restore`; a forward of the model, or of a transformers model inside it, that asks for them (by
    keyword, or by a config set after convert) fails with the reason."""
    if getattr(model.config, "output_router_logits", False):
        warnings.warn("the model's config sets output_router_logits, whose load-balancing loss reads the logits of "
                      "transformers' own router modules, which convert replaces: set to False until restore; each "
                      "converted layer's l_aux (block.moe) is the balancing loss to add", stacklevel=3)
        model.config.output_router_logits = False
        model._hf_output_router_logits = True
    for module in [model, *_transformers_models(model)]:
        if not getattr(module, "_hf_refuses_router_logits", False):  # one hook, however often converted
            module.register_forward_pre_hook(_refuse_router_logits, with_kwargs=True)
            module._hf_refuses_router_logits = True


def _transformers_models(model: nn.Module) -> list[nn.Module]:
    """The transformers models inside `model` (a causal LM's base model)."""
    from transformers import PreTrainedModel

    return [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]


def _refuse_router_logits(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook: asking for router logits fails while the model holds converted blocks."""
    asked = kwargs.get("output_router_logits")
    if asked is None:
        asked = getattr(getattr(module, "config", None), "output_router_logits", False)
    if asked and any(isinstance(m, HFMoEBlock) for m in module.modules()):
        raise ValueError("output_router_logits=True: transformers records router logits, for its load-balancing "
                         "loss, from its own router modules, which a converted model no longer has; add each "
                         "converted layer's l_aux (block.moe) instead, or restore the model first")


def _gathered(local: torch.Tensor, moe: MoE) -> torch.Tensor:
    """Every expert's slice of a stacked tensor, in global-expert order: this rank's slice under ep_size 1,
    else the slices of the layer's expert-parallel group, each placed by the ep_rank that holds it."""
    if moe.ep_size == 1:
        return local
    group = moe.deepspeed_moe.ep_group
    slices = [torch.empty_like(local) for _ in range(moe.ep_size)]
    ranks = [torch.empty(1, dtype=torch.int64, device=local.device) for _ in range(moe.ep_size)]
    dist.all_gather(slices, local.contiguous(), group=group)
    dist.all_gather(ranks, torch.tensor([moe.ep_rank], device=local.device), group=group)
    order = [int(r) for r in ranks]
    return torch.cat([slices[order.index(ep_rank)] for ep_rank in range(moe.ep_size)])


def _check_whole(adapter: HFMoEBlock) -> None:
    """Restore reads whole parameters: a layer sharded by ZeRO stage 3 (fully_shard's DTensors) has none."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in adapter.parameters()):
        raise ValueError("restore needs whole parameters, and this model's are sharded (ZeRO stage 3): load "
                         "engine.consolidated_state_dict() into a one-process converted copy of the model and "
                         "restore that (docs/hf.md)")


def _original(adapter: HFMoEBlock) -> nn.Module:
    """A block of the original class carrying the adapter's weights (every expert's, gathered over the
    expert-parallel group when the layer has ep_size > 1)."""
    moe = adapter.moe
    experts = moe.deepspeed_moe.experts
    tensors = [experts.expert_tensors(local) for local in range(moe.num_local_experts)]
    reference = tensors[0]["down_proj.weight"]
    block = adapter.block_class(adapter.config).to(device=reference.device, dtype=reference.dtype)
    router, gate = _router(block), moe.deepspeed_moe.gate
    for hook, with_kwargs, always_call in adapter.router_hooks:
        router.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call)
    with torch.no_grad():
        for name, local in _stacked(tensors, adapter.model_type).items():
            getattr(block.experts, name).copy_(_gathered(local, moe))
        router.weight.copy_(gate.wg.weight)
        if gate.wg.bias is not None:
            router.bias.copy_(gate.wg.bias)
        if moe.shared_expert is not None:
            name = "shared_expert" if hasattr(block, "shared_expert") else "shared_experts"
            setattr(block, name, moe.shared_expert)
        if moe.shared_expert_gate is not None:
            block.shared_expert_gate.weight.copy_(moe.shared_expert_gate.weight)
        if moe.expert_bias is not None:
            router.e_score_correction_bias.copy_(moe.expert_bias)
    return block.train(adapter.training)


def restore(model: nn.Module) -> nn.Module:
    """Put the original transformers blocks back, with the trained weights, so `save_pretrained` writes a
    checkpoint `from_pretrained` reads.

    A layer converted at ep_size > 1 gathers its experts over its expert-parallel group, so every rank of
    the group rebuilds the whole block: under expert parallelism every rank calls restore (a collective),
    and one of them (rank 0) saves. A model sharded by ZeRO stage 3 holds no whole parameters: gather
    them first (`engine.consolidated_state_dict()`, loaded into a one-process converted copy).

    Returns:
        the model, in place.

    Raises:
        ValueError: the model's parameters are sharded (ZeRO stage 3).
    """
    adapters = [(name, m) for name, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    for _, adapter in adapters:
        _check_whole(adapter)
    for name, adapter in adapters:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _original(adapter))
    if getattr(model, "_hf_output_router_logits", False):
        model.config.output_router_logits = True
        model._hf_output_router_logits = False
    return model
