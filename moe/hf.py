"""Hugging Face MoE models on our layer: `convert` swaps each sparse MoE block for a `moe.MoE` with the
same weights and routing, `restore` puts the original blocks back for `save_pretrained` (gathering the
experts of a model converted at ep_size > 1 over each layer's expert-parallel group).

Shape legend: S tokens, M model dim, H expert hidden dim, E experts.

Supported (transformers >= 5, whose blocks hold their experts as stacked tensors; imported lazily, so
`import moe` never needs it): Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and OLMoE. The experts of these models are SwiGLU MLPs,
`down(act(x W_gate) * (x W_up))`, which our stacked experts do not hold (they are Linear-act-Linear),
so each expert is a small `SwiGLU` module copied per expert. Routing maps onto the router options:
softmax or sigmoid scores, `norm_topk_prob`, `routed_scaling_factor`, the expert bias
(DeepSeek-V3's `e_score_correction_bias`) and group-limited top-k; nothing is dropped (`dropless`).

The converted block returns the hidden states, as the original does; our `l_aux`, `z_loss` and routing
statistics stay on the layer (`block.moe`). transformers records router logits by hooking its own
router class, which a converted block no longer holds: use `l_aux` instead of `output_router_logits`.
"""

import torch
import torch.distributed as dist
from torch import nn

from moe.layer import MoE

__all__ = ["SUPPORTED", "HFMoEBlock", "SwiGLU", "convert", "restore"]

# the sparse block of each supported architecture, by class name, and its model_type
_BLOCKS = {
    "MixtralSparseMoeBlock": "mixtral", "Qwen2MoeSparseMoeBlock": "qwen2_moe",
    "Qwen3MoeSparseMoeBlock": "qwen3_moe", "DeepseekV3MoE": "deepseek_v3", "OlmoeSparseMoeBlock": "olmoe",
}
SUPPORTED = tuple(_BLOCKS.values())


class SwiGLU(nn.Module):
    """One gated expert, as the supported models' experts compute: down(act(gate(x)) * up(x)), no biases.

    Args:
        hidden_size: M.
        intermediate_size: H.
        act_fn: the activation module (transformers' ACT2FN entry of the model's hidden_act).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class HFMoEBlock(nn.Module):
    """A transformers sparse MoE block run by `moe.MoE`; forward returns what the original block returns.

    Args:
        moe: the MoE layer holding the block's router, experts and shared expert.
        block_class: the original block's class (for `restore`).
        config: the model's config (for `restore`).
    """

    def __init__(self, moe: MoE, block_class: type, config):
        super().__init__()
        self.moe = moe
        self.block_class = block_class
        self.config = config

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, _, _ = self.moe(hidden_states)
        return output


def _check_model(model: nn.Module) -> str:
    """The model's architecture (its config's model_type), or ValueError when it is not supported."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type == "gpt_oss":
        raise ValueError("gpt_oss is not supported: its router has a bias and takes the softmax after top-k, and its "
                         "experts have biases and a clamped SwiGLU; supported architectures: " + ", ".join(SUPPORTED))
    if model_type not in SUPPORTED:
        raise ValueError(f"convert supports transformers models of {', '.join(SUPPORTED)}, got model_type "
                         f"{model_type!r}")
    return model_type


def _routing_options(block: nn.Module, model_type: str, config) -> dict:
    """The MoE keywords that route as the block's router does."""
    router = block.gate
    if model_type == "deepseek_v3":
        return {"scoring_func": "sigmoid", "norm_topk_prob": bool(router.norm_topk_prob),
                "routed_scaling_factor": float(router.routed_scaling_factor), "n_group": router.num_group,
                "topk_group": router.topk_group}
    options = {"norm_topk_prob": bool(getattr(router, "norm_topk_prob", True))}  # Mixtral always renormalises
    jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
    if jitter:
        if jitter != 0.01:
            raise ValueError(f"router_jitter_noise ({jitter}) must be 0 or 0.01 (our Jitter policy's epsilon)")
        options["noisy_gate_policy"] = "Jitter"
    return options


def _build(block: nn.Module, model_type: str, config, ep_size: int, expert_layout: str, **kwargs) -> HFMoEBlock:
    """The MoE layer for one block, with the block's weights; this rank's experts only under ep_size > 1."""
    if not hasattr(block.experts, "gate_up_proj"):
        raise ValueError(f"{type(block).__name__} holds its experts as modules (transformers < 5); convert reads the "
                         f"stacked gate_up_proj and down_proj of transformers >= 5")
    gate_up_EXM, down_EMH = block.experts.gate_up_proj, block.experts.down_proj
    num_experts, hidden, intermediate = down_EMH.shape[0], down_EMH.shape[1], down_EMH.shape[2]
    shared = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
    options = {**_routing_options(block, model_type, config), **kwargs}
    moe = MoE(hidden, SwiGLU(hidden, intermediate, block.experts.act_fn), num_experts, ep_size=ep_size,
              k=block.gate.top_k, dropless=True, expert_layout=expert_layout, shared_expert=shared,
              shared_expert_gate=hasattr(block, "shared_expert_gate"), **options)
    if moe._pending:
        raise RuntimeError(f"convert with ep_size ({ep_size}) > 1 needs torch.distributed initialised first, so "
                           f"that each rank loads its own experts")
    dtype, device = down_EMH.dtype, down_EMH.device
    moe.to(device)
    moe.deepspeed_moe.experts.to(dtype)
    gate = moe.deepspeed_moe.gate
    with torch.no_grad():
        gate.wg.weight.copy_(block.gate.weight)
        first = moe.ep_rank * moe.num_local_experts
        for local, expert in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            w_gate, w_up = gate_up_EXM[first + local].chunk(2, dim=0)
            expert.gate_proj.weight.copy_(w_gate)
            expert.up_proj.weight.copy_(w_up)
            expert.down_proj.weight.copy_(down_EMH[first + local])
        if moe.shared_expert_gate is not None:
            moe.shared_expert_gate.to(device=device, dtype=dtype)
            moe.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    if bias is not None:
        if gate.expert_bias is None:  # a fixed bias: the counts buffer lets update_routing run (moving it by 0)
            gate.expert_bias = torch.zeros(num_experts, device=device)
            gate.step_counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        gate.expert_bias.copy_(bias.float())
    return HFMoEBlock(moe, type(block), config)


def convert(model: nn.Module, ep_size: int = 1, expert_layout: str = "auto", **kwargs) -> nn.Module:
    """Replace every sparse MoE block of a transformers model, in place, by our layer with the same weights.

    Dense layers (DeepSeek-V3's first layers, Qwen's mlp_only_layers) stay as they are. The converted
    model computes what the original does: the same routing (softmax or sigmoid scores, expert bias,
    group limits, renormalisation, scaling), no dropped tokens, the same experts and shared experts.

    Args:
        model: a Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 or OLMoE transformers model.
        ep_size: expert-parallel size; > 1 needs torch.distributed initialised (each rank keeps its experts).
        expert_layout: our layer's expert layout ("auto", "packed" or "grouped"; dropless excludes "padded").
        **kwargs: further `moe.MoE` keywords (load_balancing_type, bias_update_speed, exchange, ...).

    Returns:
        the model, its blocks replaced by `HFMoEBlock`s.

    Raises:
        ValueError: the model's architecture is not supported.
    """
    model_type = _check_model(model)
    blocks = [(name, module) for name, module in model.named_modules() if type(module).__name__ in _BLOCKS]
    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _build(block, model_type, model.config, ep_size, expert_layout, **kwargs))
    return model


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


def _original(adapter: HFMoEBlock) -> nn.Module:
    """A block of the original class carrying the adapter's weights (every expert's, gathered over the
    expert-parallel group when the layer has ep_size > 1)."""
    moe = adapter.moe
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    reference = experts[0].down_proj.weight
    block = adapter.block_class(adapter.config).to(device=reference.device, dtype=reference.dtype)
    with torch.no_grad():
        gate_up_EXM = _gathered(torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in experts]),
                                moe)
        down_EMH = _gathered(torch.stack([e.down_proj.weight for e in experts]), moe)
        block.gate.weight.copy_(moe.deepspeed_moe.gate.wg.weight)
        block.experts.gate_up_proj.copy_(gate_up_EXM)
        block.experts.down_proj.copy_(down_EMH)
        if moe.shared_expert is not None:
            name = "shared_expert" if hasattr(block, "shared_expert") else "shared_experts"
            setattr(block, name, moe.shared_expert)
        if moe.shared_expert_gate is not None:
            block.shared_expert_gate.weight.copy_(moe.shared_expert_gate.weight)
        if moe.expert_bias is not None:
            block.gate.e_score_correction_bias.copy_(moe.expert_bias)
    return block.train(adapter.training)


def restore(model: nn.Module) -> nn.Module:
    """Put the original transformers blocks back, with the trained weights, so `save_pretrained` writes a
    checkpoint `from_pretrained` reads.

    A layer converted at ep_size > 1 gathers its experts over its expert-parallel group, so every rank of
    the group rebuilds the whole block: under expert parallelism every rank calls restore (a collective),
    and one of them (rank 0) saves.

    Returns:
        the model, in place.
    """
    adapters = [(name, m) for name, m in model.named_modules() if isinstance(m, HFMoEBlock)]
    for name, adapter in adapters:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, _original(adapter))
    return model

