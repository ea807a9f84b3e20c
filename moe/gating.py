"""Gating: DeepSpeed's top-1, top-2 and top-k policies, returning a routing plan instead of dense masks.

Shape legend: S tokens, E experts, K choices per token, C capacity, M model dim.

Everything here computes in fp32 whatever the model dtype (float64 inputs stay float64, for gradient
checks). Semantics follow DeepSpeed-MoE:
capacity C = max(ceil(S / E * capacity_factor * k), min_capacity); with drop_tokens=False, C is the
largest per-expert count (max-reduced over the expert-parallel group) and nothing is dropped. Where
DeepSpeed leaves an order open (ties, which tokens keep their slot), ours is first-come by token index.
"""

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels import sync_checks
from moe.autocast import no_autocast
from moe.routing import Routing, assign_slots

__all__ = ["TopKGate", "TopKGateConfig", "top1gating", "top2gating", "topkgating"]

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")
JITTER_EPS = 1e-2


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every model dtype; float64 stays float64 (gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def _check_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [S, E], got {list(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
    logits = logits.to(_gate_dtype(logits.dtype))
    if sync_checks() and not bool(torch.isfinite(logits).all()):  # a host sync: opt-in (kernels.backend)
        raise ValueError("logits contain non-finite values (inf or nan); check the gate input")
    return logits


def _largest_count(exp_counts: torch.Tensor, ep_group) -> int:
    """The dropless capacity: the largest expert count, max-reduced over ep_group (a host sync)."""
    largest = exp_counts.max().reshape(1) if exp_counts.numel() else exp_counts.new_zeros(1)
    if ep_group is not None:
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=ep_group)
    return int(largest.item())


def _capacity(
    logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool,
) -> int | None:
    """Slots per expert from the capacity factor when dropping; None without dropping (see `_resolver`)."""
    num_tokens, num_experts = logits.shape
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    if min_capacity < 0:
        raise ValueError(f"min_capacity must be >= 0, got {min_capacity}")
    if not drop_tokens:
        return None
    if num_tokens < min_capacity:
        raise ValueError(
            f"the number of tokens ({num_tokens}) must be >= min_capacity ({min_capacity}) when dropping "
            "tokens; lower min_capacity or send more tokens"
        )
    return max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)


def _resolver(capacity: int | None, exp_counts: torch.Tensor, ep_group):
    """What Routing.capacity calls: the fixed capacity, or the dropless one found on first demand and kept."""
    if capacity is not None:
        return lambda: capacity
    found = []  # the all-reduce and host sync happen once per routing, however often capacity is read

    def resolve() -> int:
        if not found:
            found.append(_largest_count(exp_counts, ep_group))
        return found[0]

    return resolve


def _slots_capacity(capacity: int | None, logits: torch.Tensor, k: int) -> int:
    """The capacity slot assignment uses: without dropping every choice fits (S * k slots)."""
    return capacity if capacity is not None else logits.shape[0] * k


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, -log(-log(U)); U is kept off 0 so the noise stays finite."""
    uniform = torch.rand_like(t).clamp_(min=torch.finfo(t.dtype).tiny)
    return uniform.log_().neg_().log_().neg_()


def _mask_unused(choice_S: torch.Tensor, used_token: torch.Tensor | None) -> torch.Tensor:
    if used_token is None:
        return choice_S
    used = used_token.reshape(-1)
    if used.numel() != choice_S.numel():
        raise ValueError(f"used_token must have {choice_S.numel()} elements (one per token), got {used.numel()}")
    return torch.where(used != 0, choice_S, -1)


def _counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 choices per expert, -1 not counted; a scatter-add (a boolean mask or bincount would sync)."""
    index = expert.reshape(-1) + 1
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
    return counts.scatter_add_(0, index, torch.ones_like(index)).narrow(0, 1, num_experts)


def _balance_loss(gates_SE: torch.Tensor, counts_E: torch.Tensor, k: int) -> torch.Tensor:
    """l_aux = E * sum_e mean_s(gates[s, e]) * frac_e, frac_e = counts_e / (S * k)."""
    num_tokens, num_experts = gates_SE.shape
    frac_E = counts_E.to(gates_SE.dtype) / max(num_tokens * k, 1)
    return num_experts * torch.sum(gates_SE.mean(0) * frac_E)


def _z_loss(logits_SE: torch.Tensor) -> torch.Tensor:
    if logits_SE.shape[0] == 0:
        return logits_SE.new_zeros(())
    return torch.logsumexp(logits_SE, dim=1).square().mean()


def _plan(
    gates_SE, expert_SK, slot_SK, resolve_capacity, l_aux, exp_counts, z_loss, renormalize: bool
) -> Routing:
    """Mask dropped choices and read their weights from the gates (renormalised for top-2 and top-k)."""
    kept_SK = slot_SK >= 0
    expert_SK = torch.where(kept_SK, expert_SK, -1)
    weight_SK = gates_SE.gather(1, expert_SK.clamp(min=0)) * kept_SK
    if renormalize:
        denom_S1 = weight_SK.sum(1, keepdim=True).clamp(min=torch.finfo(weight_SK.dtype).eps)
        weight_SK = weight_SK / denom_S1
    return Routing(
        expert_idx_SK=expert_SK, slot_SK=torch.where(kept_SK, slot_SK, -1), weight_SK=weight_SK,
        resolve_capacity=resolve_capacity, num_experts=gates_SE.shape[1], l_aux=l_aux,
        exp_counts=exp_counts.detach(), z_loss=z_loss,
    )


def top1gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
) -> Routing:
    """Top-1 gating (Switch): each token goes to its most probable expert.

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        capacity_factor: slots per expert relative to an even split.
        min_capacity: the least number of slots per expert.
        used_token: optional [S] mask; tokens where it is 0 are routed nowhere.
        noisy_gate_policy: "RSample" picks argmax(logits + Gumbel noise); None or "Jitter" argmax(gates).
        drop_tokens: drop choices beyond capacity; if False, capacity is the largest expert count.
        use_rts: random token selection: over capacity, keep tokens of random priority, not the first.
        ep_group: expert-parallel group over which the dropless capacity is max-reduced.

    Returns:
        Routing with K = 1; weights are the gate probabilities (not renormalised).

    Raises:
        ValueError: bad shapes, an unknown policy, S < min_capacity when dropping, or non-finite logits
            (that check reads a device value, so it runs only with MOE_SYNC_CHECKS=1; see kernels.backend).
    """
    _check_policy(noisy_gate_policy)
    logits = _check_logits(logits, 1)
    gates_SE = F.softmax(logits, dim=1)
    scores = logits + _gumbel_like(logits) if noisy_gate_policy == "RSample" else gates_SE
    choice_S = _mask_unused(torch.argmax(scores, dim=1), used_token)
    num_experts = logits.shape[1]
    exp_counts = _counts(choice_S, num_experts)
    capacity = _capacity(logits, 1, capacity_factor, min_capacity, drop_tokens)
    priority = torch.rand(choice_S.shape, device=logits.device) if (use_rts and drop_tokens) else None
    slot_S = assign_slots(choice_S, num_experts, _slots_capacity(capacity, logits, 1), priority)
    l_aux = _balance_loss(gates_SE, exp_counts, 1)
    return _plan(gates_SE, choice_S.unsqueeze(1), slot_S.unsqueeze(1), _resolver(capacity, exp_counts, ep_group), l_aux,
                 exp_counts, _z_loss(logits), False)


def top2gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True, ep_group=None,
    top2_2nd_expert_sampling: bool = True, *, used_token: torch.Tensor | None = None,
) -> Routing:
    """Top-2 gating (GShard): the most probable expert, then a second one sampled from the rest.

    First choices fill each expert in token order, then second choices after all first choices; a
    choice whose slot is >= C is dropped. The two weights are renormalised to sum to 1.

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        capacity_factor, min_capacity, drop_tokens, ep_group: as in `top1gating`, with k = 2.
        top2_2nd_expert_sampling: add Gumbel noise to the logits before picking the second expert.
        used_token: optional [S] mask; tokens where it is 0 are routed nowhere.

    Returns:
        Routing with K = 2.

    Raises:
        ValueError: bad shapes, fewer than 2 experts, non-finite logits, S < min_capacity when dropping.
    """
    logits = _check_logits(logits, 2)
    S, num_experts = logits.shape
    gates_SE = F.softmax(logits, dim=1)
    first_S = torch.argmax(gates_SE, dim=1)
    scores = logits + _gumbel_like(logits) if top2_2nd_expert_sampling else logits
    scores = scores.scatter(1, first_S.unsqueeze(1), float("-inf"))
    second_S = torch.argmax(scores, dim=1)
    expert_SK = torch.stack([first_S, second_S], 1)
    if used_token is not None:
        used_S = _mask_unused(first_S, used_token) >= 0
        expert_SK = torch.where(used_S.unsqueeze(1), expert_SK, -1)
    exp_counts = _counts(expert_SK.reshape(-1), num_experts)
    capacity = _capacity(logits, 2, capacity_factor, min_capacity, drop_tokens)
    slot_SK = assign_slots(expert_SK.t().reshape(-1), num_experts, _slots_capacity(capacity, logits, 2)).view(2, S).t()
    l_aux = _balance_loss(gates_SE, _counts(expert_SK.select(1, 0), num_experts), 1)
    return _plan(gates_SE, expert_SK, slot_SK, _resolver(capacity, exp_counts, ep_group), l_aux, exp_counts,
                 _z_loss(logits), True)


def topkgating(
    logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
    ep_group=None, drop_policy: str = "probs", *, used_token: torch.Tensor | None = None,
) -> Routing:
    """Top-k gating: the k most probable experts per token, weights renormalised over kept choices.

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        k: choices per token, 1 <= k <= E.
        capacity_factor, min_capacity, drop_tokens, ep_group: as in `top1gating`.
        drop_policy: over capacity, "probs" keeps each expert's C choices of largest gate probability,
            "position" keeps its first C choices in token order.
        used_token: optional [S] mask; tokens where it is 0 are routed nowhere.

    Returns:
        Routing with K = k.

    Raises:
        ValueError: bad k, shapes or drop_policy, non-finite logits, S < min_capacity when dropping.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    logits = _check_logits(logits, k)
    S, num_experts = logits.shape
    gates_SE = F.softmax(logits, dim=1)
    top_gate_SK, expert_SK = torch.topk(gates_SE, k, dim=1)
    if used_token is not None:
        used_S = _mask_unused(expert_SK.select(1, 0), used_token) >= 0
        expert_SK = torch.where(used_S.unsqueeze(1), expert_SK, -1)
    exp_counts = _counts(expert_SK.reshape(-1), num_experts)
    capacity = _capacity(logits, k, capacity_factor, min_capacity, drop_tokens)
    priority = top_gate_SK.reshape(-1) if (drop_policy == "probs" and drop_tokens) else None
    slot_SK = assign_slots(expert_SK.reshape(-1), num_experts, _slots_capacity(capacity, logits, k), priority).view(S, k)
    l_aux = _balance_loss(gates_SE, exp_counts, k)
    return _plan(gates_SE, expert_SK, slot_SK, _resolver(capacity, exp_counts, ep_group), l_aux, exp_counts,
                 _z_loss(logits), True)


def _check_policy(noisy_gate_policy) -> None:
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")


@dataclass(kw_only=True)
class TopKGateConfig:
    """Everything a gate decides with; validated on construction.

    Args:
        model_dim: M, the token width.
        num_experts: E, global number of experts.
        k: choices per token (1 top-1, 2 top-2, more top-k).
        capacity_factor: capacity factor in training.
        eval_capacity_factor: capacity factor in eval mode.
        min_capacity: the least number of slots per expert.
        noisy_gate_policy: None, "Jitter" (multiplicative input noise) or "RSample" (Gumbel top-1).
        drop_tokens: drop choices beyond capacity.
        use_rts: random token selection for top-1.
        top2_2nd_expert_sampling: Gumbel-sample the second expert for top-2.
        drop_policy: "probs" or "position", for k > 2.
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

    def __post_init__(self):
        if self.noisy_gate_policy == "None":
            self.noisy_gate_policy = None  # the recipe flags pass the string
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
        for name in ("capacity_factor", "eval_capacity_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if self.min_capacity < 0:
            raise ValueError(f"min_capacity must be >= 0, got {self.min_capacity}")
        _check_policy(self.noisy_gate_policy)
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}")


class TopKGate(torch.nn.Module):
    """The router: a bias-free linear map to expert logits, computed in fp32, then a gating policy.

    In eval mode the gate uses eval_capacity_factor and turns every noise off (Jitter, RSample,
    second-expert sampling and random token selection), so eval routing is deterministic.

    Args:
        model_dim, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
        noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling, drop_policy:
            see `TopKGateConfig`.
        ep_group: expert-parallel group for the dropless capacity reduction, or None.
    """

    def __init__(
        self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
        drop_tokens: bool = True, use_rts: bool = True, ep_group=None, top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ):
        super().__init__()
        self.config = TopKGateConfig(
            model_dim=model_dim, num_experts=num_experts, k=k, capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor, min_capacity=min_capacity,
            noisy_gate_policy=noisy_gate_policy, drop_tokens=drop_tokens, use_rts=use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling, drop_policy=drop_policy,
        )
        self.ep_group = ep_group
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False).float()

    def forward(self, x_SM: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """Route tokens.

        Args:
            x_SM: tokens, shape [S, M], any float dtype (the gate computes in fp32, or float64 for float64).
            used_token: optional [S] mask of tokens to route.

        Returns:
            the Routing plan.
        """
        cfg = self.config
        x_SM = x_SM.to(_gate_dtype(x_SM.dtype))
        if self.training and cfg.noisy_gate_policy == "Jitter":
            x_SM = x_SM * torch.empty_like(x_SM).uniform_(1.0 - JITTER_EPS, 1.0 + JITTER_EPS)
        with no_autocast(x_SM.device):  # the router stays fp32 under the model's autocast
            logits = F.linear(x_SM, self.wg.weight.to(x_SM.dtype))
        capacity_factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        if cfg.k == 1:
            return top1gating(
                logits, capacity_factor, cfg.min_capacity, used_token,
                cfg.noisy_gate_policy if self.training else None, cfg.drop_tokens,
                cfg.use_rts and self.training, self.ep_group,
            )
        if cfg.k == 2:
            return top2gating(
                logits, capacity_factor, cfg.min_capacity, cfg.drop_tokens, self.ep_group,
                cfg.top2_2nd_expert_sampling and self.training, used_token=used_token,
            )
        return topkgating(
            logits, cfg.k, capacity_factor, cfg.min_capacity, cfg.drop_tokens, self.ep_group,
            cfg.drop_policy, used_token=used_token,
        )
