"""The newer routers on the GPU code path: the GPT recipe's step in a simulated world of GPUs, and the
layer's host-sync budget with the CUDA branches forced (see tests/simulated/world.py, sync_counter.py).

Sigmoid scoring with the expert bias, the sequence and global-batch losses, group-limited routing,
shared experts and expert choice keep the layouts' budgets: none in the padded layout and in grouped
experts in one process, one read per MoE layer under expert parallelism in the packed and grouped
layouts (the per-rank exchange too). The bias stays on the model's device and its update's
all-reduce runs there.
"""

import pytest
import torch
from torch import nn

from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from recipes import gpt
from recipes.common.cli import engine_config
from recipes.gpt_model import GPT
from tests.devices import DEVICE
from tests.simulated.sync_counter import count_syncs
from tests.simulated.world import META, simulated_world

METHODS = {
    "sigmoid-bias": dict(scoring_func="sigmoid", bias_update_speed=1e-3, load_balancing_type="none"),
    "seq-loss": dict(scoring_func="sigmoid", bias_update_speed=1e-3, load_balancing_type="seq_aux_loss"),
    "global-loss": dict(load_balancing_type="global_aux_loss"),
    "groups": dict(scoring_func="sigmoid", n_group=4, topk_group=2),
    "shared": dict(n_shared_experts=1, shared_expert_gate=True),
    "expert-choice": dict(routing="expert_choice", capacity_factor=2.0),
}


def _gpt_step(monkeypatch, world, ep, stage, method, compute, **extra):
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8, top_k=2,
                          ep_world_size=ep, stage=stage, dtype="bf16", steps=10, expert_layout=compute,
                          **{**METHODS[method], **extra})
    rows = cfg.batch_size * cfg.seq_len * cfg.top_k
    with simulated_world(monkeypatch, world, world - 1, rows_per_rank=rows) as log:
        with META:
            model = GPT(gpt.model_config(cfg))
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"})
        engine, *_ = initialize(model, model_parameters=groups, config=engine_config(gpt.engine_fragments(cfg), set(), ""))
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1))
        loss = gpt.train_step(engine, cfg, tokens[:, :-1], tokens[:, 1:])
        assert loss.device == META and engine.global_steps == 1
        for module in model.modules():
            if isinstance(module, MoE) and module.expert_bias is not None:
                assert module.expert_bias.device == META and module.expert_bias.dtype == torch.float32
        return log, [r for r in log.reads.reads if r in ("counts", "exchange", "pair exchange")], cfg.n_layer // cfg.moe_every


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("world, ep, stage", [(8, 2, 3), (64, 8, 2)])
def test_gpt_step_padded_reads_nothing(monkeypatch, method, world, ep, stage):
    log, reads, moe_layers = _gpt_step(monkeypatch, world, ep, stage, method, "padded")
    assert reads == []
    assert log.count("all_to_all_single") == 4 * moe_layers


@pytest.mark.parametrize("method", sorted(METHODS))
def test_gpt_step_grouped_under_expert_parallelism_reads_once_per_layer(monkeypatch, method):
    _, reads, moe_layers = _gpt_step(monkeypatch, 8, 8, 2, method, "grouped")
    assert reads == ["exchange"] * moe_layers


@pytest.mark.slow
@pytest.mark.parametrize("method", ["groups", "expert-choice", "sigmoid-bias"])
@pytest.mark.parametrize("compute", ["grouped", "packed"])
def test_gpt_step_per_rank_exchange_reads_once_per_layer(monkeypatch, method, compute):
    log, reads, moe_layers = _gpt_step(monkeypatch, 8, 8, 3, method, compute, exchange="per_rank")
    assert reads == ["pair exchange"] * moe_layers
    # forward: counts, rows, payload, rows back; backward: the three float exchanges reversed
    assert log.count("all_to_all_single") == 7 * moe_layers


@pytest.fixture
def cuda_branches(monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "triton")
    monkeypatch.delenv("MOE_SYNC_CHECKS", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("compute", ["padded", "grouped"])
def test_layer_makes_no_host_sync(cuda_branches, method, compute):
    torch.manual_seed(0)
    kwargs = dict(METHODS[method])
    kwargs.setdefault("capacity_factor", 1.25)
    layer = MoE(16, nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), num_experts=8, k=2,
                expert_layout=compute, min_capacity=0, **kwargs).to(DEVICE)
    x = torch.randn(3, 8, 16, device=DEVICE, requires_grad=True)  # CUDA on a GPU; else interpreted Triton on the CPU
    with count_syncs() as counter:
        out, l_aux, _ = layer(x)
        (out.square().sum() + l_aux).backward()
        layer.deepspeed_moe.gate.update_routing()
    assert counter.syncs == []
