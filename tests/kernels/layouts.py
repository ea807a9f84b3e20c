"""Random routing layouts for the dispatch-op tests: each (token, choice)'s buffer row, padded or packed."""

import torch

from tests.devices import DEVICE


def row_layout(S, K, num_experts, capacity, drop_fraction, seed, packed):
    """row_SK for a random routing: padded (row = e * C + slot) or packed (no empty rows)."""
    g = torch.Generator().manual_seed(seed)
    expert_SK = torch.stack([torch.randperm(num_experts, generator=g)[:K] for _ in range(S)]) if S else torch.zeros(0, K, dtype=torch.long)
    dropped = torch.rand(S, K, generator=g) < drop_fraction
    expert_SK = torch.where(dropped, -1, expert_SK)
    row_SK = torch.full((S, K), -1, dtype=torch.long)
    fill = [0] * num_experts
    for s in range(S):
        for j in range(K):
            e = int(expert_SK[s, j])
            if e >= 0 and fill[e] < capacity:
                row_SK[s, j] = e * capacity + fill[e]
                fill[e] += 1
    num_rows = num_experts * capacity
    if packed:
        used = torch.sort(row_SK[row_SK >= 0]).values
        remap = torch.full((num_rows,), -1, dtype=torch.long)
        remap[used] = torch.arange(used.numel())
        row_SK = torch.where(row_SK >= 0, remap[row_SK.clamp(min=0)], -1)
        num_rows = used.numel()
    return row_SK.to(DEVICE), num_rows


CASES = [
    # S, K, M, experts, capacity, drop fraction, packed
    (0, 2, 8, 4, 3, 0.0, False),
    (1, 1, 5, 2, 1, 0.0, True),
    (7, 2, 33, 4, 3, 0.2, False),
    (16, 3, 17, 5, 6, 0.3, True),
    (32, 2, 64, 8, 5, 0.0, False),
    (9, 1, 1, 3, 2, 0.5, True),
]
