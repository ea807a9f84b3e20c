"""parallel.all_to_all on 2 gloo ranks: row chunks go to their ranks, equal (the capacity layout) or
of the sizes `exchange_counts` handed over (the dropless layout), and the backward is the reverse
exchange; each against rows and gradients numbered by hand."""

import torch
import torch.distributed as dist

from parallel import all_to_all, exchange_counts
from tests.distributed import run_distributed


def _equal_chunks(rank, world):
    x = (torch.arange(4.0) + 10 * rank).unsqueeze(1).repeat(1, 3).requires_grad_()  # rows 10r, ..., 10r + 3
    out = all_to_all(x, dist.group.WORLD)
    # chunk i (rows 2i, 2i + 1) goes to rank i: rank r gets rows 10s + 2r, 10s + 2r + 1 from each rank s in turn
    expected = torch.tensor([10.0 * s + 2 * rank + i for s in range(world) for i in range(2)]).unsqueeze(1).repeat(1, 3)
    assert torch.equal(out.detach(), expected)
    grads = [torch.arange(12.0).view(4, 3) + 100 * r for r in range(world)]  # every rank's gradient of its out
    out.backward(grads[rank])
    # a row's gradient is the one its receiver had for it: rank i's rows 2r, 2r + 1
    assert torch.equal(x.grad, torch.cat([grads[i][2 * rank:2 * rank + 2] for i in range(world)]))


def _variable_chunks(rank, world):
    sent = {0: [1, 2], 1: [3, 0]}  # rows each rank sends to rank 0 and rank 1
    received = exchange_counts(torch.tensor(sent[rank]), dist.group.WORLD)
    assert received.tolist() == [sent[0][rank], sent[1][rank]]
    pairs = exchange_counts(torch.tensor([[rank, 0], [rank, 1]]), dist.group.WORLD)  # row i goes to rank i
    assert pairs.tolist() == [[0, rank], [1, rank]]
    x = (torch.arange(3.0) + 100 * rank).unsqueeze(1).requires_grad_()
    out = all_to_all(x, dist.group.WORLD, received.tolist(), sent[rank])
    assert out.detach().squeeze(1).tolist() == {0: [0.0, 100.0, 101.0, 102.0], 1: [1.0, 2.0]}[rank]
    out.backward(torch.full_like(out, rank + 1.0))  # each row's gradient says which rank received it
    assert x.grad.squeeze(1).tolist() == {0: [1.0, 2.0, 2.0], 1: [1.0, 1.0, 1.0]}[rank]


def _both(rank, world):
    _equal_chunks(rank, world)
    _variable_chunks(rank, world)


def test_equal_and_variable_chunks_and_their_reverse_on_two_ranks():
    run_distributed(_both, 2, timeout_s=60)
