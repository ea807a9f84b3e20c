"""The router module: a linear map to expert logits in fp32, a gating policy, and its balancing state.

Shape legend: S tokens, M model dim, E experts.

`TopKGate` picks the policy from its config: DeepSpeed's top-1 / top-2 / top-k for softmax routing
without the newer options (DeepSpeed's results, the softmax summed in SIMD order: see
`moe.router.scoring.expert_softmax`), `topkgating` at any k once sigmoid scoring, a bias, groups, or
explicit weight normalisation or scaling is asked for, and
`expert_choice_gating` for routing="expert_choice". The linear map may have a bias (router_bias, as
GPT-OSS's router has). State that lives across forwards (the expert bias, the step's routed counts) is
kept here and advanced by `update_routing` after each optimizer step.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe.autocast import no_autocast
from moe.router.balancing import LOAD_BALANCING_TYPES, update_bias
from moe.router.expert_choice import expert_choice_gating
from moe.router.plan import Routing
from moe.router.scoring import SCORING_FUNCS, _gate_dtype
from moe.router.selection import (
    DROP_POLICIES, JITTER_EPS, _check_group_limit, _check_policy, top1gating, top2gating, topkgating,
)

__all__ = ["ROUTINGS", "TopKGate", "TopKGateConfig", "update_routing"]

ROUTINGS = ("token_choice", "expert_choice")


@dataclass(kw_only=True)
class TopKGateConfig:
    """Everything a gate decides with; validated on construction.

    Args:
        model_dim: M, the token width.
        num_experts: E, global number of experts.
        k: choices per token (1 top-1, 2 top-2, more top-k); unused by expert choice.
        capacity_factor: capacity factor in training.
        eval_capacity_factor: capacity factor in eval mode.
        min_capacity: the least number of slots per expert.
        noisy_gate_policy: None, "Jitter" (multiplicative input noise) or "RSample" (Gumbel top-1).
        drop_tokens: drop choices beyond capacity.
        use_rts: random token selection for top-1.
        top2_2nd_expert_sampling: Gumbel-sample the second expert for top-2.
        drop_policy: "probs" or "position", for k > 2 and the newer options.
        scoring_func: "softmax" or "sigmoid" (top-k taken on the scores plus the bias).
        norm_topk_prob: renormalise each token's kept weights to sum to 1; None: the policy's default
            (DeepSpeed: not for top-1, yes for top-2 and top-k; yes for sigmoid).
        routed_scaling_factor: a factor on every routed weight.
        bias_update_speed: u of auxiliary-loss-free balancing; 0 turns the expert bias off.
        load_balancing_type: "aux_loss", "seq_aux_loss", "global_aux_loss" or "none" (moe.router.balancing).
        n_group, topk_group: group-limited routing (both or neither).
        routing: "token_choice" or "expert_choice".
        router_bias: the router's linear map has a bias, logits = x W^T + b (GPT-OSS); every policy
            ranks and weighs these logits.
    """

    model_dim: int
    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 8
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True
    drop_policy: str = "probs"
    scoring_func: str = "softmax"
    norm_topk_prob: bool | None = None
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = 0.0
    load_balancing_type: str = "aux_loss"
    n_group: int | None = None
    topk_group: int | None = None
    routing: str = "token_choice"
    router_bias: bool = False

    def __post_init__(self):
        for name in ("model_dim", "num_experts", "k", "min_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if self.model_dim < 1:
            raise ValueError(f"model_dim (hidden_size) must be >= 1, got {self.model_dim}")
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.k <= self.num_experts:
            raise ValueError(f"k ({self.k}) must be between 1 and num_experts ({self.num_experts})")
        for name in ("capacity_factor", "eval_capacity_factor", "routed_scaling_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        _check_policy(self.noisy_gate_policy)
        if not isinstance(self.router_bias, bool):
            raise TypeError(f"router_bias must be True or False, got {self.router_bias!r}")
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")
        self._check_routing_options()

    def _check_routing_options(self) -> None:
        """The newer routing options and the combinations that do not make sense."""
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        if self.load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"load_balancing_type must be one of {LOAD_BALANCING_TYPES}, "
                             f"got {self.load_balancing_type!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        speed = self.bias_update_speed
        if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not speed >= 0:
            raise ValueError(f"bias_update_speed must be a number >= 0 (0: no expert bias), got {speed!r}")
        if self.norm_topk_prob is not None and not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be True, False or None, got {self.norm_topk_prob!r}")
        _check_group_limit(self.num_experts, self.k, self.n_group, self.topk_group)
        if self.routing == "expert_choice":
            newer = {"scoring_func": self.scoring_func != "softmax", "bias_update_speed": speed > 0,
                     "n_group": self.n_group is not None, "norm_topk_prob": self.norm_topk_prob is not None,
                     "load_balancing_type": self.load_balancing_type != "aux_loss",
                     "drop_tokens": not self.drop_tokens, "noisy_gate_policy": self.noisy_gate_policy == "RSample"}
            given = [name for name, on in newer.items() if on]
            if given:
                raise ValueError(f"routing='expert_choice' (softmax scores, every expert takes exactly C tokens) does "
                                 f"not take {given[0]}; leave it at its default")
        elif self.noisy_gate_policy == "RSample" and not self.deepspeed_policy:
            raise ValueError("noisy_gate_policy='RSample' is DeepSpeed's top-1 softmax noise; it does not combine "
                             "with scoring_func, bias_update_speed, n_group, norm_topk_prob or routed_scaling_factor")

    @property
    def deepspeed_policy(self) -> bool:
        """Whether DeepSpeed's top-1 / top-2 policies apply (softmax, no bias, no groups, default weights)."""
        return (self.scoring_func == "softmax" and self.bias_update_speed == 0 and self.n_group is None
                and self.norm_topk_prob is None and self.routed_scaling_factor == 1.0)


class _RouterLinear(torch.autograd.Function):
    """logits = x W^T (+ b) by F.linear (routing decides on exactly these logits); W's gradient as grad^T x.

    autograd's own backward forms W's gradient as (x^T grad)^T, a product whose [M, S] operand is a
    transposed view, which BLAS runs slowly when E is small; grad^T x reads both operands in their
    stored order. The two forms differ only in the order of fp32 sums.
    """

    @staticmethod
    def forward(ctx, x_SM, weight_EM, bias_E=None):
        ctx.save_for_backward(x_SM, weight_EM)
        return F.linear(x_SM, weight_EM, bias_E)

    @staticmethod
    def backward(ctx, grad_SE):
        x_SM, weight_EM = ctx.saved_tensors
        grad_x = grad_SE.mm(weight_EM) if ctx.needs_input_grad[0] else None
        grad_weight = grad_SE.t().mm(x_SM) if ctx.needs_input_grad[1] else None
        grad_bias = grad_SE.sum(0) if ctx.needs_input_grad[2] else None
        return grad_x, grad_weight, grad_bias


class TopKGate(torch.nn.Module):
    """The router: a linear map to expert logits (bias-free unless router_bias), computed in fp32, then a
    gating policy.

    In eval mode the gate uses eval_capacity_factor and turns every noise off (Jitter, RSample,
    second-expert sampling and random token selection), so eval routing is deterministic.

    Buffers: `expert_bias` [E] with bias_update_speed > 0 (fp32 whatever the model dtype, since steps
    of u ~ 1e-3 vanish in bf16; saved in checkpoints; the same on every rank), and the training
    forwards' routed counts of the current step (not saved: a checkpoint is taken between steps).

    Args:
        model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling, drop_policy:
            see `TopKGateConfig`.
        ep_group: expert-parallel group for the dropless capacity reduction, or None.
        scoring_func, norm_topk_prob, routed_scaling_factor, bias_update_speed, load_balancing_type,
        n_group, topk_group, routing, router_bias: keyword-only, see `TopKGateConfig`.
        dp_group: the data-parallel group the step's counts are summed over (global_aux_loss and the
            bias); None: every process when torch.distributed is initialised.
    """

    def __init__(
        self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
        drop_tokens: bool = True, use_rts: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs", *, scoring_func: str = "softmax", norm_topk_prob: bool | None = None,
        routed_scaling_factor: float = 1.0, bias_update_speed: float = 0.0, load_balancing_type: str = "aux_loss",
        n_group: int | None = None, topk_group: int | None = None, routing: str = "token_choice", dp_group=None,
        router_bias: bool = False,
    ):
        super().__init__()
        self.config = TopKGateConfig(
            model_dim=model_dim, num_experts=num_experts, k=k, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
            noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling, drop_policy=drop_policy, scoring_func=scoring_func,
            norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
            bias_update_speed=bias_update_speed, load_balancing_type=load_balancing_type, n_group=n_group,
            topk_group=topk_group, routing=routing, router_bias=router_bias,
        )
        self.ep_group = ep_group
        self.dp_group = dp_group
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=router_bias).float()
        cfg, device = self.config, self.wg.weight.device
        self.register_buffer("expert_bias", torch.zeros(num_experts, device=device) if cfg.bias_update_speed > 0 else None)
        self.register_buffer("step_counts", torch.zeros(num_experts, dtype=torch.int64, device=device)
                             if cfg.bias_update_speed > 0 else None, persistent=False)
        self.register_buffer("global_counts", torch.zeros(num_experts, dtype=torch.int64, device=device)
                             if cfg.load_balancing_type == "global_aux_loss" else None, persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to / .half / .bfloat16 move the bias but keep it at least fp32 (its updates are tiny)."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None and self.expert_bias.dtype in (torch.float16, torch.bfloat16):
            self.expert_bias = bias.to(self.expert_bias.device)
        return self

    def forward(self, x_SM: torch.Tensor, used_token: torch.Tensor | None = None, seq_len: int | None = None) -> Routing:
        """Route tokens.

        Args:
            x_SM: tokens, shape [S, M], any float dtype (the gate computes in fp32, or float64 for float64).
            used_token: optional [S] mask of tokens to route.
            seq_len: tokens per sequence, for load_balancing_type="seq_aux_loss" (S must be a multiple).

        Returns:
            the Routing plan.
        """
        cfg = self.config
        x_SM = x_SM.to(_gate_dtype(x_SM.dtype))
        if self.training and cfg.noisy_gate_policy == "Jitter":
            x_SM = x_SM * torch.empty_like(x_SM).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        with no_autocast(x_SM.device):  # the router stays fp32 under the model's autocast
            bias = self.wg.bias.to(x_SM.dtype) if self.wg.bias is not None else None
            logits = _RouterLinear.apply(x_SM, self.wg.weight.to(x_SM.dtype), bias)
        capacity_factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        # In eval (validation, generation from a short prompt) a batch of fewer tokens than min_capacity
        # routes with nothing dropped: any capacity >= S keeps every choice, since an expert gets at most
        # one choice per token. In training it stays an error (DeepSpeed's assertion, a batch below the
        # capacity floor being a configuration mistake).
        min_capacity = cfg.min_capacity if self.training else min(cfg.min_capacity, logits.shape[0])
        if cfg.routing == "expert_choice":
            return expert_choice_gating(logits, capacity_factor, used_token=used_token)
        balance = {"load_balancing_type": cfg.load_balancing_type, "seq_len": seq_len,
                   "global_counts": self._sum_global_counts if self.training and self.global_counts is not None else None}
        if cfg.deepspeed_policy and cfg.k == 1:
            routing = top1gating(
                logits, capacity_factor, min_capacity, used_token,
                cfg.noisy_gate_policy if self.training else None, cfg.drop_tokens,
                cfg.use_rts and self.training, self.ep_group, **balance,
            )
        elif cfg.deepspeed_policy and cfg.k == 2:
            routing = top2gating(
                logits, capacity_factor, min_capacity, cfg.drop_tokens, self.ep_group,
                cfg.top2_2nd_expert_sampling and self.training, used_token=used_token, **balance,
            )
        else:
            routing = topkgating(
                logits, cfg.k, capacity_factor, min_capacity, cfg.drop_tokens, self.ep_group, cfg.drop_policy,
                used_token=used_token, scoring_func=cfg.scoring_func,
                norm_topk_prob=True if cfg.norm_topk_prob is None else cfg.norm_topk_prob,
                routed_scaling_factor=cfg.routed_scaling_factor, expert_bias=self.expert_bias, n_group=cfg.n_group,
                topk_group=cfg.topk_group, **balance,
            )
        if self.training and self.step_counts is not None:
            self.step_counts += routing.exp_counts
        return routing

    def _sum_global_counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        """This micro-batch's counts summed over the data-parallel group, added to the step's (global_aux_loss)."""
        counts_E = counts_E.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts_E, group=self.dp_group)
        self.global_counts += counts_E
        return self.global_counts.clone()

    @torch.no_grad()
    def update_routing(self, *, skipped: bool | torch.Tensor = False) -> None:
        """Advance the balancing state after an optimizer step; call it on every rank after optimizer.step().

        With bias_update_speed u > 0, b_i += u * sign(mean_j c_j - c_i), c_i the choices routed to expert
        i by this step's training forwards on all data-parallel ranks (one all-reduce). Then the step's
        counts (for the bias and for global_aux_loss) start again from zero. The engine calls it; a
        plain-torch loop calls `moe.update_routing(model)`.

        Args:
            skipped: the optimizer step was skipped (an fp16 overflow): counts are cleared, the bias kept.
                A device flag (nonzero: skipped) from a step that reads nothing on the host (a CUDA graph's).
        """
        if self.expert_bias is not None:
            on_device = isinstance(skipped, torch.Tensor)
            if on_device or not skipped:
                if self.global_counts is not None:  # already summed over the data-parallel group
                    counts_E = self.global_counts
                else:
                    counts_E = self.step_counts.clone()
                    if dist.is_available() and dist.is_initialized():
                        dist.all_reduce(counts_E, group=self.dp_group)
                if on_device:  # the moved bias, kept where the step was taken
                    moved = update_bias(self.expert_bias.clone(), counts_E, self.config.bias_update_speed)
                    self.expert_bias.copy_(torch.where(skipped.reshape(()) != 0, self.expert_bias, moved))
                else:
                    update_bias(self.expert_bias, counts_E, self.config.bias_update_speed)
            self.step_counts.zero_()
        if self.global_counts is not None:
            self.global_counts.zero_()


def update_routing(model: torch.nn.Module, *, skipped: bool = False) -> None:
    """After `optimizer.step()` in a plain-torch loop: advance every gate's balancing state (collective).

    Needed with bias_update_speed > 0 (the expert bias moves) or load_balancing_type="global_aux_loss"
    (the step's counts restart); harmless otherwise. The engine does this itself.
    """
    for module in model.modules():
        if isinstance(module, TopKGate):
            module.update_routing(skipped=skipped)
