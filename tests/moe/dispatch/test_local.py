"""The one-process dispatchers (moe.dispatch.local: padded, packed, grouped) against the plain-torch
reference.

The reference (tests/moe/dispatch/reference.py) runs every kept (token, choice) through its expert's
MLP one token at a time and sums the weighted outputs per token. A dispatcher, given the same routing
plan, must give the same outputs, and the same gradients for the tokens, the combine weights and
every expert weight: fp32, 1e-5. The expert-parallel dispatchers have their tests in
test_expert_parallel.py and test_per_rank.py.
"""

import pytest
import torch

from moe.dispatch import Grouped, Packed, Padded
from tests.moe.dispatch.reference import E, FP32, GATES, grads, reference_output, run, stacked_experts, tokens_and_plan


@pytest.mark.parametrize("case", list(GATES))
@pytest.mark.parametrize("dispatcher", [Padded(), Packed(False), Packed(None), Grouped()],
                         ids=["padded", "packed", "packed-measured", "grouped"])
def test_one_process_dispatcher_equals_the_reference(dispatcher, case):
    x, routing, grad = tokens_and_plan(case, 0)
    experts = stacked_experts(0, E)
    out = run(dispatcher, x, routing, experts)
    expected = reference_output(x, routing, experts)
    torch.testing.assert_close(out, expected, **FP32)
    inputs = [x, routing.weight_SK, *experts.parameters()]
    for got, want in zip(grads(out, grad, inputs), grads(expected, grad, inputs)):
        torch.testing.assert_close(got, want, **FP32)
    if case != "top3-dropless":
        assert int((routing.expert_idx_SK < 0).sum()) > 0, "the dropping plans should drop some choices"
