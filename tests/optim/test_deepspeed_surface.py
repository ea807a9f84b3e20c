"""DeepSpeed scripts with the imports renamed: command-line config flags, `initialize(args=...)`, the
engine's DeepSpeed methods; in one process except one test on 2 gloo processes.

DeepSpeed 0.19.8's `add_config_arguments` (read in its source) adds --deepspeed, --deepspeed_config,
--deepscale, --deepscale_config and no --deepspeed_mpi; its `initialize` takes `config`, then
`config_params`, then `args.deepspeed_config` (`args.deepscale_config` with a deprecation warning),
and refuses a config given both ways. Its engine's `get_global_grad_norm()` is the step's norm before
clipping; `save_16bit_model` writes the module's state dict and returns True. `GatheredParameters`
has its tests in test_gathered.py.
"""

import argparse
import json

import pytest
import torch

from optim import add_config_arguments, initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, engine_steps, loss_of

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _args(*argv):
    return add_config_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_add_config_arguments_adds_deepspeeds_flags():
    parser = argparse.ArgumentParser()
    assert add_config_arguments(parser) is parser
    args = parser.parse_args([])
    assert vars(args) == {"deepspeed": False, "deepspeed_config": None, "deepscale": False, "deepscale_config": None}
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed is True and args.deepspeed_config == "ds.json"
    with pytest.raises(SystemExit):
        parser.parse_args(["--deepspeed_mpi"])


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**CONFIG, "train_batch_size": 8}))
    return str(path)


def test_initialize_reads_the_config_from_args(config_file):
    model = Net()
    engine, optimizer, _, _ = initialize(args=_args("--deepspeed", "--deepspeed_config", config_file), model=model,
                                         model_parameters=model.parameters())
    assert engine.train_batch_size() == 8 and isinstance(optimizer, torch.optim.Optimizer)


def test_initialize_reads_deprecated_deepscale_config_with_a_warning(config_file):
    with pytest.warns(DeprecationWarning, match="--deepscale_config is deprecated; use --deepspeed_config"):
        engine, *_ = initialize(args=_args("--deepscale_config", config_file), model=Net())
    assert engine.train_batch_size() == 8


def test_config_keyword_and_config_params_come_before_an_args_without_config():
    engine, *_ = initialize(args=_args(), model=Net(), config_params=CONFIG)
    assert engine.train_batch_size() == 4
    engine, *_ = initialize(args=argparse.Namespace(), model=Net(), config=CONFIG, config_params={"train_batch_size": 2})
    assert engine.train_batch_size() == 4


def test_a_config_given_two_ways_is_refused(config_file):
    with pytest.raises(ValueError, match=r"initialize got config and args.deepspeed_config \('.*ds.json'\); pass one"):
        initialize(args=_args("--deepspeed_config", config_file), model=Net(), config=CONFIG)
    with pytest.raises(ValueError, match=r"args.deepscale_config \('.*'\) and args.deepspeed_config \('.*'\) are both set"):
        initialize(args=_args("--deepspeed_config", config_file, "--deepscale_config", config_file), model=Net())


def test_no_config_names_the_three_ways_to_pass_one():
    message = r"initialize needs a config: pass config= .*, config_params=, or args= with --deepspeed_config PATH"
    with pytest.raises(ValueError, match=message):
        initialize(model=Net())
    with pytest.raises(ValueError, match=message):
        initialize(args=_args("--deepspeed"), model=Net())


# ---- the engine's DeepSpeed queries

ACCUMULATION, CLIP = 2, 0.05


def test_engine_queries_follow_the_config(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    engine, *_ = initialize(model=Net(), config={**config(2, ACCUMULATION, CLIP), "bf16": {"enabled": True}})
    assert engine.train_batch_size() == 12 and engine.train_micro_batch_size_per_gpu() == 6
    assert engine.gradient_accumulation_steps() == ACCUMULATION
    assert engine.bfloat16_enabled() is True and engine.fp16_enabled() is False
    assert engine.zero_optimization_stage() == config(2, ACCUMULATION, CLIP)["zero_optimization"]["stage"]
    assert engine.local_rank == 0 and engine.global_rank == 0 and engine.world_size == 1
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert engine.local_rank == 5
    engine, *_ = initialize(model=Net(), config={**config(0, 1, CLIP), "fp16": {"enabled": True}})
    assert engine.fp16_enabled() is True and engine.bfloat16_enabled() is False
    assert engine.train_batch_size() == 6 and engine.gradient_accumulation_steps() == 1
    assert engine.zero_optimization_stage() == 0


def _reference_norms(world, steps):
    """The gradient norm before clipping at each step of plain torch AdamW, clipped, on the same micro-batches."""
    model = Net(ep_size=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    norms = []
    for step in range(steps):
        for micro in range(ACCUMULATION):
            for rank in range(world):
                x, y = batch(step, micro, rank)
                (loss_of(model(x), y) / (world * ACCUMULATION)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    return norms


def _engine_norms(rank, stage, ep_size, steps):
    reset_groups()
    engine, *_ = initialize(model=Net(ep_size=ep_size), config=config(stage, ACCUMULATION, CLIP))
    norms = [engine.get_global_grad_norm()]
    for step in range(steps):
        engine_steps(engine, 1, rank, ACCUMULATION, first_step=step)
        norms.append(engine.get_global_grad_norm())
    return norms


@pytest.mark.parametrize("stage", [0, 3])
def test_global_grad_norm_is_the_norm_before_clipping(stage):
    norms = _engine_norms(0, stage, 1, 2)
    assert norms[0] is None
    assert all(type(norm) is float for norm in norms[1:])
    torch.testing.assert_close(norms[1:], _reference_norms(1, 2), rtol=1e-5, atol=0)


def test_global_grad_norm_is_none_without_clipping():
    engine, *_ = initialize(model=Net(), config=config(0, 1, 0))
    engine_steps(engine, 1, 0, 1)
    assert engine.global_steps == 1 and engine.get_global_grad_norm() is None


def _check_norm_two_ranks(rank, world):
    norms = _engine_norms(rank, 2, 2, 2)  # every rank holds half the experts and its own micro-batches
    torch.testing.assert_close(norms[1:], _reference_norms(world, 2), rtol=1e-5, atol=0)


@pytest.mark.slow
def test_global_grad_norm_over_two_ranks_with_expert_parallelism():
    run_distributed(_check_norm_two_ranks, 2, timeout_s=200)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, {}), (torch.bfloat16, {"bf16": {"enabled": True}})])
def test_save_16bit_model_writes_the_full_model_in_the_compute_dtype(tmp_path, dtype, precision):
    model = Net(ep_size=1)
    engine, *_ = initialize(model=model, config={**config(0, 1, CLIP), **precision})
    engine_steps(engine, 1, 0, 1)
    assert engine.save_16bit_model(str(tmp_path / "out")) is True
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pytorch_model.bin"]  # no temporary left
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    expected = engine.consolidated_state_dict()
    assert saved.keys() == expected.keys() == Net(ep_size=1).state_dict().keys()
    for name, value in saved.items():
        assert value.dtype == (dtype if expected[name].is_floating_point() else expected[name].dtype), name
        torch.testing.assert_close(value, expected[name].to(value.dtype), rtol=0, atol=0)
    assert engine.save_16bit_model(str(tmp_path / "out"), "model.pt") is True
    assert (tmp_path / "out" / "model.pt").is_file()


# ---- checkpoints with DeepSpeed's arguments, ZeRO-3's GatheredParameters, empty_partition_cache


def test_load_module_only_reads_the_weights_and_keeps_the_rest(tmp_path):
    saved, *_ = initialize(model=Net(), config=config(2, ACCUMULATION, CLIP))
    engine_steps(saved, 3, 0, ACCUMULATION)
    saved.save_checkpoint(str(tmp_path), tag="warm", client_state={"epoch": 4}, save_latest=False)
    assert not (tmp_path / "latest").exists()  # save_latest=False leaves no latest file
    engine, *_ = initialize(model=Net(), config=config(2, ACCUMULATION, CLIP))
    engine_steps(engine, 1, 0, ACCUMULATION, first_step=7)
    lr, state = engine.get_lr(), {id(u.proxy): dict(engine.optimizer.state[u.proxy]) for u in engine.units}
    path, client = engine.load_checkpoint(str(tmp_path), tag="warm", load_module_only=True)
    assert path.endswith("warm") and client == {"epoch": 4}
    expected = saved.consolidated_state_dict()
    for name, value in engine.consolidated_state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert engine.global_steps == 1 and engine.get_lr() == lr  # the counters and schedule stay
    for unit in engine.units:  # the optimizer's states stay this engine's
        assert torch.equal(engine.optimizer.state[unit.proxy]["exp_avg"], state[id(unit.proxy)]["exp_avg"])
    with pytest.raises(ValueError, match=r"load_module_strict must be True, got False"):
        engine.load_checkpoint(str(tmp_path), tag="warm", load_module_strict=False)
