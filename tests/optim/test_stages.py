"""optim.stages against plain torch: each stage's reduced gradients are the mean of every rank's
gradients summed over the micro-batches, and an SGD step on its units leaves the model as plain torch's
SGD on that mean leaves it; also the offload choice and the replicas' common start."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from optim.config import OffloadConfig, ZeroConfig
from optim.precision import Precision, PrecisionConfig
from optim.stages import FlatStage, FullyShardedStage, broadcast_initial_state, build_stage, offload_wanted
from optim.zero import FlatGroup, ShardedParam, describe_parameters
from parallel import reset_groups
from tests.distributed import run_distributed

CPU = torch.device("cpu")
MICRO_BATCHES = 2
RTOL = 1e-6  # a sum over ranks, then a division, against plain torch's mean


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _batch(micro: int, rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * micro + rank))


def _stage(model: nn.Module, stage: int, world_size: int = 1, rank: int = 0, bucket_size: int = 7):
    """The stage the engine builds for `model`: one param group, fp32, with small buckets."""
    infos = describe_parameters(model, lambda param: 0)
    groups = [{"params": list(infos.values())}]
    precision = Precision(PrecisionConfig(), world_size, CPU)
    micro = {"step": 0}
    boundary = lambda: (micro["step"] + 1) % MICRO_BATCHES == 0  # noqa: E731
    zero = build_stage(ZeroConfig(stage=stage, reduce_bucket_size=bucket_size), model, infos, groups, precision,
                       False, world_size, rank, CPU, boundary)
    return zero, micro


def _train_step(zero, micro, model: nn.Module, rank: int) -> list[torch.Tensor]:
    """MICRO_BATCHES backwards (scaled by 1 / MICRO_BATCHES, as the engine's gradient factor does), then reduce."""
    for step in range(MICRO_BATCHES):
        micro["step"] = step
        (model(_batch(step, rank)).square().mean() / MICRO_BATCHES).backward()
        zero.micro_step(boundary=step == MICRO_BATCHES - 1)
    return zero.reduce(model)


def _reference(world_size: int) -> tuple[nn.Module, torch.Tensor]:
    """Plain torch: every rank's micro-batches, the gradients averaged over the ranks; one SGD step."""
    model = _model()
    for rank in range(world_size):
        for step in range(MICRO_BATCHES):
            (model(_batch(step, rank)).square().mean() / (MICRO_BATCHES * world_size)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model, grad


def _step(zero, grads: list[torch.Tensor]) -> None:
    """The engine's step on the units' proxies, then the weights back into the model."""
    for unit, grad in zip(zero.units, grads):
        unit.proxy.grad = grad
    torch.optim.SGD([unit.proxy for unit in zero.units], lr=0.1).step()
    zero.write_back()
    zero.zero_grad()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_process_stages_equal_plain_torch(stage):
    model = _model()
    zero, micro = _stage(model, stage)
    assert isinstance(zero, FlatStage) and all(isinstance(unit, FlatGroup) for unit in zero.units)
    assert zero.units[0].stage == min(stage, 2)  # alone, stage 3 holds what stage 2 does
    assert (zero.buckets is not None) == (stage >= 2)  # one process: only the sharded gradient goes through buckets
    grads = _train_step(zero, micro, model, 0)
    expected_model, expected_grad = _reference(1)
    assert torch.equal(grads[0][:expected_grad.numel()], expected_grad)
    _step(zero, grads)
    for ours, theirs in zip(model.parameters(), expected_model.parameters()):
        assert torch.equal(ours, theirs)
    assert all(unit.grad().abs().sum() == 0 for unit in zero.units)  # zero_grad cleared them


def _two_ranks(rank, world_size):
    reset_groups()
    different = _model(seed=rank)  # each rank built its own: the broadcast starts them from rank 0's values
    broadcast_initial_state(different, world_size, CPU)
    assert all(torch.equal(a, b) for a, b in zip(different.parameters(), _model().parameters()))
    expected_model, expected_grad = _reference(world_size)
    for stage in (0, 1, 2, 3):
        model = _model()
        zero, micro = _stage(model, stage, world_size, rank)
        assert isinstance(zero, FullyShardedStage if stage == 3 else FlatStage), stage
        grads = _train_step(zero, micro, model, rank)
        if stage == 3:
            assert all(isinstance(unit, ShardedParam) for unit in zero.units)
            full = torch.cat([unit.gather(grad)[0].reshape(-1) for unit, grad in zip(zero.units, grads)])
        else:
            full = zero.units[0].gather(grads[0])  # this rank's slice, gathered (stage 0: the whole)
            full = torch.cat([piece.reshape(-1) for piece in full])
        torch.testing.assert_close(full, expected_grad, rtol=RTOL, atol=0, msg=f"stage {stage}")
        _step(zero, grads)
        zero.settle(model)
        for name, ours in model.named_parameters():
            ours = ours.full_tensor() if hasattr(ours, "full_tensor") else ours
            torch.testing.assert_close(ours.detach(), expected_model.get_parameter(name).detach(), rtol=RTOL, atol=0,
                                       msg=f"stage {stage} {name}")
    dist.barrier()


def test_two_ranks_reduce_the_mean_and_step_as_plain_torch():
    run_distributed(_two_ranks, 2, timeout_s=180)


def test_offload_has_effect_on_an_accelerator_only():
    asked = ZeroConfig(stage=2, offload_optimizer=OffloadConfig(device="cpu"))
    with pytest.warns(UserWarning, match="zero_optimization.offload_optimizer has no effect: the model is already "
                                         "in host memory"):
        assert offload_wanted(asked, CPU) is False
    assert offload_wanted(asked, torch.device("cuda")) is True
    assert offload_wanted(ZeroConfig(stage=2), torch.device("cuda")) is False


def test_a_replica_alone_is_left_as_it_is():
    model = _model(seed=3)
    before = copy.deepcopy(model.state_dict())
    broadcast_initial_state(model, 1, CPU)  # no process group: nothing to agree on
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
