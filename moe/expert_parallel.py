"""Running the experts across an expert-parallel group: exchange rows, run local experts, send back.

Shape legend: E experts in all, L = E / ep local experts, C capacity, M model dim, R = ep ranks.
Global expert g lives on EP rank g // L, so a buffer sorted by global expert is already cut into
one chunk per destination rank.

- padded (the capacity layout): the [E, C, M] buffer is exchanged in equal chunks; each rank gets
  [R, L, C, M], runs expert l on its R * C rows, and sends the outputs back the same way.
- packed (the dropless layout, and dropping layouts without padding): the kept counts per expert
  are exchanged first, then rows in variable chunks; received rows (by source rank, then local
  expert) are regrouped by local expert for the experts and put back in source order afterwards.
"""

import torch

from parallel import all_to_all, exchange_counts

__all__ = ["run_experts_padded", "run_experts_packed"]


def run_experts_padded(experts, buffer_NM: torch.Tensor, capacity: int, ep_size: int, ep_group) -> torch.Tensor:
    """Experts over the group for the capacity layout; buffer_NM is [E * C, M] sorted by global expert."""
    L, M = experts.num_local_experts, buffer_NM.shape[1]
    received = all_to_all(buffer_NM, ep_group)  # [R * L * C, M], chunk r from EP rank r
    local = received.view(ep_size, L, capacity, M).transpose(0, 1).reshape(L * ep_size * capacity, M)
    y = experts(local, None)  # expert l sees R * C rows
    back = y.view(L, ep_size, capacity, -1).transpose(0, 1).reshape(ep_size * L * capacity, -1)
    return all_to_all(back, ep_group)


def run_experts_packed(
    experts, buffer_NM: torch.Tensor, counts: list[int], ep_size: int, ep_group, grouped_gemm: bool = False
) -> torch.Tensor:
    """Experts over the group for packed rows; buffer_NM holds counts[g] rows per global expert g."""
    L = experts.num_local_experts
    send_RL = torch.tensor(counts, dtype=torch.int64).view(ep_size, L)
    recv_RL = exchange_counts(send_RL, ep_group)  # recv_RL[r, l]: rows rank r sends to local expert l
    input_splits, output_splits = send_RL.sum(1).tolist(), recv_RL.sum(1).tolist()
    received = all_to_all(buffer_NM, ep_group, output_splits, input_splits)
    local_expert = torch.repeat_interleave(torch.arange(L).repeat(ep_size), recv_RL.reshape(-1))
    by_expert = torch.argsort(local_expert, stable=True).to(buffer_NM.device)  # source order -> expert order
    y = experts(received.index_select(0, by_expert), recv_RL.sum(0).tolist(), grouped_gemm=grouped_gemm)
    in_source_order = torch.empty_like(by_expert)
    in_source_order[by_expert] = torch.arange(by_expert.numel(), device=by_expert.device)
    return all_to_all(y.index_select(0, in_source_order), ep_group, input_splits, output_splits)
