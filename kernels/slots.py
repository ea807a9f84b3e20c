"""Routing to slots: from the expert of every choice to its row of the dispatch buffer.

    counts_E[e]   = number of choices routed to expert e (before dropping)
    position_P[p] = how many earlier choices (in fill order) went to the same expert
    capacity layout (capacity = C): row = e * C + position if position < C, else -1 (dropped)
    dropless layout (capacity = None): row = offsets_E[e] + position, offsets_E = exclusive cumsum of counts

`expert_positions` gives the positions; a gate turns them into slots (dropping what does not fit, see
moe.router.plan) and `buffer_rows` turns slots into rows.

Shape legend: P choices in fill order (the caller flattens [S, K] token-major, or choice-major for
top-2's "first choices before second choices"), E experts. Choices with expert -1 go nowhere. The
Triton kernel runs one program per expert scanning the choices block by block with a running
prefix sum: no atomics, so positions are deterministic.
"""

import functools

import torch

from kernels.backend import launcher, sync_checks, use_triton

__all__ = ["buffer_rows", "expert_positions", "expert_positions_reference"]


def expert_positions_reference(expert_P: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: counts per expert and each choice's position among its expert's choices.

    Args:
        expert_P: int64 expert per choice in fill order, shape [P]; -1 for choices routed nowhere.
        num_experts: E.

    Returns:
        counts_E: int64, shape [E]; position_P: int64, shape [P], -1 where expert_P is -1.
    """
    routed = expert_P >= 0
    bucket_P = torch.where(routed, expert_P, num_experts)
    order = torch.argsort(bucket_P, stable=True)
    counts = _count(bucket_P, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    ranks_sorted = torch.arange(expert_P.numel(), device=expert_P.device) - starts[bucket_P[order]]
    position_P = torch.empty_like(ranks_sorted)
    position_P[order] = ranks_sorted
    return counts.narrow(0, 0, num_experts), torch.where(routed, position_P, -1)


def _count(bucket_P: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """int64 occurrences of each bucket id in [0, num_buckets); a scatter-add, so no host sync (bincount syncs on CUDA)."""
    counts = torch.zeros(num_buckets, dtype=torch.int64, device=bucket_P.device)
    return counts.scatter_add_(0, bucket_P, torch.ones_like(bucket_P))


@functools.cache
def _expert_positions_kernel():
    """The Triton kernel, built on first use so that CPU-only use never imports triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def _expert_positions_kernel(expert_ptr, position_ptr, counts_ptr, n_choices, BLOCK_P: tl.constexpr):
        # one program per expert: a running prefix sum over the choices that chose it
        expert = tl.program_id(0)
        seen = tl.zeros([1], dtype=tl.int64)  # a one-element block: loop-carried with a fixed type
        for start in range(0, n_choices, BLOCK_P):
            offsets = start + tl.arange(0, BLOCK_P)
            mask = offsets < n_choices
            chosen = tl.load(expert_ptr + offsets, mask=mask, other=-1) == expert
            ranks = tl.cumsum(chosen.to(tl.int64), axis=0) - 1 + seen
            tl.store(position_ptr + offsets, ranks, mask=mask & chosen)
            seen += tl.sum(chosen.to(tl.int64), axis=0)
        tl.store(counts_ptr + expert + tl.arange(0, 1), seen)

    return _expert_positions_kernel


def expert_positions(expert_P: torch.Tensor, num_experts: int, all_routed: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts per expert and each choice's position in fill order (Triton on CUDA, torch elsewhere).

    Args:
        expert_P: int64 expert per choice in fill order, shape [P]; -1 for choices routed nowhere.
        num_experts: E.
        all_routed: the caller knows expert_P holds no -1 (no token mask): on the CPU the running counts
            then need no bucket for unrouted choices, nor a pass that marks them (same results).

    Returns:
        counts_E: int64, shape [E]; position_P: int64, shape [P], -1 where expert_P is -1.

    Raises:
        ValueError: if expert_P is not a 1-D int64 tensor, or (with MOE_SYNC_CHECKS=1, see kernels.backend)
            holds an expert >= num_experts.
    """
    if expert_P.dim() != 1 or expert_P.dtype != torch.int64:
        raise ValueError(f"expert_P must be a 1-D int64 tensor, got {expert_P.dtype} {list(expert_P.shape)}")
    if sync_checks() and expert_P.numel() and int(expert_P.max()) >= num_experts:
        raise ValueError(f"expert_P holds expert {int(expert_P.max())}, but num_experts is {num_experts}")
    if use_triton(torch.empty(0, device=expert_P.device)):
        return _expert_positions_triton(expert_P.contiguous(), num_experts)
    if (num_experts + 1) * expert_P.numel() <= SMALL_POSITIONS:
        return _expert_positions_by_cumsum(expert_P, num_experts, all_routed)
    return expert_positions_reference(expert_P, num_experts)


SMALL_POSITIONS = 1 << 19  # (E + 1) * P up to this: running counts per expert beat a stable sort (CPU, torch)


def _expert_positions_by_cumsum(expert_P: torch.Tensor, num_experts: int, all_routed: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's result from running counts: row e of an [E + 1, P] indicator, cumulated along P
    (E rows when `all_routed`: no choice needs the spare bucket).

    For few experts and choices this is faster than the reference's stable sort; its memory
    grows with E * P, hence the bound. int32 running counts: P <= SMALL_POSITIONS fits.
    """
    if all_routed:
        bucket_P = expert_P
    else:
        routed = expert_P >= 0
        bucket_P = torch.where(routed, expert_P, num_experts)  # unrouted choices count in a spare bucket
    buckets = torch.arange(num_experts + (not all_routed), device=expert_P.device).unsqueeze(1)
    running_BP = (bucket_P.unsqueeze(0) == buckets).cumsum(1, dtype=torch.int32)
    position_P = running_BP.gather(0, bucket_P.unsqueeze(0)).squeeze(0).long() - 1
    counts_E = running_BP[:num_experts, -1].long() if expert_P.numel() else bucket_P.new_zeros(num_experts)
    return counts_E, position_P if all_routed else torch.where(routed, position_P, -1)


def _expert_positions_launch(expert_P: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: one program per expert (a torch custom op where traced, so fake and meta tensors get
    shapes only; see kernels.backend.launcher)."""
    position_P = torch.full_like(expert_P, -1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=expert_P.device)
    if num_experts:
        _expert_positions_kernel()[(num_experts,)](expert_P, position_P, counts_E, expert_P.numel(), BLOCK_P=1024)
    return counts_E, position_P


_expert_positions_triton = launcher(
    "exactmoe::expert_positions", _expert_positions_launch,
    lambda expert_P, num_experts: (expert_P.new_empty(num_experts), torch.empty_like(expert_P)))


def buffer_rows(expert_P: torch.Tensor, slot_P: torch.Tensor, capacity: int | None = None,
                counts_E: torch.Tensor | None = None) -> torch.Tensor:
    """Each choice's row of the dispatch buffer, from its expert and its slot among that expert's choices.

    Args:
        expert_P: int64 expert per choice, any shape; -1 where the choice was dropped or routed nowhere.
        slot_P: int64 slot per choice (its position among the kept choices of its expert), same shape.
        capacity: C for the capacity layout (row = expert * C + slot); None for the packed layout.
        counts_E: int64 kept choices per expert, shape [E]; the packed layout's rows follow each other
            expert by expert (row = offsets_E[expert] + slot, offsets_E the exclusive cumsum of counts).

    Returns:
        row_P: int64, shape of expert_P, -1 where expert_P is -1.
    """
    if (capacity is None) == (counts_E is None):
        raise ValueError(f"give exactly one of capacity (padded rows) or counts_E (packed rows), got "
                         f"capacity={capacity!r} and counts_E={'None' if counts_E is None else 'a tensor'}")
    expert = expert_P.clamp(min=0)
    if capacity is not None:
        row_P = expert * capacity + slot_P
    else:
        offsets_E = torch.cumsum(counts_E, 0) - counts_E
        row_P = torch.take(offsets_E, expert) + slot_P
    return torch.where(expert_P >= 0, row_P, -1)
