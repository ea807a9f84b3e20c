"""The defects a first GPU run would have hit, each shown fixed (on CPU, gloo, or the simulated world)."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe import MoE, SwiGLU
from optim import initialize
from optim.zero import shard_placement
from parallel import expert_groups, groups_for_name, local_device, reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, loss_of
from tests.simulated.world import META, simulated_world


def test_groups_rebuilt_by_name_keep_their_layout(monkeypatch):
    with simulated_world(monkeypatch, 8, 5):
        built = expert_groups(2, use_data_before_expert_parallel=True)
        expected = dist.get_process_group_ranks(built.ep_group)
        reset_groups()
        again = groups_for_name("ep_size_2", True)  # as the engine does from the parameters' tags
        assert dist.get_process_group_ranks(again.ep_group) == expected == [1, 5]
        with pytest.raises(ValueError, match="use_data_before_expert_parallel"):
            groups_for_name("ep_size_2", False)


def test_expert_parameters_carry_their_layout(monkeypatch):
    with simulated_world(monkeypatch, 4, 0), torch.device("meta"):
        layer = MoE(8, nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), num_experts=4, ep_size=2,
                    use_data_before_expert_parallel=True)
        assert all(p.use_data_before_expert_parallel for p in layer.deepspeed_moe.experts.parameters())


def test_local_device_without_local_rank_spreads_ranks_over_gpus(monkeypatch):
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("RANK", "6")
    assert local_device() == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_device() == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "4")
    with pytest.raises(ValueError, match=r"LOCAL_RANK \(4\) must be below the number of GPUs on this node \(4\)"):
        local_device()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK must be a non-negative integer, got 'x'"):
        local_device()


def test_uneven_zero3_shards_go_on_dim_0():
    place = shard_placement(8)
    assert place(torch.empty(10, 84)).dim == 0  # fully_shard pads uneven shards on dim 0 only
    assert place(torch.empty(10, 16)).dim == 1  # a dimension that divides keeps shards equal
    assert place(torch.empty(16, 10)).dim == 0


def test_router_stays_fp32_under_autocast():
    torch.manual_seed(0)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16)), num_experts=8, k=2,
                top2_2nd_expert_sampling=False, min_capacity=0)
    x = torch.randn(64, 16)
    layer(x)
    plain = layer.deepspeed_moe.routing
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    mixed = layer.deepspeed_moe.routing
    assert torch.equal(plain.expert_idx_SK, mixed.expert_idx_SK)
    assert torch.equal(plain.weight_SK, mixed.weight_SK)  # bit for bit: the logits were not computed in bf16


def test_fp16_autocast_gets_a_loss_scaler():
    engine, *_ = initialize(Net(), config=config(0, torch_autocast={"enabled": True, "dtype": "float16"}))
    assert engine.scaler is not None and engine.loss_scale == 2.0**16
    engine, *_ = initialize(Net(), config=config(0, torch_autocast={"enabled": True, "dtype": "bfloat16"}))
    assert engine.scaler is None


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_gradients_accumulate_in_fp32(stage):
    accumulation = 4
    engine, *_ = initialize(Net(), config=config(stage, accumulation=accumulation, clip=0.0, bf16={"enabled": True}))
    stepped = []
    step = engine.optimizer.step
    engine.optimizer.step = lambda: (stepped.extend(u.proxy.grad.clone() for u in engine.units), step())[1]
    expected = {}

    def add(param, grad):  # each micro-batch's bf16 gradient, summed in fp32 (stage 2 frees .grad in the backward)
        expected[id(param)] = expected.get(id(param), 0) + grad.float()

    for p in engine.module.parameters():
        p.register_hook(functools.partial(add, p))
    for micro in range(accumulation):
        x, y = batch(0, micro, 0)
        engine.backward(loss_of(engine(x), y))
        engine.step()
    for unit, grad in zip(engine.units, stepped):
        assert grad.dtype == torch.float32
        want = torch.cat([expected[id(info.param)].reshape(-1) for info in unit.infos])
        torch.testing.assert_close(grad[:want.numel()], want, rtol=1e-6, atol=0)
    low = initialize(Net(), config=config(stage, accumulation=1, bf16={
        "enabled": True, "bf16_master_weights_and_grads": True}))[0]
    assert all(u.grad().dtype == torch.bfloat16 for u in low.units)  # bf16 only when asked for


def test_gloo_workaround_stays_off_elsewhere(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    calls = []
    monkeypatch.setattr(FSDPModule, "set_force_sum_reduction_for_comms", lambda self, value: calls.append(value))
    with simulated_world(monkeypatch, 8, 3):
        with META:
            model = Net(ep_size=2)
        engine, *_ = initialize(model, config=config(3))
        assert calls == []  # the fake backend stands for NCCL, which has PREMUL_SUM
        out = engine(torch.randn(6, 8))  # a CPU batch: the engine moves it to the model's device
        assert out[0].device == META


def _unequal_tokens(rank, world_size):
    reset_groups()
    layer = MoE(8, nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)), num_experts=4, ep_size=2,
                min_capacity=0, expert_layout="padded")
    with pytest.raises(ValueError, match="same number of tokens on every rank .* got between 6 and 7"):
        layer(torch.randn(6 + rank, 8))
    out, _, _ = layer(torch.randn(6, 8))  # equal counts still run
    assert out.shape == (6, 8)


def test_padded_expert_parallelism_with_unequal_token_counts_fails_on_every_rank():
    run_distributed(_unequal_tokens, 2)


class _Doubled(nn.Module):
    """An expert that is not a plain MLP: the experts stay separate modules, not stacked weights."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return 2 * self.linear(x)


def test_auto_layout_on_a_gpu_is_grouped_where_torch_grouped_gemm_runs_in_bf16(monkeypatch):
    """Dropping on a GPU, "auto" takes the grouped layout (no empty slots multiplied, no host sync) for one
    process's stacked experts in bf16 where torch's grouped GEMM runs, and the padded one otherwise."""
    from kernels import grouped_gemm

    monkeypatch.delenv("MOE_GROUPED_GEMM", raising=False)
    monkeypatch.setattr(grouped_gemm, "_torch_grouped_mm_runs", lambda device, dtype: dtype == torch.bfloat16)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def layer(hidden=16, expert=None, **kwargs):
        expert = expert or nn.Sequential(nn.Linear(hidden, 32), nn.GELU(), nn.Linear(32, hidden))
        return MoE(hidden, expert, num_experts=4, k=2, **kwargs).deepspeed_moe

    assert layer()._layout(cuda, torch.bfloat16) == "grouped"
    assert layer()._layout(cuda, torch.float32) == "padded"
    assert layer()._layout(cuda, torch.float16) == "padded"
    assert layer()._layout(cpu, torch.bfloat16) == "packed"
    assert layer(hidden=12)._layout(cuda, torch.bfloat16) == "padded"  # 24-byte rows: torch's GEMM refuses them
    odd_ffn = nn.Sequential(nn.Linear(16, 36), nn.GELU(), nn.Linear(36, 16))
    assert layer(expert=odd_ffn)._layout(cuda, torch.bfloat16) == "padded"  # 72-byte hidden rows
    assert layer(expert=SwiGLU(16, 32))._layout(cuda, torch.bfloat16) == "grouped"  # stacked gated experts
    assert layer(expert=SwiGLU(16, 36))._layout(cuda, torch.bfloat16) == "padded"  # 144-byte gate | up rows, 72-byte a
    wider_out = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 12))
    with pytest.raises(ValueError, match=r"the expert's last Linear gives 12 features"):
        layer(expert=wider_out)  # its rows could not stand in the tokens' place: refused before any layout
    assert layer(routing="expert_choice")._layout(cuda, torch.bfloat16) == "grouped"
    from moe import layer as layer_module
    monkeypatch.setattr(layer_module, "autocast_dtype", lambda device: torch.bfloat16)
    assert layer()._layout(cuda, torch.float32) == "grouped"  # fp32 inputs, bf16 products under autocast
    monkeypatch.setattr(layer_module, "autocast_dtype", lambda device: None)
    assert layer(expert=_Doubled())._layout(cuda, torch.bfloat16) == "padded"  # experts that are not stacked
    assert layer(expert_layout="padded")._layout(cuda, torch.bfloat16) == "padded"
    assert layer(drop_tokens=False)._layout(cuda, torch.float32) == "grouped"
    monkeypatch.setenv("MOE_GROUPED_GEMM", "triton")
    assert layer()._layout(cuda, torch.bfloat16) == "padded"
    monkeypatch.setenv("MOE_GROUPED_GEMM", "torch")
    assert layer()._layout(cuda, torch.bfloat16) == "grouped"
    assert layer(hidden=12)._layout(cuda, torch.bfloat16) == "padded"  # forced, but the rows do not fit
    monkeypatch.delenv("MOE_GROUPED_GEMM")
    with simulated_world(monkeypatch, 2, 0):
        assert layer(ep_size=2)._layout(cuda, torch.bfloat16) == "padded"  # its splits would need a host read
