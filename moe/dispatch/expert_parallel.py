"""Expert parallelism as dispatchers: a token's row travels by all-to-all to the rank holding its expert.

Shape legend: E experts in all, L = E / ep local experts, C capacity, M model dim, R = ep ranks.
Global expert g lives on EP rank g // L, so a buffer sorted by global expert is already cut into
one chunk per destination rank.

- PaddedExpertParallel (the capacity layout): the [E, C, M] buffer is exchanged in equal chunks; each
  rank gets [R, L, C, M] and hands its experts [L, R * C, M]; outputs return the same way.
- PackedExpertParallel (dropless, and dropping without padding): the kept counts per expert are
  exchanged first and read on the host (the layer's one sync), then rows in variable chunks;
  received rows (by source rank, then local expert) are regrouped by local expert for the experts
  and put back in source order before they return.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange

from kernels import sync_checks
from moe.dispatch.base import Dispatched, combine_tokens, permute_tokens, sizes
from moe.dispatch.local import Packed, Padded
from parallel import all_to_all, exchange_counts

__all__ = ["Exchange", "PackedExpertParallel", "PaddedExpertParallel", "check_equal_tokens", "plan_exchange"]


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


class PaddedExpertParallel(Padded):
    """The capacity buffer exchanged in equal chunks over the expert-parallel group.

    Args:
        ep_size: R.
        ep_group: the expert-parallel process group.
        equal_tokens: check that every rank routes the same number of tokens (capacity follows the
            local count when dropping; without dropping it is the group's largest expert count).
    """

    def __init__(self, ep_size: int, ep_group, equal_tokens: bool = True):
        self.ep_size, self.ep_group, self.equal_tokens = ep_size, ep_group, equal_tokens

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        if self.equal_tokens:
            check_equal_tokens(x_SM.shape[0], x_SM.device, self.ep_group)
        buffer = Padded.dispatch(self, x_SM, routing)  # (named: dynamo cannot resume a break inside super())
        received = all_to_all(buffer.rows_NM, self.ep_group)  # [R * L * C, M], chunk r from EP rank r
        L = routing.num_experts // self.ep_size
        local = rearrange(received, "(r l c) m -> (l r c) m", r=self.ep_size, l=L, c=routing.capacity)
        return Dispatched(local, None, buffer.tokens, (L, routing.capacity))  # expert l sees R * C rows

    def combine(self, y_NM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        L, capacity = dispatched.state
        back = rearrange(y_NM, "(l r c) m -> (r l c) m", r=self.ep_size, l=L, c=capacity)
        return combine_tokens(all_to_all(back, self.ep_group), dispatched.tokens)


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
    host = sizes(torch.cat([send_RL.sum(1), recv_RL.sum(1), recv_RL.sum(0)]).tolist())
    return host[:ranks], host[ranks:2 * ranks], host[2 * ranks:]


class PackedExpertParallel(Packed):
    """Packed rows exchanged in variable chunks over the expert-parallel group, regrouped by local expert.

    Args:
        ep_size: R.
        ep_group: the expert-parallel process group.
        grouped_gemm: how the experts run the rows (see `Dispatcher.grouped_gemm`).
    """

    def __init__(self, ep_size: int, ep_group, grouped_gemm: bool | None = False):
        super().__init__(grouped_gemm)
        self.ep_size, self.ep_group = ep_size, ep_group

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        row_SK, counts_E = self.rows(routing)
        exchange = plan_exchange(counts_E, self.ep_size, self.ep_group)
        buffer_NM, tokens = permute_tokens(x_SM, row_SK, routing.weight_SK, sum(exchange.send))
        received = all_to_all(buffer_NM, self.ep_group, exchange.recv, exchange.send)
        L, device = routing.num_experts // self.ep_size, x_SM.device
        local_expert = torch.repeat_interleave(torch.arange(L, device=device).repeat(self.ep_size),
                                               exchange.recv_RL.reshape(-1), output_size=received.shape[0])
        by_expert = torch.argsort(local_expert, stable=True)  # source order -> expert order
        return Dispatched(received.index_select(0, by_expert), exchange.local_counts, tokens, (exchange, by_expert))

    def combine(self, y_NM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        exchange, by_expert = dispatched.state
        in_source_order = torch.empty_like(by_expert).scatter_(
            0, by_expert, torch.arange(by_expert.numel(), device=by_expert.device))
        back = all_to_all(y_NM.index_select(0, in_source_order), self.ep_group, exchange.send, exchange.recv)
        return combine_tokens(back, dispatched.tokens)
