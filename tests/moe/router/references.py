"""Plain-torch references shared by the router tests: scores normalised over experts, the Switch-form
balance loss from given counts, and a plan's weights laid out per (token, expert)."""

import torch


def normalized(logits, scoring):
    """Scores over experts per token, divided by their sum (softmax as it is, sigmoid normalised)."""
    s = torch.softmax(logits, 1) if scoring == "softmax" else torch.sigmoid(logits)
    return s / s.sum(1, keepdim=True)


def reference_switch_loss(logits, counts, scoring):
    """E * sum_i f_i P_i, f_i = c_i / sum_j c_j (counts given, so f carries no gradient)."""
    E = logits.shape[1]
    f = counts.to(logits.dtype) / counts.sum()
    return E * (f * normalized(logits, scoring).mean(0)).sum()


def weights_by_expert(plan, S, E):
    """The plan's kept weights as an [S, E] tensor: token s's weight for expert e, 0 where not chosen."""
    dense = torch.zeros(S, E, dtype=plan.weight_SK.dtype)
    kept = plan.expert_idx_SK >= 0
    rows = torch.arange(S).unsqueeze(1).expand_as(plan.expert_idx_SK)[kept]
    return dense.index_put((rows, plan.expert_idx_SK[kept]), plan.weight_SK[kept], accumulate=True)
