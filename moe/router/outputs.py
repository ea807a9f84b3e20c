"""A routing's differentiable outputs: combine weights, l_aux and z_loss, from the scores and the kept choices.

Shape legend: S tokens, E experts, K choices per token.

A policy selects experts and assigns slots without autograd (moe.router.selection, moe.router.plan);
what reaches the logits is built here. `_plan` reads the weights from the scores by plain autograd
(sigmoid scoring, expert choice). `_softmax_plan` gives softmax routing's outputs through one
autograd node, `gate_outputs`; for seq_aux_loss (an f per sequence) it falls back to plain autograd.

The node. Given the logits l, the gates g = softmax(l) and the kept choices of every token:

    w[s, j]  = g[s, e(s, j)]                       (0 for a dropped choice)
    w[s, j] /= max(sum_j w[s, j], eps)             (with renormalize)
    w[s, j] *= scaling
    l_aux    = E * sum_e f_e * mean_s g[s, e]      (f [E] a constant: counts, see moe.router.balancing)
    z_loss   = mean_s logsumexp(l[s])^2

The forward computes the weights and l_aux with the same torch ops, in the same order, as the plain
autograd form, so routing and those values are bit for bit the plain form's (for a batch of no
tokens l_aux is 0, where DeepSpeed's form gives NaN); the z-loss takes
logsumexp(l[s]) = l[s, j] - log g[s, j] at the token's largest gate j (equal to rounding, and
without a logsumexp pass). The backward is written out:

    G_g[s, e] = sum_{j: e(s, j) = e} G_w'[s, j] + G_aux * E * f_e / S
    G_l[s, e] = g[s, e] * (G_g[s, e] - sum_e' g[s, e'] G_g[s, e'] + G_z * 2 * lse[s] / S)

with G_w' the weights' gradient taken back through the scaling and the renormalisation. Autograd
would record some twenty nodes for the same graph (a gather, a clamp, a division, a mean, a
logsumexp...) and run about forty small ops backward; here the backward is a dozen ops on [S, E]
and [S, K]: the gate's small ops, not its arithmetic, are what its time goes to.
"""

import torch

from moe.router.balancing import balance_fraction, balance_loss
from moe.router.plan import Routing
from moe.router.scoring import expert_softmax

__all__ = ["gate_outputs"]


def _row_sum(t_SK: torch.Tensor) -> torch.Tensor:
    """Sum over the K choices, [S, 1]. For K = 2 one addition of two columns: the same bits as
    sum(1) (a + b, whatever the order), at a third of its cost (a reduction over a length-2 dim)."""
    if t_SK.shape[1] == 2:
        return t_SK.narrow(1, 0, 1) + t_SK.narrow(1, 1, 1)
    return t_SK.sum(1, keepdim=True)


class _GateOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_SE, gates_SE, expert_SK, frac_E, renormalize, scaling, top_S):
        S, num_experts = gates_SE.shape
        kept_SK = expert_SK >= 0
        index_SK = expert_SK.clamp(min=0)
        weight_SK = gates_SE.gather(1, index_SK) * kept_SK
        denom_S1 = passes_S1 = None
        if renormalize:
            total_S1 = _row_sum(weight_SK)
            denom_S1 = total_S1.clamp(min=torch.finfo(weight_SK.dtype).eps)
            weight_SK = weight_SK / denom_S1
            passes_S1 = total_S1 >= torch.finfo(weight_SK.dtype).eps  # where the clamp lets gradient through
        unscaled_SK = weight_SK  # the backward's renormalisation term, without dividing by the scaling
        if scaling != 1.0:
            weight_SK = weight_SK * scaling
        if frac_E is None or S == 0:
            l_aux = gates_SE.new_zeros(())
        else:
            l_aux = num_experts * torch.sum(gates_SE.mean(0) * frac_E)
        top_S1 = top_S.unsqueeze(1)  # lse = l_j - log g_j for any j; the largest gate keeps log g_j in [-log E, 0]
        lse_S = (logits_SE.gather(1, top_S1) - gates_SE.gather(1, top_S1).log()).squeeze(1)
        z_loss = lse_S.square().mean() if S else logits_SE.new_zeros(())
        ctx.renormalize, ctx.scaling = renormalize, scaling
        ctx.save_for_backward(gates_SE, index_SK, kept_SK, unscaled_SK, denom_S1, passes_S1, frac_E, lse_S)
        if frac_E is None:
            ctx.mark_non_differentiable(l_aux)
        return weight_SK, l_aux, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_weight_SK, grad_l_aux, grad_z_loss):
        gates_SE, index_SK, kept_SK, unscaled_SK, denom_S1, passes_S1, frac_E, lse_S = ctx.saved_tensors
        S, num_experts = gates_SE.shape
        grad_SK = grad_weight_SK * ctx.scaling if ctx.scaling != 1.0 else grad_weight_SK
        if ctx.renormalize:  # w = r / d with d = max(sum r, eps): dw/dr = (G - sum_j G_j w_j [d passed]) / d
            through_S1 = _row_sum(grad_SK * unscaled_SK)
            grad_SK = (grad_SK - through_S1 * passes_S1) / denom_S1
        grad_SE = torch.zeros_like(gates_SE).scatter_add_(1, index_SK, grad_SK * kept_SK)
        if frac_E is not None and S:
            grad_SE += (grad_l_aux * num_experts / S) * frac_E
        dot_S1 = (grad_SE * gates_SE).sum(1, keepdim=True)
        if S:
            dot_S1 -= (grad_z_loss * 2.0 / S) * lse_S.unsqueeze(1)
        grad_logits_SE = gates_SE * (grad_SE - dot_S1)
        return grad_logits_SE, None, None, None, None, None, None


def gate_outputs(logits_SE: torch.Tensor, gates_SE: torch.Tensor, expert_SK: torch.Tensor, frac_E: torch.Tensor | None,
                 renormalize: bool, scaling: float, top_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Combine weights, balance loss and z-loss of a softmax routing, differentiable to the logits.

    Args:
        logits_SE: the gate logits, [S, E] (fp32 or float64), the graph's leaf side.
        gates_SE: softmax(logits_SE) computed without autograd, [S, E].
        expert_SK: int64 kept expert per (token, choice), [S, K], -1 where dropped.
        frac_E: f of l_aux = E * sum_e f_e * mean_s gates[s, e], [E] (moe.router.balancing.balance_fraction);
            None: l_aux is 0 and carries no gradient.
        renormalize: divide each token's kept weights by their sum (at least eps).
        scaling: a factor on every weight.
        top_S: int64 index of a largest gate per token, [S] (the first choice of the policies without
            noise): logsumexp(l) = l_j - log(gates_j) there, exact to rounding, so the z-loss costs no
            logsumexp pass of its own.

    Returns:
        weight_SK [S, K], l_aux (a scalar), z_loss (a scalar), in the logits' dtype.
    """
    return _GateOutputs.apply(logits_SE, gates_SE.detach(), expert_SK, frac_E, renormalize, scaling, top_S)


def _z_loss(logits_SE: torch.Tensor) -> torch.Tensor:
    if logits_SE.shape[0] == 0:
        return logits_SE.new_zeros(())
    return torch.logsumexp(logits_SE, dim=1).square().mean()


def _plan(
    scores_SE, expert_SK, slot_SK, resolve_capacity, l_aux, exp_counts, z_loss, renormalize: bool,
    scaling: float = 1.0, max_rows: int | None = None, kept_counts: torch.Tensor | None = None,
) -> Routing:
    """Mask dropped choices and read their weights from the scores (renormalised over kept choices, scaled)."""
    kept_SK = slot_SK >= 0
    expert_SK = torch.where(kept_SK, expert_SK, -1)
    weight_SK = scores_SE.gather(1, expert_SK.clamp(min=0)) * kept_SK
    if renormalize:
        denom_S1 = weight_SK.sum(1, keepdim=True).clamp(min=torch.finfo(weight_SK.dtype).eps)
        weight_SK = weight_SK / denom_S1
    if scaling != 1.0:
        weight_SK = weight_SK * scaling
    return Routing(
        expert_idx_SK=expert_SK, slot_SK=slot_SK, weight_SK=weight_SK,
        resolve_capacity=resolve_capacity, num_experts=scores_SE.shape[1], l_aux=l_aux,
        exp_counts=exp_counts.detach(), z_loss=z_loss, max_rows=max_rows, kept_counts_E=kept_counts,
    )


def _softmax_plan(
    logits, gates_SE, expert_SK, slot_SK, resolve_capacity, exp_counts, max_rows: int, renormalize: bool,
    balance: dict, balance_expert_SK, own_fraction, top_S, scaling: float = 1.0,
    kept_counts: torch.Tensor | None = None,
) -> Routing:
    """The plan of a softmax routing; weights, l_aux and z_loss reach the logits through one autograd
    node (`gate_outputs`), or through plain autograd for seq_aux_loss (an f per sequence).

    gates_SE is softmax(logits) without autograd; balance holds load_balancing_type, seq_len and
    global_counts; balance_expert_SK are the choices the balance counts (before any drop);
    own_fraction gives the policy's f for aux_loss; top_S the index of a largest gate per token.
    """
    load_balancing_type = balance["load_balancing_type"]
    if load_balancing_type == "seq_aux_loss":
        gates_SE = expert_softmax(logits)  # the same values, now differentiable
        l_aux = balance_loss(load_balancing_type, gates_SE, balance_expert_SK, seq_len=balance["seq_len"])
        return _plan(gates_SE, expert_SK, slot_SK, resolve_capacity, l_aux, exp_counts, _z_loss(logits), renormalize,
                     scaling, max_rows, kept_counts)
    frac_E = balance_fraction(load_balancing_type, balance_expert_SK, gates_SE.shape[1], gates_SE.dtype,
                              global_counts=balance["global_counts"], default=own_fraction)
    kept_SK = slot_SK >= 0
    expert_SK = torch.where(kept_SK, expert_SK, -1)
    weight_SK, l_aux, z_loss = gate_outputs(logits, gates_SE, expert_SK, frac_E, renormalize, scaling, top_S)
    return Routing(  # slot_SK is -1 exactly where kept_SK is False: as it is
        expert_idx_SK=expert_SK, slot_SK=slot_SK, weight_SK=weight_SK,
        resolve_capacity=resolve_capacity, num_experts=gates_SE.shape[1], l_aux=l_aux,
        exp_counts=exp_counts.detach(), z_loss=z_loss, max_rows=max_rows, kept_counts_E=kept_counts,
    )
