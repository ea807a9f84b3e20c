"""The differentiable outputs of softmax routing in one autograd node: combine weights, l_aux, z_loss.

Shape legend: S tokens, E experts, K choices per token.

Given the logits l, the gates g = softmax(l) and the kept choices of every token:

    w[s, j]  = g[s, e(s, j)]                       (0 for a dropped choice)
    w[s, j] /= max(sum_j w[s, j], eps)             (with renormalize)
    w[s, j] *= scaling
    l_aux    = E * sum_e f_e * mean_s g[s, e]      (f [E] a constant: counts, see moe.balancing)
    z_loss   = mean_s logsumexp(l[s])^2

The forward computes the weights and l_aux with the same torch ops, in the same order, as the plain
autograd form, so routing and those values are bit for bit what they were (for a batch of no
tokens l_aux is now 0, where the DeepSpeed form gave NaN); the z-loss takes
logsumexp(l[s]) = l[s, j] - log g[s, j] at the token's largest gate j (equal to rounding, and
without a logsumexp pass). The backward is written out:

    G_g[s, e] = sum_{j: e(s, j) = e} G_w'[s, j] + G_aux * E * f_e / S
    G_l[s, e] = g[s, e] * (G_g[s, e] - sum_e' g[s, e'] G_g[s, e'] + G_z * 2 * lse[s] / S)

with G_w' the weights' gradient taken back through the scaling and the renormalisation. Autograd
would record some twenty nodes for the same graph (a gather, a clamp, a division, a mean, a
logsumexp...) and run about forty small ops backward; here the backward is a dozen ops on [S, E]
and [S, K], which saves about a millisecond per layer and step at S = 4096, E = 8 on a 2-core CPU.
"""

import torch

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
        frac_E: f of l_aux = E * sum_e f_e * mean_s gates[s, e], [E] (moe.balancing.balance_fraction);
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
