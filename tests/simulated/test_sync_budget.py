"""The host-sync budget of one MoE layer's forward and backward, counted on the CUDA code path.

Counted with the Triton kernels forced (MOE_KERNELS=triton, the branches a GPU takes): on a GPU on
CUDA tensors, on a CPU-only machine on CPU tensors with Triton interpreted (the expert-parallel
counts on gloo ranks on the CPU, interpreted, on any machine). The gate and the padded layout make
no host sync; grouped stacked experts (plain or gated) in one process make none (device offsets); packed in one
process, and packed or grouped under expert parallelism, make exactly one per layer (the row
counts), with either exchange. The input checks that would sync are opt-in (MOE_SYNC_CHECKS=1) and
are counted too. The same layer also runs on the meta device, where any host read would raise.
"""

import pytest
import torch
from torch import nn

from moe import MoE, SwiGLU
from parallel import reset_groups
from tests.devices import DEVICE
from tests.distributed import run_distributed
from tests.simulated.sync_counter import count_syncs


def _layer(compute, ep_size=1, gated=False, **kwargs):
    torch.manual_seed(0)
    expert = SwiGLU(16, 32) if gated else nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    return MoE(16, expert, num_experts=4, ep_size=ep_size, k=2, expert_layout=compute, min_capacity=0, **kwargs)


def _count(layer, tokens=24, device=DEVICE, input_grad=True):
    layer.to(device)
    x = torch.randn(tokens, 16, device=device, requires_grad=input_grad)
    with count_syncs() as counter:
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
    return counter.syncs


@pytest.fixture
def cuda_branches(monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "triton")
    monkeypatch.delenv("MOE_SYNC_CHECKS", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("k_kwargs", [dict(), dict(noisy_gate_policy="RSample"), dict(top2_2nd_expert_sampling=False)])
def test_gate_and_padded_layout_make_no_sync(cuda_branches, k_kwargs):
    assert _count(_layer("padded", **k_kwargs)) == []
    top1 = MoE(16, nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16)), num_experts=4, k=1,
               expert_layout="padded", min_capacity=0, use_rts=True)
    assert _count(top1) == []
    top3 = MoE(16, nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 16)), num_experts=4, k=3,
               expert_layout="padded", min_capacity=0)
    assert _count(top3) == []


@pytest.mark.slow
def test_grouped_without_expert_parallelism_makes_no_sync(cuda_branches):
    assert _count(_layer("grouped")) == []
    assert _count(_layer("grouped", dropless=True)) == []
    # a first layer: the backward skips the input gradient and still reads nothing on the host
    assert _count(_layer("grouped"), input_grad=False) == []
    assert _count(_layer("grouped", dropless=True), input_grad=False) == []
    assert _count(_layer("grouped", gated=True)) == []  # stacked gated experts (SwiGLU) as well
    assert _count(_layer("grouped", gated=True, dropless=True)) == []


def test_packed_and_dropless_padded_make_one_sync_per_layer(cuda_branches):
    assert _count(_layer("packed")) == ["tolist"]  # the slice sizes
    assert len(_count(_layer("padded", drop_tokens=False))) == 1  # the dropless capacity


def test_opt_in_checks_are_the_only_other_syncs(cuda_branches, monkeypatch):
    monkeypatch.setenv("MOE_SYNC_CHECKS", "1")
    syncs = _count(_layer("padded"))
    assert syncs and all(s == "aten._local_scalar_dense.default" for s in syncs)


@pytest.mark.parametrize("compute", ["padded", "grouped"])
def test_padded_and_grouped_layers_run_forward_and_backward_on_meta(compute, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "triton")
    with torch.device("meta"):
        layer = _layer(compute)
    for input_grad in (True, False):  # with and without the input's gradient (a first layer)
        layer.zero_grad(set_to_none=True)
        x = torch.randn(24, 16, device="meta", requires_grad=input_grad)  # any host read here would raise
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
        assert out.device.type == "meta" and layer.deepspeed_moe.experts.weight1.grad.shape == (4, 32, 16)
        assert layer.deepspeed_moe.experts.bias1.grad.shape == (4, 32) and (x.grad is not None) == input_grad


def _expert_parallel_syncs(rank, world_size):
    reset_groups()
    for compute, kwargs in (("grouped", {}), ("packed", {}), ("grouped", dict(dropless=True)), ("padded", {}),
                            ("grouped", dict(exchange="per_rank")), ("packed", dict(exchange="per_rank"))):
        syncs = _count(_layer(compute, ep_size=world_size, **kwargs), device="cpu")  # gloo ranks
        if compute == "padded":  # on the CPU the equal-token check reads the group's counts (free there)
            assert syncs == ["tolist"], syncs
        else:  # the split sizes, read once after the counts are exchanged on the device
            assert syncs == ["tolist"], (compute, kwargs, syncs)


@pytest.mark.slow
def test_expert_parallel_layouts_make_one_sync_per_layer(monkeypatch):
    # Triton's own @jit helpers (tl.zeros, ...) are interpreted or compiled as TRITON_INTERPRET was at
    # `import triton`: ranks in fresh interpreters import it with the variable set, also on a GPU
    # machine, where this process and the fork server imported it compiled
    monkeypatch.setenv("MOE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("MOE_SYNC_CHECKS", raising=False)
    run_distributed(_expert_parallel_syncs, 2, fresh=True)
