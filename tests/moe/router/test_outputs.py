"""The softmax routing's outputs in one autograd node against the plain autograd form they replace."""

import pytest
import torch
import torch.nn.functional as F

from moe.router.balancing import balance_loss, choice_counts
from moe.router.outputs import gate_outputs
from moe.router.selection import top1gating, top2gating, topkgating

F64 = {"rtol": 1e-10, "atol": 1e-12}


def _plain(logits, expert_SK, frac_E, renormalize, scaling):
    """The same outputs by autograd on plain ops (the form the gating policies used before)."""
    gates_SE = F.softmax(logits, dim=1)
    kept_SK = expert_SK >= 0
    weight_SK = gates_SE.gather(1, expert_SK.clamp(min=0)) * kept_SK
    if renormalize:
        weight_SK = weight_SK / weight_SK.sum(1, keepdim=True).clamp(min=torch.finfo(weight_SK.dtype).eps)
    weight_SK = weight_SK * scaling
    l_aux = gates_SE.shape[1] * torch.sum(gates_SE.mean(0) * frac_E) if frac_E is not None else None
    z_loss = torch.logsumexp(logits, dim=1).square().mean()
    return weight_SK, l_aux, z_loss


def _choices(S, E, K, generator):
    """Distinct experts per token, some choices dropped, one token with every choice dropped."""
    expert_SK = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(S)])
    dropped_SK = torch.rand(S, K, generator=generator) < 0.3
    dropped_SK[0] = True
    return torch.where(dropped_SK, -1, expert_SK)


@pytest.mark.parametrize("K, renormalize, scaling, with_aux", [
    (1, False, 1.0, True), (2, True, 1.0, True), (3, True, 2.5, False), (2, False, 0.5, True), (2, True, 0.0, True),
])
def test_values_equal_and_gradients_match_plain_autograd(K, renormalize, scaling, with_aux):
    generator = torch.Generator().manual_seed(K)
    S, E = 24, 6
    logits = torch.randn(S, E, dtype=torch.float64, generator=generator, requires_grad=True)
    expert_SK = _choices(S, E, K, generator)
    frac_E = torch.rand(E, dtype=torch.float64, generator=generator) if with_aux else None
    gates_SE = F.softmax(logits.detach(), 1)
    outputs = gate_outputs(logits, gates_SE, expert_SK, frac_E, renormalize, scaling, gates_SE.max(1).indices)
    reference = _plain(logits, expert_SK, frac_E, renormalize, scaling)
    assert torch.equal(outputs[0], reference[0]), "the weights changed"
    torch.testing.assert_close(outputs[2], reference[2], **F64)  # logsumexp at the largest gate: equal to rounding
    if with_aux:
        assert torch.equal(outputs[1], reference[1])
    else:
        assert not outputs[1].requires_grad and float(outputs[1]) == 0.0
    coeff_SK = torch.randn(S, K, dtype=torch.float64, generator=generator)
    grads = [torch.autograd.grad((w * coeff_SK).sum() + 0.3 * z + (0.7 * l if with_aux else 0), logits)[0]
             for w, l, z in (outputs, reference)]
    torch.testing.assert_close(grads[0], grads[1], **F64)


def test_gradcheck_of_every_output():
    generator = torch.Generator().manual_seed(0)
    expert_SK = _choices(10, 5, 2, generator)
    frac_E = torch.rand(5, dtype=torch.float64, generator=generator)

    def outputs(logits):
        gates_SE = F.softmax(logits.detach(), 1)
        return gate_outputs(logits, gates_SE, expert_SK, frac_E, True, 1.5, gates_SE.max(1).indices)

    logits = torch.randn(10, 5, dtype=torch.float64, generator=generator, requires_grad=True)
    assert torch.autograd.gradcheck(outputs, (logits,))


@pytest.mark.parametrize("policy", ["top1", "top2", "topk"])
@pytest.mark.parametrize("load_balancing_type", ["aux_loss", "global_aux_loss", "seq_aux_loss", "none"])
def test_policies_give_the_logits_the_plain_gradient(policy, load_balancing_type):
    """Every softmax policy and balance type: the logits' gradient of weights, l_aux and z_loss together
    equals autograd's through the plain form (seq_aux_loss takes the plain path itself)."""
    torch.manual_seed(1)
    logits = torch.randn(32, 6, dtype=torch.float64, requires_grad=True)
    balance = {"load_balancing_type": load_balancing_type, "seq_len": 8}
    if policy == "top1":
        plan = top1gating(logits, 0.6, 0, use_rts=False, **balance)
    elif policy == "top2":
        plan = top2gating(logits, 0.6, 0, top2_2nd_expert_sampling=False, **balance)
    else:
        plan = topkgating(logits, 3, 0.6, 0, routed_scaling_factor=2.0, **balance)
    assert bool((plan.expert_idx_SK < 0).any()), "some choices should be dropped here"
    coeff_SK = torch.randn(plan.weight_SK.shape, dtype=torch.float64)
    loss = (plan.weight_SK * coeff_SK).sum() + 0.3 * plan.z_loss + 0.7 * plan.l_aux
    (grad,) = torch.autograd.grad(loss, logits)

    reference = logits.detach().clone().requires_grad_()
    probs_SE = F.softmax(reference, 1)
    weight_SK = probs_SE.gather(1, plan.expert_idx_SK.clamp(min=0)) * (plan.expert_idx_SK >= 0)
    if policy != "top1":
        weight_SK = weight_SK / weight_SK.sum(1, keepdim=True).clamp(min=torch.finfo(torch.float64).eps)
    if policy == "topk":
        weight_SK = weight_SK * 2.0
    counted_SK = _undropped_choices(logits.detach(), policy, plan.weight_SK.shape[1])
    own_SK = counted_SK[:, :1] if policy == "top2" else counted_SK  # DeepSpeed's top-2 loss counts first choices
    own_fraction = choice_counts(own_SK, 6).double() / own_SK.numel()
    l_aux = balance_loss(load_balancing_type, probs_SE, counted_SK, seq_len=8, default=lambda: own_fraction)
    torch.testing.assert_close(l_aux.detach(), plan.l_aux.detach(), **F64)
    z_loss = torch.logsumexp(reference, 1).square().mean()
    ((weight_SK * coeff_SK).sum() + 0.3 * z_loss + 0.7 * l_aux).backward()
    torch.testing.assert_close(grad, reference.grad, **F64)


def _undropped_choices(logits, policy, k):
    """The choices before any drop, as the policies count them for the balance loss."""
    gates_SE = F.softmax(logits, 1)
    if policy == "topk":
        return torch.topk(gates_SE, k, dim=1).indices
    first_S = gates_SE.max(1).indices
    if policy == "top1":
        return first_S.unsqueeze(1)
    second_S = logits.scatter(1, first_S.unsqueeze(1), float("-inf")).max(1).indices
    return torch.stack([first_S, second_S], 1)


def test_z_loss_equals_logsumexp_for_large_and_spread_logits():
    """logsumexp at the largest gate stays exact to fp32 rounding when the logits are large or one dominates."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.cat([torch.randn(64, 16, generator=generator) * 30, torch.randn(64, 16, generator=generator) + 80,
                        torch.randn(64, 16, generator=generator) * 1e-3])
    gates_SE = F.softmax(logits, 1)
    _, _, z_loss = gate_outputs(logits, gates_SE, gates_SE.max(1).indices.unsqueeze(1), None, False, 1.0,
                                gates_SE.max(1).indices)
    torch.testing.assert_close(z_loss, torch.logsumexp(logits, 1).square().mean(), rtol=1e-6, atol=0)
