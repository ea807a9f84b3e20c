"""One training step of the recipes' own models in a simulated world of GPUs (see tests/simulated/world.py).

The GPT and CIFAR recipes' models, engine configs and `train_step` functions run on meta tensors
under the fake process group at world 8 (ep 1, 2, 8) and 64 (ep 8), ZeRO stages 0-3, fp32, bf16 and
fp16, and every expert layout. Each collective's tensors are checked to be on the model's device, a
host read fails (meta has no values), and the packed and grouped layouts under expert parallelism
make one host read per MoE layer and forward, answered by `recipes.common.simulated.HostReads`.
"""

import pytest
import torch

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from parallel.comm import ALL_GATHER_NAME, REDUCE_SCATTER_NAME
from recipes import cifar, gpt
from recipes.common.cli import engine_config
from recipes.gpt_model import GPT
from tests.simulated.world import META, simulated_world

LAYOUTS = {"padded": dict(expert_layout="padded"), "grouped": dict(expert_layout="grouped"),
           "packed": dict(expert_layout="packed"), "dropless": dict(dropless=True, expert_layout="auto")}


def _gpt_engine(cfg):
    with META:  # built on the device, as parameters moved from CPU to meta would be new objects, untagged
        model = GPT(gpt.model_config(cfg))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = initialize(model, model_parameters=groups, config=engine_config(gpt.engine_fragments(cfg), set(), ""))
    assert engine.device == META and all(p.device == META for p in model.parameters())
    return engine


def _gpt_step(monkeypatch, world, ep, stage, dtype, layout, rank):
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8,
                          top_k=2, ep_world_size=ep, stage=stage, dtype=dtype, steps=10, **LAYOUTS[layout])
    with simulated_world(monkeypatch, world, rank, rows_per_rank=cfg.batch_size * cfg.seq_len * cfg.top_k) as log:
        engine = _gpt_engine(cfg)
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1))  # a CPU batch, as the recipe makes it
        loss = gpt.train_step(engine, cfg, tokens[:, :-1], tokens[:, 1:])
        assert loss.device == META and engine.global_steps == 1
        assert log.reads.count("statistics") == 1  # the recipe turns TensorBoard on: one read per step
        moe_layers = cfg.n_layer // cfg.moe_every
        layout_reads = [r for r in log.reads.reads if r in ("counts", "exchange")]
        return log, layout_reads, log.reads.count("overflow flag"), moe_layers


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(8, 1), (8, 2), (8, 8), (64, 8)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_gpt_step_padded(monkeypatch, world, ep, stage, dtype):
    log, reads, overflow_reads, moe_layers = _gpt_step(monkeypatch, world, ep, stage, dtype, "padded", rank=world - 1)
    assert reads == []  # the padded layout reads nothing from the device
    assert overflow_reads == 1  # the step's one read: fp16's overflow flag, else the non-finite guard (nonfinite: stop)
    if ep > 1:  # dispatch and combine, forward and backward
        assert log.count("all_to_all_single") == 4 * moe_layers
    if stage == 3 and world > 1:  # the names the running torch has (all_gather_single on 2.13, ..._into_tensor on 2.11)
        assert log.count(ALL_GATHER_NAME) > 0 and log.count(REDUCE_SCATTER_NAME) > 0
    if stage == 2 and world > 1:  # gradients reduced to their shards' owners during the backward, on the device
        assert log.count("reduce") > 0 and log.count(REDUCE_SCATTER_NAME) == 0


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["grouped", "packed", "dropless"])
@pytest.mark.parametrize("world, ep", [(8, 1), (8, 2), (8, 8), (64, 8)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_gpt_step_every_layout(monkeypatch, layout, world, ep, stage, dtype):
    log, reads, _, moe_layers = _gpt_step(monkeypatch, world, ep, stage, dtype, layout, rank=1)
    if ep > 1:  # one read per MoE layer: the split sizes, after the counts are exchanged on the device
        assert reads == ["exchange"] * moe_layers
        assert log.count("all_to_all_single") == 5 * moe_layers  # the counts, then rows both ways, twice
    elif layout == "packed":
        assert reads == ["counts"] * moe_layers
    else:  # grouped without expert parallelism: device offsets, no read
        assert reads == []


def _cifar_step(monkeypatch, world, ep, stage, dtype, rank):
    cfg = cifar.CifarConfig(moe=True, ep_world_size=ep, num_experts=[8, 8], top_k=2, stage=stage, dtype=dtype,
                            batch_size=4, moe_param_group=True)
    with simulated_world(monkeypatch, world, rank) as log:
        with META:
            model = cifar.Net(cfg)
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"})
        engine, *_ = initialize(model, model_parameters=params,
                                config=engine_config(cifar.engine_fragments(cfg), set(), ""))
        images = cifar.normalise(torch.randint(256, (cfg.batch_size, 3, 32, 32), dtype=torch.uint8))
        loss = cifar.train_step(engine, cfg, images, torch.randint(10, (cfg.batch_size,)))
        assert loss.device == META and engine.global_steps == 1
        return log


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(8, 1), (8, 2), (8, 8), (64, 8)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_cifar_step(monkeypatch, world, ep, stage, dtype):
    log = _cifar_step(monkeypatch, world, ep, stage, dtype, rank=world // 2)
    if ep > 1:
        assert log.count("all_to_all_single") == 4 * 2  # two MoE layers


def test_a_cpu_tensor_handed_to_a_collective_is_caught(monkeypatch):
    import torch.distributed as dist

    with simulated_world(monkeypatch, 8, 0):
        with pytest.raises(AssertionError, match="NCCL refuses it"):
            dist.all_reduce(torch.zeros(2))


def test_a_cpu_batch_meeting_the_model_fails_without_the_engine(monkeypatch):
    """What the engine and train_step prevent: a CPU batch fed straight to a model on the device."""
    cfg = cifar.CifarConfig(moe=True, num_experts=[4], batch_size=2)
    with simulated_world(monkeypatch, 8, 0):
        with META:
            model = cifar.Net(cfg)
        with pytest.raises((RuntimeError, NotImplementedError)):
            model(torch.zeros(2, 3, 32, 32))


@pytest.mark.parametrize("world, ep, stage", [(8, 2, 3), (64, 8, 2)])
def test_recipe_evaluation_runs_on_the_device(monkeypatch, world, ep, stage):
    """The GPT recipe's evaluate and the CIFAR recipe's test: batches moved, sums kept on the device, one read."""
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8,
                          ep_world_size=ep, stage=stage, eval_batches=world * 2)
    with simulated_world(monkeypatch, world, 1) as log:
        with META:
            model = GPT(gpt.model_config(cfg))
        engine, *_ = initialize(model, config=engine_config(gpt.engine_fragments(cfg), set(), ""))
        val = torch.randint(256, (4096,))
        assert gpt.evaluate(engine, val, cfg, 1, world) == 1.0  # the simulated read answers ones
        assert log.reads.count("sums") == 1
    cifar_cfg = cifar.CifarConfig(moe=True, ep_world_size=ep, num_experts=[8], stage=stage, batch_size=4)
    with simulated_world(monkeypatch, world, 1) as log:
        with META:
            model = cifar.Net(cifar_cfg)
        engine, *_ = initialize(model, config=engine_config(cifar.engine_fragments(cifar_cfg), set(), ""))
        images, labels = torch.randint(256, (40, 3, 32, 32), dtype=torch.uint8), torch.randint(10, (40,))
        loss, accuracy, per_class = cifar.test(engine, images, labels, cifar_cfg, 1, world)
        assert log.reads.count("sums") == 1 and len(per_class) == 10


@pytest.mark.parametrize("world, ep, rank", [(8, 2, 5), (64, 8, 63)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpoint_pieces_stay_on_the_device_and_tile_each_shard(monkeypatch, world, ep, rank, stage):
    """What a rank would hand DCP to write, after a step: every piece a view on the model's device, inside
    its entry, and together exactly this rank's shard of the masters and optimizer states (stage 0: the
    first rank of each group writes everything it holds)."""
    from optim import checkpoint
    from optim.zero import Unit

    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8,
                          top_k=2, ep_world_size=ep, stage=stage, steps=10)
    with simulated_world(monkeypatch, world, rank, rows_per_rank=cfg.batch_size * cfg.seq_len * cfg.top_k):
        engine = _gpt_engine(cfg)
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1))
        gpt.train_step(engine, cfg, tokens[:, :-1], tokens[:, 1:])
        assert engine.units and all(isinstance(unit, Unit) for unit in engine.units)  # every member of the protocol
        boxes = checkpoint._boxes_to_write(engine)
        written = {"model": 0, "optim": 0}
        for key, (size, views) in boxes.items():
            for offsets, view in views.items():
                assert view.device == META, key
                assert all(0 <= o and o + n <= s for o, n, s in zip(offsets, view.shape, size)), (key, offsets, size)
                if key.startswith(("model/", "optim/")):
                    written[key.split("/")[0]] += view.numel()
        held = sum(unit.weights.numel() - _padding(unit) for unit in engine.units if unit.counts_once())
        assert written["model"] == held
        assert written["optim"] == held * 2 + sum(  # AdamW's exp_avg and exp_avg_sq, and
            len(i.keys()) for u in engine.units if checkpoint._owner(engine, u) for i in u.infos)  # its step counters


def _padding(unit) -> int:
    """Elements of a flat ZeRO shard past the group's last parameter."""
    if not hasattr(unit, "total"):
        return 0
    return max(0, unit.lo + unit.shard - max(unit.total, unit.lo))


def test_the_engine_answers_deepspeeds_queries_on_the_device(monkeypatch):
    """The queries DeepSpeed scripts make, at world 8 on the simulated GPU world (rank 3, bf16, ep 2)."""
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8,
                          top_k=2, ep_world_size=2, stage=2, dtype="bf16", gradient_accumulation_steps=2, steps=10)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with simulated_world(monkeypatch, 8, 3, rows_per_rank=cfg.batch_size * cfg.seq_len * cfg.top_k):
        engine = _gpt_engine(cfg)
        assert (engine.local_rank, engine.global_rank, engine.world_size) == (3, 3, 8)
        assert engine.bfloat16_enabled() is True and engine.fp16_enabled() is False
        assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()) == (2, 2)
        assert engine.train_batch_size() == 2 * 2 * 8
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1))
        boundaries = []
        for _ in range(2):
            boundaries.append(engine.is_gradient_accumulation_boundary())
            gpt.train_step(engine, cfg, tokens[:, :-1], tokens[:, 1:])
        assert boundaries == [False, True] and (engine.global_steps, engine.micro_steps) == (1, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_client_optimizer_steps_on_the_device(monkeypatch, stage):
    """A script's own AdamW over the MoE param groups (built on the device), taken by the engine at world 8, ep 2."""
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8,
                          top_k=2, ep_world_size=2, stage=stage, dtype="bf16", steps=10)
    with simulated_world(monkeypatch, 8, 3, rows_per_rank=cfg.batch_size * cfg.seq_len * cfg.top_k):
        with META:
            model = GPT(gpt.model_config(cfg))
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
        client = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
        config = engine_config(gpt.engine_fragments(cfg), set(), "")
        del config["optimizer"]
        engine, optimizer, _, _ = initialize(model, optimizer=client, config=config)
        assert optimizer.optimizer is client and all(p.device == META for g in client.param_groups for p in g["params"])
        assert {g["betas"] for g in client.param_groups} == {(0.9, 0.95)} and any(g["moe"] for g in client.param_groups)
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1))
        gpt.train_step(engine, cfg, tokens[:, :-1], tokens[:, 1:])
        assert engine.global_steps == 1 and all(client.state[p] for g in client.param_groups for p in g["params"])
