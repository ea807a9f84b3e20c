"""`parallel.comm`, DeepSpeed's `deepspeed.comm` names: torch.distributed's answers on 2 gloo ranks, and
a group of one's answers without a process group."""

import warnings

import pytest
import torch
import torch.distributed

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
    for gather in (dist.all_gather_into_tensor, dist.all_gather_single):
        flat = torch.empty(4)
        gather(flat, t)
        assert torch.equal(flat, t)
    for reduce_scatter in (dist.reduce_scatter_tensor, dist.reduce_scatter_single):
        part = torch.empty(4)
        reduce_scatter(part, t)
        assert torch.equal(part, t)
    with pytest.raises(ValueError, match=r"all_gather without a process group gathers from one rank: tensor_list must "
                                         r"have 1 entry, got 2"):
        dist.all_gather([torch.empty(4), torch.empty(4)], t)


def test_the_single_tensor_collectives_are_the_running_torchs():
    for name, newer, older in ((dist.ALL_GATHER_NAME, "all_gather_single", "all_gather_into_tensor"),
                               (dist.REDUCE_SCATTER_NAME, "reduce_scatter_single", "reduce_scatter_tensor")):
        assert callable(getattr(torch.distributed, name)), name
        if torch.__version__ >= "2.13":  # the newer names, since the older ones warn there
            assert name == newer
        if torch.__version__ < "2.12":  # torch 2.11 has only the older names
            assert name == older and not hasattr(torch.distributed, newer)


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
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates the older names: they must not be called
        for gather in (dist.all_gather_single, dist.all_gather_into_tensor):
            flat = torch.empty(2 * world)
            gather(flat, torch.tensor([float(rank), rank + 0.5]))
            assert flat.tolist() == [0.0, 0.5, 1.0, 1.5]
        for reduce_scatter in (dist.reduce_scatter_single, dist.reduce_scatter_tensor):
            part = torch.empty(1)
            reduce_scatter(part, torch.tensor([1.0, 2.0]) * (rank + 1))
            assert part.tolist() == [3.0 * (rank + 1)]  # [1, 2] + [2, 4], one element each
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
