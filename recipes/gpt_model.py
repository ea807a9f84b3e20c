"""A small GPT whose feed-forward is an MoE layer in every `moe_every`-th block.

Byte-level tokens, learned positions, pre-norm blocks (LayerNorm, causal self-attention, LayerNorm,
feed-forward), a final LayerNorm and an untied read-out. A dense block's feed-forward is
Linear(n_embd, ffn), GELU, Linear(ffn, n_embd); an MoE block routes each token to `top_k` of
`num_experts` experts of width `expert_ffn` (default ffn // top_k), so a dense twin (`moe_every=0`)
has the same active parameters per token, apart from the router.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe import MoE

NORM_TOPK_PROB = {"auto": None, "true": True, "false": False}


@dataclass(kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn: int = 512
    dropout: float = 0.0
    moe_every: int = 2
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = 0
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    dropless: bool = False
    expert_layout: str = "auto"
    noisy_gate_policy: str | None = None
    ep_size: int = 1
    seed: int = 0
    scoring_func: str = "softmax"
    norm_topk_prob: str = "auto"
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 0.0
    load_balancing_type: str = "aux_loss"
    n_group: int = 0
    topk_group: int = 0
    routing: str = "token_choice"
    n_shared_experts: int = 0
    shared_expert_gate: bool = False
    expert_init: str = "per_expert_seed"
    exchange: str = "per_choice"

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.moe_every < 0:
            raise ValueError(f"moe_every must be >= 0 (0: no MoE blocks), got {self.moe_every}")
        if self.moe_every and not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be between 1 and num_experts ({self.num_experts})")
        if self.moe_every and self.num_experts % self.ep_size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by ep_size ({self.ep_size})")
        if self.norm_topk_prob not in NORM_TOPK_PROB:
            raise ValueError(f"norm_topk_prob must be one of {tuple(NORM_TOPK_PROB)}, got {self.norm_topk_prob!r}")
        if self.expert_ffn == 0:
            self.expert_ffn = max(1, self.ffn // self.top_k)

    def moe_options(self) -> dict:
        """The MoE layer's keyword arguments for the routing options (0 means off for the group sizes)."""
        return dict(scoring_func=self.scoring_func, norm_topk_prob=NORM_TOPK_PROB[self.norm_topk_prob],
                    routed_scaling_factor=self.routed_scaling_factor, bias_update_speed=self.bias_update_speed,
                    load_balancing_type=self.load_balancing_type, n_group=self.n_group or None,
                    topk_group=self.topk_group or None, routing=self.routing, n_shared_experts=self.n_shared_experts,
                    shared_expert_gate=self.shared_expert_gate, expert_init=self.expert_init, exchange=self.exchange)

    def routed_experts_per_token(self) -> float:
        """Experts a token's compute runs through on average: k, or the capacity factor under expert choice."""
        return self.capacity_factor if self.routing == "expert_choice" else float(self.top_k)

    def is_moe(self, block: int) -> bool:
        """MoE in blocks moe_every - 1, 2 * moe_every - 1, ... (every other block from the second)."""
        return self.moe_every > 0 and (block + 1) % self.moe_every == 0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


def mlp(width: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, use_moe: bool):
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg), nn.LayerNorm(cfg.n_embd)
        if use_moe:
            self.ffn = MoE(cfg.n_embd, mlp(cfg.n_embd, cfg.expert_ffn), num_experts=cfg.num_experts,
                           ep_size=cfg.ep_size, k=cfg.top_k, capacity_factor=cfg.capacity_factor,
                           eval_capacity_factor=cfg.eval_capacity_factor, min_capacity=cfg.min_capacity,
                           noisy_gate_policy=cfg.noisy_gate_policy, dropless=cfg.dropless,
                           expert_layout=cfg.expert_layout, seed=cfg.seed, **cfg.moe_options())
        else:
            self.ffn = mlp(cfg.n_embd, cfg.ffn)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x + self.drop(self.attn(self.ln1(x)))
        out = self.ffn(self.ln2(x))
        if isinstance(out, tuple):
            out, l_aux, _ = out
            z_loss = self.ffn.z_loss
        else:
            l_aux = z_loss = x.new_zeros((), dtype=torch.float32)
        return x + self.drop(out), l_aux, z_loss


class GPT(nn.Module):
    """forward(idx [B, T] int64) -> (logits [B, T, vocab], l_aux summed over MoE blocks, z_loss summed)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, cfg.is_moe(i)) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._init_dense_weights()

    def _init_dense_weights(self) -> None:
        """GPT-2's init for everything but the experts (seeded per global expert, or copies, by the MoE layer)."""
        for name, module in self.named_modules():
            if ".deepspeed_moe.experts" in name or "deepspeed_moe.experts" == name:
                continue
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for block in self.blocks:  # residual projections scaled by depth (GPT-2)
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        l_aux = z_loss = torch.zeros((), device=idx.device)
        for block in self.blocks:
            x, block_aux, block_z = block(x)
            l_aux, z_loss = l_aux + block_aux, z_loss + block_z
        return self.head(self.ln_f(x)), l_aux, z_loss

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) over the whole model, all expert-parallel ranks' experts included.

        Dense parameters (shared experts and routers among them) are active for every token; of the
        routed experts, k per token, or on average capacity_factor under expert choice.
        """
        total = active = sum(p.numel() for p in self.parameters() if getattr(p, "allreduce", True))
        for block in self.blocks:
            if isinstance(block.ffn, MoE):
                local = sum(p.numel() for p in block.ffn.deepspeed_moe.experts.parameters())
                one_expert = local // block.ffn.num_local_experts
                total += self.cfg.num_experts * one_expert
                active += round(self.cfg.routed_experts_per_token() * one_expert)
        return total, active

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append new_tokens sampled tokens to idx [B, T]."""
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.block_size:])[0][:, -1].float() / max(temperature, 1e-6)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, -1), 1, generator=generator)], 1)
        return idx
