"""Selection: DeepSpeed's top-1, top-2 and top-k policies, returning a routing plan instead of dense masks.

Shape legend: S tokens, E experts, K choices per token, C capacity, M model dim.

A policy takes the logits, scores them (moe.router.scoring), picks each token's experts (with
DeepSpeed's noise where asked), assigns slots within the capacity (moe.router.plan) and builds the
plan's weights and losses (moe.router.outputs). Everything here computes in fp32 whatever the model
dtype (float64 inputs stay float64, for gradient checks). Semantics follow DeepSpeed-MoE's
top1gating, top2gating and topkgating; where DeepSpeed leaves an order open (ties, which tokens keep
their slot), ours is first-come by token index.

`topkgating` also carries the routers of current MoE models (names follow DeepSeek-V3's config):
sigmoid scoring, an expert bias for auxiliary-loss-free balancing, group-limited routing, optional
weight normalisation and scaling; and every policy takes a `load_balancing_type` (moe.router.balancing).
"""

import torch

from moe.router.balancing import balance_loss, choice_counts, normalized_scores
from moe.router.outputs import _plan, _softmax_plan, _z_loss
from moe.router.plan import Routing, _capacity, _max_rows, _resolver, _slots_capacity, assign_slots
from moe.router.scoring import SCORING_FUNCS, _check_logits, expert_softmax

# also offered under moe.gating, the import path moe/__init__.py keeps for this module
from kernels import sync_checks  # noqa: F401
from moe.router.balancing import balance_fraction  # noqa: F401
from moe.router.outputs import gate_outputs  # noqa: F401
from moe.router.scoring import SOFTMAX_ROW  # noqa: F401

__all__ = ["SCORING_FUNCS", "expert_softmax", "top1gating", "top2gating", "topkgating"]

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")
JITTER_EPS = 1e-2


def _neg_gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Minus Gumbel(0, 1) noise, log(-log(U)); U is kept off 0 so the noise stays finite."""
    uniform = torch.rand_like(t).clamp_(min=torch.finfo(t.dtype).tiny)
    return uniform.log_().neg_().log_()


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, -log(-log(U))."""
    return _neg_gumbel_like(t).neg_()


def _argmax(scores_SE: torch.Tensor) -> torch.Tensor:
    """argmax over experts, the first index on ties (as torch.argmax): max's indices, which torch
    computes over a short last dimension several times faster than argmax on the CPU."""
    return torch.max(scores_SE, dim=1).indices


def _mask_unused(choice_S: torch.Tensor, used_token: torch.Tensor | None) -> torch.Tensor:
    if used_token is None:
        return choice_S
    used = used_token.reshape(-1)
    if used.numel() != choice_S.numel():
        raise ValueError(f"used_token must have {choice_S.numel()} elements (one per token), got {used.numel()}")
    return torch.where(used != 0, choice_S, -1)


def _own_fraction(counts_E: torch.Tensor, num_tokens: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The policies' own f of l_aux = E * sum_e mean_s(gates[s, e]) * f_e (DeepSpeed's): f_e = counts_e / (S * k)."""
    return counts_E.to(dtype) / max(num_tokens * k, 1)


def top1gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True, ep_group=None, *,
    load_balancing_type: str = "aux_loss", seq_len: int | None = None, global_counts=None,
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
        load_balancing_type, seq_len, global_counts: the balance loss, see `moe.router.balancing.balance_loss`;
            "aux_loss" is DeepSpeed's top-1 loss.

    Returns:
        Routing with K = 1; weights are the gate probabilities (not renormalised).

    Raises:
        ValueError: bad shapes, an unknown policy, S < min_capacity when dropping, or non-finite logits
            (that check reads a device value, so it runs only with MOE_SYNC_CHECKS=1; see kernels.backend).
    """
    _check_policy(noisy_gate_policy)
    logits = _check_logits(logits, 1)
    gates_SE = expert_softmax(logits.detach())
    top_S = _argmax(gates_SE)
    choice_S = _mask_unused(_argmax(logits.detach() + _gumbel_like(logits)) if noisy_gate_policy == "RSample" else top_S,
                            used_token)
    num_experts = logits.shape[1]
    capacity = _capacity(logits, 1, capacity_factor, min_capacity, drop_tokens)
    priority = torch.rand(choice_S.shape, device=logits.device) if (use_rts and drop_tokens) else None
    exp_counts, kept_counts, slot_S = assign_slots(choice_S, num_experts, _slots_capacity(capacity, logits, 1),
                                                   priority, all_routed=used_token is None)
    balance = {"load_balancing_type": load_balancing_type, "seq_len": seq_len, "global_counts": global_counts}
    return _softmax_plan(
        logits, gates_SE, choice_S.unsqueeze(1), slot_S.unsqueeze(1), _resolver(capacity, exp_counts, ep_group),
        exp_counts, _max_rows(capacity, logits.shape[0], 1, num_experts), False, balance, choice_S.unsqueeze(1),
        lambda: _own_fraction(exp_counts, logits.shape[0], 1, logits.dtype), top_S,
        kept_counts=kept_counts,
    )


def top2gating(
    logits: torch.Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True, ep_group=None,
    top2_2nd_expert_sampling: bool = True, *, used_token: torch.Tensor | None = None,
    load_balancing_type: str = "aux_loss", seq_len: int | None = None, global_counts=None,
) -> Routing:
    """Top-2 gating (GShard): the most probable expert, then a second one sampled from the rest.

    First choices fill each expert in token order, then second choices after all first choices; a
    choice whose slot is >= C is dropped. The two weights are renormalised to sum to 1.

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        capacity_factor, min_capacity, drop_tokens, ep_group: as in `top1gating`, with k = 2.
        top2_2nd_expert_sampling: add Gumbel noise to the logits before picking the second expert.
        used_token: optional [S] mask; tokens where it is 0 are routed nowhere.
        load_balancing_type, seq_len, global_counts: as in `top1gating`; "aux_loss" is DeepSpeed's
            top-2 loss (first choices only), the other types count both choices.

    Returns:
        Routing with K = 2.

    Raises:
        ValueError: bad shapes, fewer than 2 experts, non-finite logits, S < min_capacity when dropping.
    """
    logits = _check_logits(logits, 2)
    S, num_experts = logits.shape
    gates_SE = expert_softmax(logits.detach())
    first_S = _argmax(gates_SE)
    if top2_2nd_expert_sampling:  # logits + Gumbel noise, as logits - log(-log U): the same values, one pass fewer
        scores = _neg_gumbel_like(logits)
        torch.sub(logits.detach(), scores, out=scores)
    else:
        scores = logits.detach().clone()
    scores.scatter_(1, first_S.unsqueeze(1), float("-inf"))  # a fresh tensor either way: no second copy
    second_S = _argmax(scores)
    expert_KS = torch.stack([first_S, second_S])  # the fill order: every first choice, then every second
    if used_token is not None:
        used_S = _mask_unused(first_S, used_token) >= 0
        expert_KS = torch.where(used_S, expert_KS, -1)
    capacity = _capacity(logits, 2, capacity_factor, min_capacity, drop_tokens)
    exp_counts, kept_counts, slot_P = assign_slots(expert_KS.view(-1), num_experts, _slots_capacity(capacity, logits, 2),
                                                   all_routed=used_token is None)
    # row-major like every [S, K] of the plan, so no later reshape copies it (clone, not contiguous(),
    # which fails on fake CUDA tensors of a CPU-only torch build: the simulated GPU world)
    slot_SK = slot_P.view(2, S).t().clone(memory_format=torch.contiguous_format)
    expert_SK = (torch.stack([first_S, second_S], 1) if used_token is None
                 else expert_KS.t().clone(memory_format=torch.contiguous_format))
    balance = {"load_balancing_type": load_balancing_type, "seq_len": seq_len, "global_counts": global_counts}
    return _softmax_plan(  # DeepSpeed's aux_loss counts the first choices only
        logits, gates_SE, expert_SK, slot_SK, _resolver(capacity, exp_counts, ep_group), exp_counts,
        _max_rows(capacity, S, 2, num_experts), True, balance, expert_SK,
        lambda: _own_fraction(choice_counts(expert_KS.select(0, 0), num_experts), S, 1, logits.dtype), first_S,
        kept_counts=kept_counts,
    )


def _limit_groups(select_SE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2/V3): keep each token's topk_group groups of experts, ranked by the
    sum of the two highest selection scores in the group; the other experts' scores become -inf."""
    S, num_experts = select_SE.shape
    select_SGX = select_SE.view(S, n_group, num_experts // n_group)
    group_score_SG = select_SGX.topk(min(2, select_SGX.shape[2]), dim=2).values.sum(2)
    keep_SG = torch.zeros_like(group_score_SG, dtype=torch.bool)
    keep_SG = keep_SG.scatter(1, _stable_topk(group_score_SG, topk_group), True)
    return select_SGX.masked_fill(~keep_SG.unsqueeze(2), float("-inf")).view(S, num_experts)


def _stable_topk(scores_SX: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row, ties to the lower index (torch.topk leaves ties open)."""
    return torch.argsort(scores_SX, dim=1, descending=True, stable=True).narrow(1, 0, k)


def _check_group_limit(num_experts: int, k: int, n_group: int | None, topk_group: int | None) -> None:
    """n_group must divide E and the kept groups must hold at least k experts."""
    if n_group is None and topk_group is None:
        return
    if n_group is None or topk_group is None:
        raise ValueError(f"group-limited routing needs both n_group and topk_group, got n_group={n_group}, "
                         f"topk_group={topk_group}")
    for name, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group ({n_group}) must divide num_experts ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group ({topk_group}) must be between 1 and n_group ({n_group})")
    if topk_group * (num_experts // n_group) < k:
        raise ValueError(f"topk_group * (num_experts / n_group) = {topk_group} * {num_experts // n_group} must be "
                         f">= k ({k}): the kept groups must hold k experts")


def topkgating(
    logits: torch.Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
    ep_group=None, drop_policy: str = "probs", *, used_token: torch.Tensor | None = None,
    scoring_func: str = "softmax", norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
    expert_bias: torch.Tensor | None = None, n_group: int | None = None, topk_group: int | None = None,
    load_balancing_type: str = "aux_loss", seq_len: int | None = None, global_counts=None,
) -> Routing:
    """Top-k gating: the k highest-scoring experts per token.

    Scores are s = softmax(logits) or sigmoid(logits). Selection ranks s + expert_bias (the bias only
    steers selection), limited to the token's best groups with n_group; the weights are the selected
    s, divided by their sum over the kept choices when norm_topk_prob, times routed_scaling_factor.

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        k: choices per token, 1 <= k <= E.
        capacity_factor, min_capacity, drop_tokens, ep_group: as in `top1gating`.
        drop_policy: over capacity, "probs" keeps each expert's C choices of largest score, "position"
            keeps its first C choices in token order.
        used_token: optional [S] mask; tokens where it is 0 are routed nowhere.
        scoring_func: "softmax" or "sigmoid".
        norm_topk_prob: renormalise each token's kept weights to sum to 1 (DeepSpeed's top-k does).
        routed_scaling_factor: a factor on every weight.
        expert_bias: optional [E] bias added to the scores for selection only (auxiliary-loss-free
            balancing); never differentiated.
        n_group, topk_group: group-limited routing: E experts in n_group equal groups, each token keeps
            its topk_group groups ranked by the sum of their two highest selection scores.
        load_balancing_type, seq_len, global_counts: the balance loss (moe.router.balancing), P from the
            scores normalised over all experts; "aux_loss" is DeepSpeed's top-k loss.

    Returns:
        Routing with K = k.

    Raises:
        ValueError: bad k, shapes, drop_policy, scoring_func or groups; non-finite logits; S < min_capacity
            when dropping.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    logits = _check_logits(logits, k)
    S, num_experts = logits.shape
    _check_group_limit(num_experts, k, n_group, topk_group)
    softmax = scoring_func == "softmax"  # its outputs then reach the logits through one node (_softmax_plan)
    scores_SE = expert_softmax(logits.detach()) if softmax else torch.sigmoid(logits)
    select_SE = scores_SE.detach()
    if expert_bias is not None:
        select_SE = select_SE + expert_bias.detach().to(select_SE.dtype)
    if n_group is not None:
        select_SE = _limit_groups(select_SE, n_group, topk_group)
    if expert_bias is None and n_group is None:
        expert_SK = torch.topk(scores_SE, k, dim=1).indices  # DeepSpeed's selection, ties as torch.topk takes them
        top_S = expert_SK.select(1, 0)  # a largest score, for the z-loss (moe.router.outputs)
    else:
        expert_SK = _stable_topk(select_SE, k)
        top_S = _argmax(scores_SE)
    top_score_SK = scores_SE.detach().gather(1, expert_SK)
    if used_token is not None:
        used_S = _mask_unused(expert_SK.select(1, 0), used_token) >= 0
        expert_SK = torch.where(used_S.unsqueeze(1), expert_SK, -1)
    capacity = _capacity(logits, k, capacity_factor, min_capacity, drop_tokens)
    priority = top_score_SK.reshape(-1) if (drop_policy == "probs" and drop_tokens) else None
    exp_counts, kept_counts, slot_P = assign_slots(expert_SK.reshape(-1), num_experts,
                                                   _slots_capacity(capacity, logits, k), priority,
                                                   all_routed=used_token is None)
    slot_SK = slot_P.view(S, k)
    resolve, max_rows = _resolver(capacity, exp_counts, ep_group), _max_rows(capacity, S, k, num_experts)
    own_fraction = lambda: _own_fraction(exp_counts, S, k, logits.dtype)  # noqa: E731
    if softmax:
        balance = {"load_balancing_type": load_balancing_type, "seq_len": seq_len, "global_counts": global_counts}
        return _softmax_plan(logits, scores_SE, expert_SK, slot_SK, resolve, exp_counts, max_rows, norm_topk_prob,
                             balance, expert_SK, own_fraction, top_S, routed_scaling_factor,
                             kept_counts=kept_counts)
    probs_SE = normalized_scores(scores_SE, scoring_func)
    l_aux = balance_loss(
        load_balancing_type, probs_SE, expert_SK, seq_len=seq_len, global_counts=global_counts,
        default=own_fraction,
    )
    return _plan(scores_SE, expert_SK, slot_SK, resolve, l_aux, exp_counts, _z_loss(logits), norm_topk_prob,
                 routed_scaling_factor, max_rows, kept_counts=kept_counts)


def _check_policy(noisy_gate_policy) -> None:
    if noisy_gate_policy not in NOISY_GATE_POLICIES:
        raise ValueError(f"noisy_gate_policy must be one of {NOISY_GATE_POLICIES}, got {noisy_gate_policy!r}")
