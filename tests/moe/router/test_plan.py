"""moe.router.plan, the routing plan every policy returns: DeepSpeed's capacity formula and its
min_capacity, the slots `assign_slots` gives in fill order (by priority where one is given), the
dropless capacity found once and only when asked, the kept counts, and the dense form `Routing.dense`
builds for tests and interop, on hand-made choices and random logits, compared exactly.
"""

import math

import pytest
import torch

from moe import top1gating, top2gating, topkgating
from moe.router import plan as plan_module
from moe.router.plan import Routing, assign_slots


def test_capacity_formula_and_min_capacity():
    logits = torch.randn(10, 4)
    assert top1gating(logits, 1.0, 0, use_rts=False).capacity == math.ceil(10 / 4 * 1.0)
    assert top1gating(logits, 1.0, 7, use_rts=False).capacity == 7
    assert top2gating(logits, 1.5, 0, top2_2nd_expert_sampling=False).capacity == math.ceil(10 / 4 * 1.5 * 2)
    assert topkgating(logits, 3, 0.5, 0).capacity == math.ceil(10 / 4 * 0.5 * 3)


@pytest.mark.parametrize("policy", ["top1", "top1_rts", "top2", "top2_dropless", "topk_probs", "topk_position",
                                    "topk_sigmoid"])
@pytest.mark.parametrize("used", [False, True])
def test_the_plans_kept_counts_are_the_kept_choices_per_expert(policy, used):
    torch.manual_seed(3)
    S, E = 96, 6
    logits = torch.randn(S, E) + torch.linspace(0, 2, E)  # uneven loads: some experts overflow
    used_token = (torch.rand(S) > 0.2).long() if used else None
    plan = {
        "top1": lambda: top1gating(logits, 1.0, 0, used_token, use_rts=False),
        "top1_rts": lambda: top1gating(logits, 1.0, 0, used_token, use_rts=True),
        "top2": lambda: top2gating(logits, 1.0, 0, used_token=used_token),
        "top2_dropless": lambda: top2gating(logits, 1.0, 0, drop_tokens=False, used_token=used_token),
        "topk_probs": lambda: topkgating(logits, 3, 1.0, 0, used_token=used_token),
        "topk_position": lambda: topkgating(logits, 3, 1.0, 0, drop_policy="position", used_token=used_token),
        "topk_sigmoid": lambda: topkgating(logits, 3, 1.0, 0, used_token=used_token, scoring_func="sigmoid"),
    }[policy]()
    kept = plan.expert_idx_SK[plan.expert_idx_SK >= 0]
    assert plan.kept_counts().tolist() == torch.bincount(kept, minlength=E).tolist()
    assert int(plan.kept_counts().sum()) < int(plan.exp_counts.sum()) or policy == "top2_dropless"
    assert bool((plan.kept_counts() <= plan.capacity).all())
    # its own memory: exp_counts (which the dropless capacity is read from) never changes with it
    assert plan.kept_counts().untyped_storage().data_ptr() != plan.exp_counts.untyped_storage().data_ptr()


def test_s_below_min_capacity_is_fine_without_dropping():
    plan = top1gating(torch.randn(3, 4), 1.0, 4, drop_tokens=False)
    assert bool(plan.kept_SK.all())


def test_assign_slots_keeps_each_experts_first_choices_in_fill_order():
    # expert 1 is chosen at fill positions 0, 2, 4, 7: slots 0 and 1, then full; position 3 goes nowhere
    expert_P = torch.tensor([1, 0, 1, -1, 1, 0, 2, 1])
    counts_E, kept_E, slot_P = assign_slots(expert_P, 3, capacity=2)
    assert counts_E.tolist() == [2, 4, 1] and kept_E.tolist() == [2, 2, 1]
    assert slot_P.tolist() == [0, 0, 1, -1, -1, 1, 0, -1]
    same = assign_slots(expert_P, 3, capacity=2, priority_P=torch.ones(8))  # equal priorities: fill order
    assert [t.tolist() for t in same] == [[2, 4, 1], [2, 2, 1], [0, 0, 1, -1, -1, 1, 0, -1]]


def test_assign_slots_with_a_priority_keeps_the_highest_and_slots_them_in_fill_order():
    expert_P = torch.tensor([1, 0, 1, -1, 1, 0, 2, 1])
    priority_P = torch.tensor([0.1, 0.5, 0.9, 0.0, 0.7, 0.2, 0.3, 0.8])
    counts_E, kept_E, slot_P = assign_slots(expert_P, 3, capacity=2, priority_P=priority_P)
    # expert 1 keeps positions 2 (0.9) and 7 (0.8), in fill order; counts are taken before the drop
    assert counts_E.tolist() == [2, 4, 1] and kept_E.tolist() == [2, 2, 1]
    assert slot_P.tolist() == [-1, 0, 0, -1, -1, 1, 0, 1]


def test_the_dropless_capacity_is_the_largest_count_found_once_when_asked(monkeypatch):
    found = []
    largest = plan_module._largest_count
    monkeypatch.setattr(plan_module, "_largest_count", lambda counts, group: found.append(1) or largest(counts, group))
    logits = torch.tensor([[3.0, 0.0, 0.0]] * 5 + [[0.0, 3.0, 0.0]] * 2)
    routing = top1gating(logits, 0.5, 0, drop_tokens=False)
    assert found == [], "the packed and grouped layouts never ask: no host sync"
    assert routing.capacity == routing.capacity == 5
    assert found == [1]
    assert top1gating(logits, 0.5, 0).capacity == 2 and found == [1]  # dropping: ceil(7 / 3 * 0.5), no count read


def test_dense_puts_each_kept_weight_at_its_expert_and_slot():
    routing = Routing(
        expert_idx_SK=torch.tensor([[1, -1], [0, 1], [1, 0]]), slot_SK=torch.tensor([[0, -1], [0, 1], [2, 1]]),
        weight_SK=torch.tensor([[0.6, 0.0], [0.3, 0.7], [0.2, 0.8]]), resolve_capacity=lambda: 3, num_experts=2,
        l_aux=torch.tensor(0.0), exp_counts=torch.tensor([2, 3]), z_loss=torch.tensor(0.0))
    combine, mask = routing.dense()
    expected = torch.zeros(3, 2, 3)
    for s, e, c, w in ((0, 1, 0, 0.6), (1, 0, 0, 0.3), (1, 1, 1, 0.7), (2, 1, 2, 0.2), (2, 0, 1, 0.8)):
        expected[s, e, c] = w
    assert torch.equal(combine, expected) and torch.equal(mask, expected > 0)
    assert routing.kept_counts().tolist() == [2, 3]
    assert routing.kept_SK.tolist() == [[True, False], [True, True], [True, True]]
