"""Stage 3's sharding through torch's `fully_shard` (optim.fsdp), on 2 gloo processes at ep 2: the
outermost all-expert module is sharded over its expert-data-parallel mesh (one rank here) and the model
over the data-parallel mesh; the engine's parameter records follow the sharded parameters; gradients
equal plain torch's, dense ones averaged over the ranks and expert ones divided by the data-parallel
world size as stages 0-2 divide them (fp32, 1e-6); and `reshard` shards again what a forward without
a backward left gathered."""

import copy

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from optim.fsdp import _outermost_expert_modules, reshard, shard_model
from optim.zero import describe_parameters
from parallel import reset_groups, tag_expert_parameters
from tests.distributed import run_distributed

RTOL = 1e-6  # a sum over ranks, then a division, against plain torch's mean


def _model() -> nn.Module:
    """Linear, ReLU, an expert block (Linear, ReLU) tagged for ep 2, Linear."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6), nn.ReLU()), nn.Linear(6, 3))
    tag_expert_parameters(model[2].parameters(), "ep_size_2")
    return model


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))


def _plain_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(_batch(rank)).square().mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _sharded(rank, world):
    reset_groups()
    model = _model()
    plain = copy.deepcopy(model)
    infos = describe_parameters(model, lambda param: 0)
    by_name = {info.name: info for info in infos.values()}
    assert [name for name, _ in _outermost_expert_modules(model, by_name)] == ["2"]
    shard_model(model, infos, None, torch.float32, False, world, torch.device("cpu"))
    assert isinstance(model, FSDPModule) and isinstance(model[2], FSDPModule) and not isinstance(model[0], FSDPModule)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and by_name[name].param is param, name
        assert param.device_mesh.size() == (1 if name.startswith("2.") else world), name  # edp at ep 2: one rank
        owner, attribute = param.sharded_owner
        assert owner.get_parameter(attribute) is param
    model(_batch(rank)).square().mean().backward()
    every = [_plain_grads(plain, r) for r in range(world)]
    for name, param in model.named_parameters():
        if name.startswith("2."):  # this rank's experts saw this rank's tokens; divided like every gradient
            expected = every[rank][name] / world
        else:
            expected = sum(grads[name] for grads in every) / world
        torch.testing.assert_close(param.grad.full_tensor(), expected, rtol=RTOL, atol=0, msg=name)
    with torch.no_grad():  # an evaluation pass: the root's parameters stay gathered
        model(_batch(rank))
    assert not isinstance(model[0].weight, DTensor)
    reshard(model)
    assert all(isinstance(param, DTensor) for param in model.parameters())


def test_sharded_model_groups_and_gradients_on_two_ranks():
    run_distributed(_sharded, 2, timeout_s=120)
