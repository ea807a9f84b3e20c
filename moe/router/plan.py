"""The routing plan a gate returns, the capacity it is built for, and the slot assignment every policy shares.

Shape legend: S tokens, E experts, K choices per token, C capacity, P = S * K choices in fill order.

A plan says, per token and choice, which expert it goes to (-1 when dropped), which slot of that
expert's capacity buffer it takes, and its combine weight. Kept choices of one expert always take
slots 0, 1, 2, ... in fill order, so the plan never needs an [S, E, C] tensor; `Routing.dense()`
builds DeepSpeed's dense form only for tests and interop.

Capacity follows DeepSpeed-MoE: C = max(ceil(S / E * capacity_factor * k), min_capacity); with
drop_tokens=False, C is the largest per-expert count (max-reduced over the expert-parallel group),
found only when the plan is asked for it, and nothing is dropped. This module holds the plan's
index side; its differentiable values (weights, l_aux, z_loss) come from `moe.router.outputs`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import expert_positions
from moe.router.balancing import choice_counts

__all__ = ["Routing", "assign_slots"]


@dataclass(frozen=True, eq=False)
class Routing:
    """Where each token's choices go.

    Args:
        expert_idx_SK: int64 expert per (token, choice), shape [S, K], -1 where dropped.
        slot_SK: int64 slot inside that expert's capacity buffer, shape [S, K], -1 where dropped.
        weight_SK: fp32 combine weight, shape [S, K], 0 where dropped; differentiable to the logits.
        resolve_capacity: returns C, slots per expert; read through `capacity`. Without dropping, C
            is the largest expert count (max-reduced over the expert-parallel group), which costs a
            host sync, so it is found only when asked for (the padded layout asks; packed and
            grouped never do), and only once.
        num_experts: E.
        l_aux: the load-balancing loss, a scalar.
        exp_counts: int64 choices per expert before dropping, shape [E].
        z_loss: the router z-loss mean(logsumexp(logits)^2) (ST-MoE), a scalar.
        max_rows: a bound on the kept choices known without a host sync (S * K, or E * C when the
            capacity is fixed); layouts of fixed size allocate this many rows. None: S * K.
        kept_counts_E: int64 kept choices per expert, shape [E], where the gate knows them (each
            expert keeps min(count, C) of its choices); None: counted from expert_idx_SK when asked.
            `kept_counts()` returns this tensor itself: read it, do not modify it.
    """

    expert_idx_SK: torch.Tensor
    slot_SK: torch.Tensor
    weight_SK: torch.Tensor
    resolve_capacity: Callable[[], int]
    num_experts: int
    l_aux: torch.Tensor
    exp_counts: torch.Tensor
    z_loss: torch.Tensor
    max_rows: int | None = None
    kept_counts_E: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        """C, slots per expert (the resolver finds the dropless one once, on first use).

        A plain property, not functools.cached_property: on Python < 3.12 that takes an RLock, which
        torch.compile cannot trace, so the padded layout could not compile in one graph.
        """
        return self.resolve_capacity()

    @property
    def kept_SK(self) -> torch.Tensor:
        return self.expert_idx_SK >= 0

    def kept_counts(self) -> torch.Tensor:
        """int64 kept choices per expert after dropping, shape [E] (no host sync): as the gate gave them,
        else counted by scatter-add."""
        if self.kept_counts_E is not None:
            return self.kept_counts_E
        return choice_counts(self.expert_idx_SK, self.num_experts)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpeed's dense form, for tests and interop only: it allocates [S, E, C].

        Returns:
            combine_weights: fp32, shape [S, E, C], the weight at (token, expert, slot).
            dispatch_mask: bool, shape [S, E, C], True where a choice was kept.
        """
        S, K = self.expert_idx_SK.shape
        kept = self.kept_SK
        token = torch.arange(S, device=kept.device).unsqueeze(1).expand(S, K)[kept]
        index = (token, self.expert_idx_SK[kept], self.slot_SK[kept])
        shape = (S, self.num_experts, self.capacity)
        combine = torch.zeros(shape, dtype=torch.float32, device=kept.device)
        combine = combine.index_put(index, self.weight_SK[kept].float())
        mask = torch.zeros(shape, dtype=torch.bool, device=kept.device)
        mask[index] = True
        return combine, mask


def assign_slots(
    expert_P: torch.Tensor, num_experts: int, capacity: int, priority_P: torch.Tensor | None = None,
    all_routed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give each choice a slot in its expert's buffer, dropping what does not fit.

    Without a priority, an expert keeps its first `capacity` choices in fill order. With one, it keeps
    the `capacity` choices of highest priority (ties: earlier in fill order). Either way the kept
    choices take slots 0, 1, ... in fill order, so each expert keeps min(count, capacity) of them.

    Args:
        expert_P: int64 expert per choice, in fill order, shape [P]; -1 for choices routed nowhere.
        num_experts: E.
        capacity: C.
        priority_P: optional float priority per choice, shape [P].
        all_routed: the caller knows expert_P holds no -1 (see kernels.slots.expert_positions).

    Returns:
        counts_E: int64 choices per expert before dropping, shape [E] (the plan's exp_counts).
        kept_E: int64 choices per expert kept, min(counts_E, C), shape [E] (a tensor of its own).
        slot_P: int64, shape [P], -1 for dropped choices.
    """
    counts_E = None
    if priority_P is not None:  # rank each expert's choices by priority (ties: fill order), keep the top C
        order = torch.argsort(priority_P, descending=True, stable=True)
        counts_E, rank_in_order = expert_positions(expert_P.index_select(0, order), num_experts, all_routed)
        rank_P = torch.empty_like(rank_in_order).scatter_(0, order, rank_in_order)
        expert_P = torch.where((rank_P >= 0) & (rank_P < capacity), expert_P, -1)
        all_routed = False  # the priority's drop routed some nowhere
    counts_or_kept_E, slot_P = expert_positions(expert_P, num_experts, all_routed)  # kept ones after a priority's drop
    counts_E = counts_or_kept_E if counts_E is None else counts_E
    return counts_E, counts_E.clamp(max=capacity), torch.where(slot_P < capacity, slot_P, -1)


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


def _max_rows(capacity: int | None, num_tokens: int, k: int, num_experts: int) -> int:
    """A bound on kept rows known without a host sync: S * k, or E * C when the capacity is fixed."""
    return num_tokens * k if capacity is None else min(num_tokens * k, num_experts * capacity)
