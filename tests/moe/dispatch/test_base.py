"""The dispatcher interface (moe.dispatch.base) and the choice of one dispatcher per way of travelling
(moe.dispatch.make_dispatcher).

The shared steps every dispatcher runs, against plain torch on a hand-made layout: tokens copied into
their buffer rows (empty rows zero, each row's source token recorded once), rows brought back weighted
and summed per token with the same gradients as the plain formula, whether or not the permute's source
tokens are handed on; the counts read on the host; and the interface a subclass must fill in.
Tolerance: fp32 1e-5.
"""

import pytest
import torch

from moe.dispatch import (
    Dispatched, Dispatcher, Grouped, Packed, PackedExpertParallel, Padded, PaddedExpertParallel, PerRankExchange,
    TokenRows, make_dispatcher,
)
from moe.dispatch.base import combine_tokens, permute_tokens, read_counts

FP32 = {"rtol": 1e-5, "atol": 1e-5}
# 3 tokens, 2 choices each, 6 buffer rows: token 0's second choice dropped, row 5 empty
ROW_SK = torch.tensor([[2, -1], [0, 3], [4, 1]])
NUM_ROWS = 6


def test_permute_tokens_copies_each_kept_choice_into_its_row():
    x_SM = torch.randn(3, 4)
    weight_SK = torch.rand(3, 2)
    buffer_NM, tokens = permute_tokens(x_SM, ROW_SK, weight_SK, NUM_ROWS)
    assert tokens.token_N.tolist() == [1, 2, 0, 1, 2, -1]
    assert torch.equal(buffer_NM[:5], x_SM[[1, 2, 0, 1, 2]]) and bool((buffer_NM[5] == 0).all())
    assert tokens.row_SK is ROW_SK and tokens.weight_SK is weight_SK


@pytest.mark.parametrize("hand_on_source_tokens", [True, False])
def test_combine_tokens_equals_the_weighted_sum_and_its_gradients(hand_on_source_tokens):
    g = torch.Generator().manual_seed(0)
    y_NM = torch.randn(NUM_ROWS, 4, generator=g, requires_grad=True)
    weight_SK = torch.rand(3, 2, generator=g, requires_grad=True)
    token_N = torch.tensor([1, 2, 0, 1, 2, -1]) if hand_on_source_tokens else None
    out_SM = combine_tokens(y_NM, TokenRows(ROW_SK, weight_SK, token_N))
    y_ref, w_ref = y_NM.detach().clone().requires_grad_(), weight_SK.detach().clone().requires_grad_()
    expected = torch.stack([w_ref[0, 0] * y_ref[2], w_ref[1, 0] * y_ref[0] + w_ref[1, 1] * y_ref[3],
                            w_ref[2, 0] * y_ref[4] + w_ref[2, 1] * y_ref[1]])
    torch.testing.assert_close(out_SM, expected, **FP32)
    grad_SM = torch.randn(3, 4, generator=g)
    out_SM.backward(grad_SM)
    expected.backward(grad_SM)
    torch.testing.assert_close(y_NM.grad, y_ref.grad, **FP32)
    torch.testing.assert_close(weight_SK.grad, w_ref.grad, **FP32)
    assert bool((y_NM.grad[5] == 0).all()) and float(weight_SK.grad[0, 1]) == 0.0  # the empty row, the dropped choice


def test_read_counts_gives_host_ints():
    counts = read_counts(torch.tensor([3, 0, 2]))
    assert counts == [3, 0, 2] and all(type(c) is int for c in counts)


def test_a_dispatcher_must_implement_both_directions():
    with pytest.raises(TypeError, match="abstract"):
        Dispatcher()

    class OneWay(Dispatcher):  # dispatch without combine is not a dispatcher
        def dispatch(self, x_SM, routing):
            return None

    with pytest.raises(TypeError, match="combine"):
        OneWay()

    class Identity(Dispatcher):  # the smallest complete one: every token its own row, weight 1
        def dispatch(self, x_SM, routing):
            return Dispatched(x_SM, [x_SM.shape[0]], TokenRows(ROW_SK, torch.ones(3, 2), None))

        def combine(self, y_NM, dispatched):
            return y_NM

    identity = Identity()
    assert identity.grouped_gemm is False
    x = torch.randn(3, 4)
    dispatched = identity.dispatch(x, None)
    assert torch.equal(identity.combine(dispatched.rows_NM, dispatched), x)


def test_make_dispatcher_picks_one_class_per_way():
    assert type(make_dispatcher("padded")) is Padded
    assert type(make_dispatcher("packed")) is Packed and make_dispatcher("packed").grouped_gemm is False
    assert make_dispatcher("packed", measured=True).grouped_gemm is None
    assert type(make_dispatcher("grouped")) is Grouped
    assert type(make_dispatcher("grouped", stacked=False)) is Packed  # module experts: products per expert
    assert type(make_dispatcher("padded", ep_size=2)) is PaddedExpertParallel
    assert type(make_dispatcher("grouped", ep_size=2)) is PackedExpertParallel
    assert make_dispatcher("grouped", ep_size=2).grouped_gemm is True
    assert type(make_dispatcher("packed", "per_rank", ep_size=2)) is PerRankExchange
    assert type(make_dispatcher("packed", "per_rank", ep_size=1)) is Packed  # one process: nothing to exchange
