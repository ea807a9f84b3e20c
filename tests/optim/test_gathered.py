"""`GatheredParameters` (optim.gathered), DeepSpeed's ZeRO-3 context for whole parameters: below stage 3
it changes nothing; at stage 3 on 2 gloo processes it hands out whole dense and expert parameters equal
to the consolidated model, keeps only the modifier rank's writes, puts the shards back, and training
goes on from the written weights."""

import pytest
import torch
import torch.distributed as dist

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, config, engine_steps

ACCUMULATION, CLIP = 2, 0.05


def test_gathered_parameters_and_empty_partition_cache_below_stage_3_change_nothing():
    from optim.zero import GatheredParameters

    engine, *_ = initialize(model=Net(), config=config(2, ACCUMULATION, CLIP))
    weight = engine.module.inp.weight
    with GatheredParameters(weight, modifier_rank=0) as gathered:
        assert engine.module.inp.weight is weight and gathered.params == []  # whole already
    engine.empty_partition_cache()
    engine_steps(engine, 1, 0, ACCUMULATION)
    with pytest.raises(ValueError, match=r"modifier_rank must be None or a rank in \[0, 1\), got 3"):
        GatheredParameters([weight], modifier_rank=3)


def _gathered_at_stage_3(rank, world):
    from optim.zero import GatheredParameters

    reset_groups()
    engine, *_ = initialize(model=Net(), config=config(3, ACCUMULATION, CLIP))
    engine_steps(engine, 1, rank, ACCUMULATION)
    engine.empty_partition_cache()  # shards again after the step: the context starts from shards
    before = engine.consolidated_state_dict()
    before = [before] if rank == 0 else [None]
    dist.broadcast_object_list(before, src=0)
    module = engine.module
    sharded = (module.inp.weight, module.moe.deepspeed_moe.experts.weight1)
    with GatheredParameters(list(sharded), modifier_rank=1):
        whole = (module.inp.weight, module.moe.deepspeed_moe.experts.weight1)
        assert all(type(w) is torch.nn.Parameter for w in whole)  # plain tensors, not DTensor shards
        torch.testing.assert_close(whole[0].detach(), before[0]["inp.weight"], rtol=0, atol=0)
        torch.testing.assert_close(whole[1].detach(), before[0]["moe.deepspeed_moe.experts.weight1"], rtol=0, atol=0)
        with torch.no_grad():
            whole[0].fill_(float(rank) + 1.0)  # only rank 1's write is kept
            whole[1].mul_(0.0)
    assert module.inp.weight is sharded[0] and module.moe.deepspeed_moe.experts.weight1 is sharded[1]
    after = engine.consolidated_state_dict()
    if rank == 0:
        assert torch.equal(after["inp.weight"], torch.full_like(after["inp.weight"], 2.0))
        assert not after["moe.deepspeed_moe.experts.weight1"].any()
        assert torch.equal(after["out.weight"], before[0]["out.weight"])
    with GatheredParameters(module.out.weight):  # read only: nothing is written back
        with torch.no_grad():
            module.out.weight.fill_(9.0)
    after = engine.consolidated_state_dict()
    if rank == 0:
        assert torch.equal(after["out.weight"], before[0]["out.weight"])
    engine_steps(engine, 1, rank, ACCUMULATION, first_step=1)  # trains on from the written weights
    assert engine.global_steps == 2


def test_gathered_parameters_at_stage_3_reads_and_writes_whole_parameters():
    run_distributed(_gathered_at_stage_3, 2, timeout_s=180)
