"""expert_positions (the Triton kernel against the torch reference, compared exactly) and buffer_rows."""

import pytest
import torch

from kernels import buffer_rows, expert_positions, expert_positions_reference
from tests.devices import DEVICE


@pytest.mark.parametrize("P,E,unrouted", [(0, 4, 0.0), (1, 1, 0.0), (37, 5, 0.2), (1500, 8, 0.1), (64, 16, 0.0)])
def test_positions_match_reference(P, E, unrouted, kernel_backend):
    g = torch.Generator().manual_seed(P + E)
    expert_P = torch.randint(0, max(E // 2, 1), (P,), generator=g)  # some experts stay empty
    expert_P[torch.rand(P, generator=g) < unrouted] = -1
    expert_P = expert_P.to(DEVICE)
    counts, positions = expert_positions(expert_P, E)
    ref_counts, ref_positions = expert_positions_reference(expert_P, E)
    assert torch.equal(counts, ref_counts) and torch.equal(positions, ref_positions)


@pytest.mark.parametrize("P,E", [(0, 3), (1, 1), (9, 1), (300, 7), (5000, 8), (20000, 20)])
def test_running_count_positions_equal_the_sorted_ones(P, E):
    """The CPU path for few experts and choices (running counts) against the reference (a stable sort)."""
    from kernels.slots import SMALL_POSITIONS, _expert_positions_by_cumsum

    g = torch.Generator().manual_seed(P * 3 + E)
    expert_P = torch.randint(-1, E, (P,), generator=g)  # -1: routed nowhere
    assert (E + 1) * P <= SMALL_POSITIONS
    for got, want in zip(_expert_positions_by_cumsum(expert_P, E), expert_positions_reference(expert_P, E)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    if P and E == 8:  # the public entry takes this path here
        assert torch.equal(expert_positions(expert_P, E)[1], expert_positions_reference(expert_P, E)[1])
    routed_P = expert_P.clamp(min=0)  # every choice routed: the caller may say so, and no spare bucket is kept
    for got, want in zip(_expert_positions_by_cumsum(routed_P, E, all_routed=True),
                         expert_positions_reference(routed_P, E)):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_positions_follow_fill_order():
    counts, positions = expert_positions_reference(torch.tensor([2, 0, 2, -1, 2, 0]), 3)
    assert counts.tolist() == [2, 0, 3]
    assert positions.tolist() == [0, 0, 1, -1, 2, 1]


def test_buffer_rows_layouts(kernel_backend, monkeypatch):
    expert_P = torch.tensor([1, 1, 0, 1, -1, 0, 1], device=DEVICE)
    counts, positions = expert_positions(expert_P, 3)
    assert counts.tolist() == [2, 4, 0] and positions.tolist() == [0, 1, 0, 2, -1, 1, 3]
    slot = torch.where(positions < 2, positions, -1)  # capacity 2: expert 1 keeps its first two
    kept_expert = torch.where(slot >= 0, expert_P, -1)
    assert buffer_rows(kept_expert, slot, capacity=2).tolist() == [2, 3, 0, -1, -1, 1, -1]
    # packed: expert 0's two rows, then expert 1's four, expert 2 empty
    assert buffer_rows(expert_P, positions, counts_E=counts).tolist() == [2, 3, 0, 4, -1, 1, 5]
    kept_counts = torch.tensor([2, 2, 0], device=DEVICE)
    assert buffer_rows(kept_expert, slot, counts_E=kept_counts).tolist() == [2, 3, 0, -1, -1, 1, -1]
    with pytest.raises(ValueError, match="exactly one of capacity"):
        buffer_rows(expert_P, positions)
    monkeypatch.setenv("MOE_SYNC_CHECKS", "1")  # the range check reads a device value: opt-in
    with pytest.raises(ValueError, match="holds expert 3, but num_experts is 3"):
        expert_positions(torch.tensor([3], device=DEVICE), 3)
