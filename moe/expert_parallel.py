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

from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange

from kernels import sync_checks
from parallel import all_to_all, exchange_counts

__all__ = [
    "Exchange", "check_equal_tokens", "plan_exchange", "read_counts", "read_exchange", "run_experts_padded",
    "run_experts_packed",
]


def check_equal_tokens(num_tokens: int, device: torch.device, ep_group) -> None:
    """Fail on every rank when the group's ranks route different token counts in the capacity layout.

    Capacity is computed from the local token count, so unequal counts would exchange chunks of
    different sizes. The check reads the group's counts on the host: always on the CPU (no device
    to stall), and with MOE_SYNC_CHECKS=1 elsewhere.

    Raises:
        ValueError: the counts differ, naming the smallest and largest.
    """
    if device.type != "cpu" and not sync_checks():
        return
    bounds = torch.tensor([num_tokens, -num_tokens], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=ep_group)
    largest, negative_smallest = bounds.tolist()
    smallest = -negative_smallest
    if largest != smallest:
        raise ValueError(
            f"the padded (capacity) layout needs the same number of tokens on every rank of the expert-parallel "
            f"group, got between {smallest} and {largest}; send equal batches or use dropless=True"
        )


def run_experts_padded(experts, buffer_NM: torch.Tensor, capacity: int, ep_size: int, ep_group) -> torch.Tensor:
    """Experts over the group for the capacity layout; buffer_NM is [E * C, M] sorted by global expert."""
    L, M = experts.num_local_experts, buffer_NM.shape[1]
    received = all_to_all(buffer_NM, ep_group)  # [R * L * C, M], chunk r from EP rank r
    local = rearrange(received, "(r l c) m -> (l r c) m", r=ep_size, l=L, c=capacity)
    y = experts(local, None)  # expert l sees R * C rows
    back = rearrange(y, "(l r c) m -> (r l c) m", r=ep_size, l=L, c=capacity)
    return all_to_all(back, ep_group)


@dataclass(frozen=True)
class Exchange:
    """Row counts of one packed exchange: known on the host after the layer's one sync.

    Args:
        send: rows this rank sends to each EP rank.
        recv: rows this rank receives from each EP rank.
        recv_RL: int64 rows from rank r for local expert l, shape [R, L], on the device.
        local_counts: rows per local expert after regrouping (sums of recv_RL over r).
    """

    send: list[int]
    recv: list[int]
    recv_RL: torch.Tensor
    local_counts: list[int]


def plan_exchange(counts_E: torch.Tensor, ep_size: int, ep_group) -> Exchange:
    """Exchange the kept counts per expert, then read what the row exchange needs: one host sync.

    Args:
        counts_E: int64 kept rows per global expert on this rank, shape [E], on the device.
    """
    send_RL = counts_E.view(ep_size, -1)
    recv_RL = exchange_counts(send_RL, ep_group)  # recv_RL[r, l]: rows rank r sends to local expert l
    send, recv, local_counts = read_exchange(send_RL, recv_RL)
    return Exchange(send, recv, recv_RL, local_counts)


def read_exchange(send_RL: torch.Tensor, recv_RL: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Rows sent to and received from each rank, and rows per local expert: the layer's one host read."""
    ranks = send_RL.shape[0]
    host = _sizes(torch.cat([send_RL.sum(1), recv_RL.sum(1), recv_RL.sum(0)]).tolist())
    return host[:ranks], host[ranks:2 * ranks], host[2 * ranks:]


def read_counts(counts_E: torch.Tensor) -> list[int]:
    """Kept rows per expert on the host (one process, packed layout): the layer's one host read."""
    return _sizes(counts_E.tolist())


def _sizes(counts: list) -> list:
    """Counts known to be sizes: compiled with capture_scalar_outputs they are symbolic, and shapes need >= 0."""
    if torch.compiler.is_compiling():
        for count in counts:
            torch._check(count >= 0)
    return counts


def run_experts_packed(experts, buffer_NM: torch.Tensor, exchange: Exchange, ep_group,
                       grouped_gemm: bool | None = False) -> torch.Tensor:
    """Experts over the group for packed rows; buffer_NM holds the kept rows sorted by global expert."""
    L, device = experts.num_local_experts, buffer_NM.device
    received = all_to_all(buffer_NM, ep_group, exchange.recv, exchange.send)
    ranks = exchange.recv_RL.shape[0]
    local_expert = torch.repeat_interleave(torch.arange(L, device=device).repeat(ranks), exchange.recv_RL.reshape(-1),
                                           output_size=received.shape[0])
    by_expert = torch.argsort(local_expert, stable=True)  # source order -> expert order
    y = experts(received.index_select(0, by_expert), exchange.local_counts, grouped_gemm=grouped_gemm)
    in_source_order = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(by_expert.numel(), device=device))
    return all_to_all(y.index_select(0, in_source_order), ep_group, exchange.send, exchange.recv)
