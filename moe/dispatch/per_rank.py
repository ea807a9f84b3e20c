"""Expert parallelism with one row per (token, destination rank): a token crosses the wire once per rank.

Shape legend: S tokens, K choices per token, R ranks of the expert-parallel group, L local experts,
M model dim, N rows sent (one per (token, rank) pair reached), Q rows received, P choices received.

The per-choice exchange (moe.dispatch.expert_parallel) sends a token once for each of its choices, so
a token with k choices on one rank crosses k times. Here it crosses once: group-limited routing
(n_group = R, topk_group = g) bounds the rows a token sends by g instead of k (`recipes.bench.routing`
prints the bytes). The receiver expands each row into its choices, runs the experts, and sums the
weighted outputs of a row's choices before sending one row back; the source sums its rows over ranks.

Dispatch:
    1. pairs:    row_SR, the send row of each (token, rank) pair reached, by rank then token.
    2. counts:   per destination rank, choices per local expert and pair rows; exchanged, then read
                 on the host (the layer's one sync).
    3. send:     token rows, and per row the local expert and weight of each choice ([N, 2K], one
                 exchange; expert ids are small integers, exact in fp32).
    4. expand:   received choices sorted by local expert, for the experts.
Combine:
    5. reduce:   each received row sums its choices' outputs with their weights.
    6. return:   one row per pair back; each token sums its rows (weight 1).

Equal to the per-choice exchange up to float rounding: a row's choices are summed (in fp32) on the
expert's rank and rounded to the model dtype before they travel back.
"""

import torch

from kernels import buffer_rows, expert_positions, permute, unpermute_combine
from moe.dispatch.base import Dispatched, Dispatcher, TokenRows, sizes
from parallel import all_to_all, exchange_counts

__all__ = ["PerRankExchange", "read_pair_exchange"]


def _pair_rows(rank_SK: torch.Tensor, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_SR (-1 where the token reaches no expert on rank r) and pairs per rank [R]; no host sync."""
    S = rank_SK.shape[0]
    reached = torch.zeros(S, ranks + 1, dtype=torch.int64, device=rank_SK.device)
    reached = reached.scatter(1, rank_SK + 1, 1).narrow(1, 1, ranks)  # column 0 took the dropped choices
    pairs_R = reached.sum(0)
    position_SR = torch.cumsum(reached, 0) - 1
    row_SR = (torch.cumsum(pairs_R, 0) - pairs_R).unsqueeze(0) + position_SR
    return torch.where(reached > 0, row_SR, -1), pairs_R


def read_pair_exchange(send_RX: torch.Tensor, recv_RX: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """Pair rows sent to and received from each rank, and received choices per local expert: one host read.

    Args:
        send_RX, recv_RX: int64 [R, L + 1]: per rank, choices per local expert, then pair rows.
    """
    ranks = send_RX.shape[0]
    host = sizes(torch.cat([send_RX.select(1, -1), recv_RX.select(1, -1), recv_RX.narrow(1, 0, recv_RX.shape[1] - 1)
                            .sum(0)]).tolist())
    return host[:ranks], host[ranks:2 * ranks], host[2 * ranks:]


class PerRankExchange(Dispatcher):
    """One row per (token, destination rank); the receiver expands it into the token's choices there.

    Args:
        ep_size: R.
        ep_group: the expert-parallel process group.
        grouped_gemm: how the experts run the rows (see `Dispatcher.grouped_gemm`).
    """

    def __init__(self, ep_size: int, ep_group, grouped_gemm: bool | None = False):
        self.ep_size, self.ep_group, self.grouped_gemm = ep_size, ep_group, grouped_gemm

    def dispatch(self, x_SM: torch.Tensor, routing) -> Dispatched:
        L = routing.num_experts // self.ep_size
        K = routing.expert_idx_SK.shape[1]
        kept_SK = routing.kept_SK
        # 1. pairs
        rank_SK = torch.where(kept_SK, routing.expert_idx_SK // L, -1)
        row_SR, pairs_R = _pair_rows(rank_SK, self.ep_size)
        # 2. counts
        send_RX = torch.cat([routing.kept_counts().view(self.ep_size, L), pairs_R.unsqueeze(1)], 1)
        recv_RX = exchange_counts(send_RX, self.ep_group)
        send, recv, local_counts = read_pair_exchange(send_RX, recv_RX)
        # 3. send: rows, then each row's choices (column j: choice j of the token, -1 when not on that rank)
        buffer_NM = permute(x_SM, row_SR, sum(send))
        spare = sum(send) * K  # dropped choices write to one spare slot past the end
        slot_SK = torch.where(kept_SK, row_SR.gather(1, rank_SK.clamp(min=0)) * K + torch.arange(K, device=x_SM.device),
                              spare).reshape(-1)
        local_SK = torch.where(kept_SK, routing.expert_idx_SK % L, -1).to(routing.weight_SK.dtype)
        weight_P = routing.weight_SK.new_zeros(spare + 1).scatter(0, slot_SK, routing.weight_SK.reshape(-1))
        local_P = local_SK.new_full((spare + 1,), -1.0).scatter(0, slot_SK, local_SK.reshape(-1))
        payload_NX = torch.cat([weight_P.narrow(0, 0, spare).view(-1, K), local_P.narrow(0, 0, spare).view(-1, K)], 1)
        received_QM = all_to_all(buffer_NM, self.ep_group, recv, send)
        payload_QX = all_to_all(payload_NX, self.ep_group, recv, send)
        weight_QK, local_QK = payload_QX.narrow(1, 0, K), payload_QX.narrow(1, K, K).detach().round().long()
        # 4. expand: the received choices sorted by local expert (fill order: row, then choice)
        counts_L, position_P = expert_positions(local_QK.reshape(-1), L)
        row_QK = buffer_rows(local_QK, position_P.view_as(local_QK), counts_E=counts_L)
        choices_PM = permute(received_QM, row_QK, sum(local_counts))
        pairs = TokenRows(row_SR, (row_SR >= 0).to(routing.weight_SK.dtype), None)
        return Dispatched(choices_PM, local_counts, pairs, (row_QK, weight_QK, send, recv))

    def combine(self, y_PM: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        row_QK, weight_QK, send, recv = dispatched.state
        # 5. reduce
        partial_QM = unpermute_combine(y_PM, row_QK, weight_QK)
        # 6. return
        back_NM = all_to_all(partial_QM, self.ep_group, send, recv)
        return unpermute_combine(back_NM, dispatched.tokens.row_SK, dispatched.tokens.weight_SK)
