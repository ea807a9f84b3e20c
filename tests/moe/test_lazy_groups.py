"""An MoE layer built before torch.distributed exists, as DeepSpeed scripts build it: its expert-parallel
groups are made by `optim.initialize` or at its first forward, and it then holds, runs and names the
experts of its expert-parallel rank, equal to a one-process reference (fp32, 1e-5 relative).

The distributed tests start in the helper's gloo group, agree on a new port, leave the group and
build the layer outside any group, with torchrun's variables set (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), as a script under torchrun starts.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import optim
import parallel
from moe import MoE
from parallel import expert_groups, expert_ids, reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E = 16, 8, 16, 4


def _layer(ep_size, expert_init):
    torch.manual_seed(0)  # the template: the same on every rank
    return MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), num_experts=E, ep_size=ep_size, k=2,
               min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False, expert_init=expert_init, seed=3,
               expert_layout="packed")


def _tokens(rank):
    return torch.randn(S, M, generator=torch.Generator().manual_seed(50 + rank))


def _leave_the_group():
    """Agree on a fresh port for the next group, then destroy this one: as a script before its init."""
    port = [None]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = [s.getsockname()[1]]
    dist.broadcast_object_list(port, src=0)
    os.environ["MASTER_PORT"] = str(port[0])
    dist.destroy_process_group()
    reset_groups()


class _Model(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        out, l_aux, _ = self.layer(x)
        return out, l_aux


def _built_before_the_group(rank, world, expert_init, join):
    _leave_the_group()
    layer = _layer(2, expert_init)
    assert not dist.is_initialized() and layer.deepspeed_moe.ep_group is None
    if join == "initialize":
        engine, *_ = optim.initialize(model=_Model(layer), config={"train_batch_size": world,
                                                                   "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        assert dist.is_initialized() and layer.deepspeed_moe.ep_group is not None
        out, l_aux = engine(_tokens(rank))
    else:
        out, l_aux, _ = layer(_tokens(rank))  # the first forward joins the group
    groups = expert_groups(2)
    assert layer.deepspeed_moe.ep_group is groups.ep_group is layer.deepspeed_moe.gate.ep_group
    assert layer.ep_rank == groups.ep_rank
    first, L = groups.ep_rank * (E // 2), E // 2
    experts = layer.deepspeed_moe.experts
    assert expert_ids(experts.weight1)[0] == tuple(range(first, first + L))
    reference = _layer(1, expert_init).deepspeed_moe.experts
    torch.testing.assert_close(experts.weight1.detach(), reference.weight1[first:first + L].detach(), rtol=0, atol=0)
    expected, expected_aux, _ = _layer(1, expert_init)(_tokens(rank))
    torch.testing.assert_close(out, expected, **FP32)
    torch.testing.assert_close(l_aux, expected_aux, **FP32)
    dist.barrier()


@pytest.mark.parametrize("expert_init, join", [("per_expert_seed", "initialize"), ("per_expert_seed", "forward"),
                                               ("copy", "initialize")])
@pytest.mark.slow
def test_a_layer_built_before_init_distributed_gets_its_groups_later(expert_init, join):
    run_distributed(_built_before_the_group, 2, expert_init, join, timeout_s=120)


def _written_before_the_group(rank, world):
    _leave_the_group()
    layer = _layer(2, "per_expert_seed")
    with torch.no_grad():
        layer.deepspeed_moe.experts.weight1.zero_()  # a state dict loaded too early
    parallel.init_distributed()
    if rank == 0:  # holds experts 0 and 1, as built: nothing is re-initialised
        layer.set_deepspeed_parallelism()
        assert not layer.deepspeed_moe.experts.weight1.any()
    else:
        with pytest.raises(RuntimeError, match=r"the experts' weights were written before the expert-parallel groups "
                                               r"existed.*load weights after optim.initialize"):
            layer.set_deepspeed_parallelism()
    dist.barrier()  # no rank leaves while its peer still builds the groups


def test_expert_weights_written_before_the_groups_are_not_silently_replaced():
    run_distributed(_written_before_the_group, 2, timeout_s=120)


def test_a_layer_used_without_a_process_group_fails_with_one_clear_error(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    reset_groups()
    layer = _layer(2, "copy")  # built as DeepSpeed builds it: no error yet
    assert layer.num_local_experts == E // 2
    with pytest.raises(RuntimeError, match=r"this MoE layer has ep_size \(2\) > 1 and no process group: launch the "
                                           r"script with torchrun"):
        layer(torch.randn(S, M))
