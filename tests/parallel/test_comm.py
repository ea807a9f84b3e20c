"""`parallel.comm`, DeepSpeed's `deepspeed.comm` names: torch.distributed's answers on 2 gloo ranks, and
a group of one's answers without a process group."""

import pytest
import torch

import parallel.comm as dist
from tests.distributed import run_distributed


def test_without_a_process_group_it_answers_for_one_process(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not dist.is_initialized()
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    t = torch.arange(4.0)
    for collective in (lambda: dist.all_reduce(t), lambda: dist.broadcast(t, 0), lambda: dist.barrier(),
                       lambda: dist.reduce(t, 0)):
        assert collective() is None
    assert torch.equal(t, torch.arange(4.0))
    out = [torch.empty(4)]
    dist.all_gather(out, t)
    assert torch.equal(out[0], t)
    flat = torch.empty(4)
    dist.all_gather_into_tensor(flat, t)
    assert torch.equal(flat, t)
    with pytest.raises(ValueError, match=r"all_gather without a process group gathers from one rank: tensor_list must "
                                         r"have 1 entry, got 2"):
        dist.all_gather([torch.empty(4), torch.empty(4)], t)


def _collectives(rank, world):
    assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) == (rank, world)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((2,), 3.0))
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert torch.equal(t, torch.full((2,), 1.0))
    parts = [torch.empty(1) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([float(rank)]))
    assert [float(p) for p in parts] == [0.0, 1.0]
    out = torch.empty(world)
    dist.all_to_all_single(out, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    assert out.tolist() == [float(rank), 10.0 + rank]
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=1)
    assert float(b) == 1.0
    group = dist.new_group([0, 1])
    assert dist.get_global_rank(group, 1) == 1 and dist.get_world_group() is not None
    dist.barrier()


def test_on_two_ranks_it_is_torch_distributed():
    run_distributed(_collectives, 2, timeout_s=60)


def _objects_and_profiling_keywords(rank, world):
    objects = [{"rank": rank}] * 1 if rank == 0 else [None]
    dist.broadcast_object_list(objects, src=0)  # torch.distributed's own, through the module
    assert objects == [{"rank": 0}]
    t = torch.ones(1)
    dist.all_reduce(t, log_name="grad", prof=False, debug="")  # DeepSpeed's profiling keywords
    assert float(t) == world


def test_torch_distributeds_other_names_and_deepspeeds_keywords():
    run_distributed(_objects_and_profiling_keywords, 2, timeout_s=60)
