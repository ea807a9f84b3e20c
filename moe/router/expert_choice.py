"""Expert-choice routing (Zhou et al. 2022): each expert picks its tokens, instead of each token its experts.

Shape legend: S tokens, E experts, C tokens per expert.

Scores are softmax(logits) over experts per token. Expert e takes the C = ceil(S * capacity_factor / E)
tokens with the highest score for e (ties: the lower token index) and weights each by that score. A
token may so reach several experts or none, and every expert is exactly full: balance needs no loss.

The plan is a Routing with K = E: column e of expert_idx_SK is e where expert e took the token, -1
elsewhere, with slots in token order. Its tensors are [S, E], never [S, E, C], and the capacity is
fixed, so every layout and expert parallelism run it unchanged.

Causal language models: an expert's choice of token t depends on the scores of every other token of
the batch, later positions included, so a token's output leaks information from the future (and
training routes differently from left-to-right generation). It is here for study, not for
deployment as a causal decoder.
"""

import math

import torch

from kernels import expert_positions
from moe.router.balancing import choice_counts
from moe.router.outputs import _plan, _z_loss
from moe.router.plan import Routing
from moe.router.scoring import _check_logits, expert_softmax
from moe.router.selection import _mask_unused

__all__ = ["expert_choice_capacity", "expert_choice_gating"]


def expert_choice_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """C = ceil(S * capacity_factor / E), at most S."""
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor}")
    return min(math.ceil(num_tokens * capacity_factor / num_experts), num_tokens)


def expert_choice_gating(
    logits: torch.Tensor, capacity_factor: float, *, used_token: torch.Tensor | None = None,
) -> Routing:
    """Expert-choice routing: each expert takes its C highest-scoring tokens.

    Leaks across positions in a causal model (see the module docstring).

    Args:
        logits: gate logits, shape [S, E]; cast to fp32.
        capacity_factor: C = ceil(S * capacity_factor / E) tokens per expert; on average a token
            reaches capacity_factor experts, the compute of top-k token choice with k = capacity_factor.
        used_token: optional [S] mask; tokens where it is 0 are taken by no expert.

    Returns:
        Routing with K = E, capacity C; l_aux is 0 (every expert is full by construction) and
        exp_counts holds C per expert.

    Raises:
        ValueError: bad shapes, capacity_factor <= 0, or non-finite logits (with MOE_SYNC_CHECKS=1).
    """
    logits = _check_logits(logits, 1)
    S, num_experts = logits.shape
    capacity = expert_choice_capacity(S, num_experts, capacity_factor)
    scores_SE = expert_softmax(logits)
    rank_SE = scores_SE.detach()
    if used_token is not None:
        used_S1 = (_mask_unused(torch.zeros(S, dtype=torch.int64, device=logits.device), used_token) >= 0).unsqueeze(1)
        rank_SE = torch.where(used_S1, rank_SE, -1.0)  # below every score: taken only when C exceeds the used tokens
    token_CE = torch.argsort(rank_SE, dim=0, descending=True, stable=True).narrow(0, 0, capacity)
    chosen_SE = torch.zeros_like(scores_SE, dtype=torch.bool).scatter(0, token_CE, True)
    if used_token is not None:
        chosen_SE = chosen_SE & used_S1
    expert_SE = torch.where(chosen_SE, torch.arange(num_experts, device=logits.device), -1)
    _, slot_P = expert_positions(expert_SE.t().reshape(-1), num_experts)  # token order within each expert
    slot_SE = slot_P.view(num_experts, S).t()
    exp_counts = choice_counts(expert_SE, num_experts)
    l_aux = scores_SE.new_zeros(())
    return _plan(scores_SE, expert_SE, slot_SE, lambda: capacity, l_aux, exp_counts, _z_loss(logits), False,
                 max_rows=num_experts * capacity)
