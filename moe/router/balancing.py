"""Load balancing: the balance losses, the auxiliary-loss-free expert bias update, and MaxVio.

Shape legend: S tokens, E experts, K choices per token, B sequences, T tokens per sequence.

All losses have the Switch form L = E * sum_i f_i * P_i, with f_i the fraction of routed choices that
went to expert i (1 / E each when balanced, so L = 1 at balance) and P_i the mean over tokens of the
scores normalised over all experts (softmax probabilities as they are; sigmoid scores divided by
their sum per token). f is a count, so the gradient flows through P only. They differ in where the
counts and means are taken:
    aux_loss:         over this batch (each gating policy's own form, DeepSpeed's for top-1 and top-2);
    seq_aux_loss:     per sequence, then averaged over sequences (DeepSeek-V3's sequence-wise loss);
    global_aux_loss:  f from counts summed over the data-parallel group and the step's micro-batches
                      so far (Qiu et al. 2025), P over this batch;
    none:             zero.

Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3): a per-expert bias b is added to the
scores for selection only. After each optimizer step b_i += u * sign(mean_j c_j - c_i), with c_i the
choices routed to expert i over the whole global batch of that step.
"""

import torch

from kernels.backend import cpu_eager

__all__ = [
    "LOAD_BALANCING_TYPES", "balance_fraction", "balance_loss", "max_violation", "normalized_scores",
    "update_bias",
]

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


def normalized_scores(scores_SE: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """P's per-token scores: softmax probabilities as they are, sigmoid scores divided by their sum."""
    if scoring_func == "softmax":
        return scores_SE
    return scores_SE / scores_SE.sum(1, keepdim=True).clamp(min=torch.finfo(scores_SE.dtype).tiny)


def choice_counts(expert_SK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 choices per expert, [E]; -1 (routed nowhere) not counted. A scatter-add: no host sync
    (`bincount` on the CPU, where it is three times faster and has no sync to make)."""
    index = expert_SK.reshape(-1) + 1
    if cpu_eager(index):
        counts = torch.bincount(index, minlength=num_experts + 1)
        if counts.shape[0] > num_experts + 1:  # (the scatter-add below would raise on such an index too)
            raise ValueError(f"expert ids must be below num_experts ({num_experts}), got {int(index.max()) - 1}")
        return counts.narrow(0, 1, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert_SK.device)
    return counts.scatter_add_(0, index, torch.ones_like(index)).narrow(0, 1, num_experts)


def _switch_loss(probs_SE: torch.Tensor, frac_E: torch.Tensor) -> torch.Tensor:
    """E * sum_i f_i * P_i with P_i = mean_s probs[s, i]; 0 without tokens."""
    if probs_SE.shape[0] == 0:
        return probs_SE.new_zeros(())
    return probs_SE.shape[1] * torch.sum(probs_SE.mean(0) * frac_E)


def _count_fraction(counts_E: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """f_i = c_i / sum_j c_j (0 everywhere without counts)."""
    return counts_E.to(dtype) / counts_E.sum().clamp(min=1).to(dtype)


def _sequence_loss(probs_SE: torch.Tensor, expert_SK: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The Switch loss of each sequence of seq_len consecutive tokens, averaged over sequences."""
    num_tokens, num_experts = probs_SE.shape
    if num_tokens == 0:
        return probs_SE.new_zeros(())
    probs_BTE = probs_SE.view(-1, seq_len, num_experts)
    expert_BP = expert_SK.reshape(probs_BTE.shape[0], -1)
    index = expert_BP + 1  # column 0 collects the choices routed nowhere
    counts_BE = torch.zeros(expert_BP.shape[0], num_experts + 1, dtype=probs_SE.dtype, device=probs_SE.device)
    counts_BE = counts_BE.scatter_add_(1, index, torch.ones_like(index, dtype=probs_SE.dtype)).narrow(1, 1, num_experts)
    frac_BE = counts_BE / counts_BE.sum(1, keepdim=True).clamp(min=1)
    return num_experts * (probs_BTE.mean(1) * frac_BE).sum(1).mean()


def balance_fraction(
    load_balancing_type: str, expert_SK: torch.Tensor, num_experts: int, dtype: torch.dtype, *,
    global_counts=None, default=None,
) -> torch.Tensor | None:
    """f of the batch-wide forms, L = E * sum_i f_i * mean_s P[s, i]: a constant [E], so dL/dP[s, i] = E f_i / S.

    Args:
        load_balancing_type: "aux_loss", "global_aux_loss" or "none" (seq_aux_loss has an f per
            sequence and no single one: `balance_loss` computes it).
        expert_SK, global_counts: as in `balance_loss`.
        num_experts: E.
        dtype: f's dtype (the scores').
        default: a function giving the policy's own f for aux_loss (DeepSpeed's form); None: the Switch form.

    Returns:
        f, shape [E]; None for "none" (the loss is 0 and carries no gradient).
    """
    if load_balancing_type == "none":
        return None
    if load_balancing_type == "aux_loss":
        return default() if default is not None else _count_fraction(choice_counts(expert_SK, num_experts), dtype)
    if load_balancing_type == "global_aux_loss":
        counts_E = choice_counts(expert_SK, num_experts)
        return _count_fraction(global_counts(counts_E) if global_counts is not None else counts_E, dtype)
    raise ValueError(f"load_balancing_type must be one of {LOAD_BALANCING_TYPES[:1] + LOAD_BALANCING_TYPES[2:]} "
                     f"here (one f for the batch), got {load_balancing_type!r}")


def balance_loss(
    load_balancing_type: str, probs_SE: torch.Tensor, expert_SK: torch.Tensor, *, seq_len: int | None = None,
    global_counts=None, default=None,
) -> torch.Tensor:
    """The load-balancing loss of one routing, by type (see the module docstring).

    Args:
        load_balancing_type: one of LOAD_BALANCING_TYPES.
        probs_SE: scores normalised over all experts, [S, E], differentiable.
        expert_SK: int64 chosen expert per (token, choice) before any drop, [S, K]; -1 routed nowhere.
        seq_len: T, tokens per sequence (seq_aux_loss); S must be a multiple of it.
        global_counts: for global_aux_loss, a function from this batch's counts [E] to the counts f is
            taken from (the gate sums them over the data-parallel group and the micro-batches); None
            uses this batch's counts.
        default: a function giving the policy's own f for aux_loss (DeepSpeed's form); None: the Switch form.

    Returns:
        the loss, a scalar in probs_SE's dtype.

    Raises:
        ValueError: seq_aux_loss without a seq_len that divides S.
    """
    if load_balancing_type not in LOAD_BALANCING_TYPES:
        raise ValueError(f"load_balancing_type must be one of {LOAD_BALANCING_TYPES}, got {load_balancing_type!r}")
    if load_balancing_type == "seq_aux_loss":
        if not seq_len or probs_SE.shape[0] % seq_len:
            raise ValueError(
                f"load_balancing_type='seq_aux_loss' needs tokens shaped [batch, seq, hidden] (seq_len dividing "
                f"the {probs_SE.shape[0]} tokens), got seq_len={seq_len}"
            )
        return _sequence_loss(probs_SE, expert_SK, seq_len)
    frac_E = balance_fraction(load_balancing_type, expert_SK, probs_SE.shape[1], probs_SE.dtype,
                              global_counts=global_counts, default=default)
    return probs_SE.new_zeros(()) if frac_E is None else _switch_loss(probs_SE, frac_E)


@torch.no_grad()
def update_bias(expert_bias_E: torch.Tensor, counts_E: torch.Tensor, update_speed: float) -> torch.Tensor:
    """b_i += u * sign(mean_j c_j - c_i), in place: overloaded experts become less attractive."""
    counts = counts_E.to(torch.float64)
    expert_bias_E += update_speed * torch.sign(counts.mean() - counts).to(expert_bias_E.dtype)
    return expert_bias_E


def max_violation(counts_E: torch.Tensor) -> float:
    """MaxVio (Wang et al. 2024): max_i c_i / mean_j c_j - 1; 0 for a perfectly even load (and no load)."""
    counts = counts_E.to(torch.float64)
    mean = float(counts.mean()) if counts.numel() else 0.0
    return float(counts.max()) / mean - 1.0 if mean > 0 else 0.0
