"""A script in DeepSpeed's style (tests/recipes/deepspeed_style.py) runs with imports renamed only, in one
process and under torchrun with expert parallelism, and the names it uses answer as DeepSpeed's do."""

import json
import os
import subprocess
import sys

import pytest
import torch

CONFIG = {
    "train_batch_size": 32, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.01, "warmup_num_steps": 4}},
    "gradient_clipping": 1.0, "prescale_gradients": False,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True, "overlap_comm": True,
                          "contiguous_gradients": True, "cpu_offload": False},
}


STEPS = 16


def _run(tmp_path, world: int, ep: int) -> list[dict]:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(CONFIG))
    script = ["-m", "tests.recipes.deepspeed_style", "--deepspeed", "--deepspeed_config", str(config),
              "--ep-world-size", str(ep), "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample",
              "--steps", str(STEPS), "--out", str(tmp_path / "out")]
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node", str(world)]
    done = subprocess.run(launch + script, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    reports = [json.loads(path.read_text()) for path in (tmp_path / "out").glob("report_rank*.json")]
    assert "zero_optimization.cpu_offload -> zero_optimization.offload_optimizer" in done.stderr  # one warning, named
    return sorted(reports, key=lambda r: r["global_rank"])


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2)])
def test_a_deepspeed_style_script_runs_with_renamed_imports(tmp_path, world, ep):
    reports = _run(tmp_path, world, ep)
    assert [r["global_rank"] for r in reports] == list(range(world))
    micro = CONFIG["train_batch_size"] // (CONFIG["gradient_accumulation_steps"] * world)
    for r in reports:
        assert (r["local_rank"], r["world_size"], r["device"], r["backend"]) == (r["global_rank"], world, "cpu", "gloo")
        assert (r["bf16"], r["fp16"]) == (False, False)
        assert (r["train_batch_size"], r["micro"], r["accumulation"], r["batch"]) == (32, micro, 2, micro)
        assert r["boundaries"] == [False, True] * STEPS  # every second micro-batch ends the window
        assert r["module_is_net"] and r["optimizer_is"] and r["scheduler_is"]
        assert len(r["norms"]) == STEPS and all(isinstance(n, float) and n > 0 for n in r["norms"])
        assert r["lr"] == [pytest.approx(0.01)] * len(r["lr"])  # WarmupLR reached its top after 4 steps
    assert all(r["norms"] == reports[0]["norms"] for r in reports)  # one global norm, agreed by every rank
    losses = [sum(r["losses"][i] for r in reports) / world for i in range(2 * STEPS)]  # the global batch's
    assert sum(losses[-8:]) < sum(losses[:8]), losses
    saved = torch.load(tmp_path / "out" / "model.bin", weights_only=True)
    experts = [k for k in saved if k.startswith("moe.deepspeed_moe.experts.deepspeed_experts.")]
    assert sorted({k.split(".")[4] for k in experts}) == ["0", "1"]  # every expert, by global id, at any ep
    assert not (tmp_path / "out" / "model_rank1.bin").exists()  # rank 0 writes the one file


CLIENT_CONFIG = {
    "_comment": "a course's config: one MoE classifier, fp32 on the CPU", "train_batch_size": 16,
    "_precision_comment": "fp32: neither fp16 nor bf16", "gradient_clipping": 1.0, "steps_per_print": 100,
    "_zero_comment": "stage 2 shards gradients and optimizer states", "zero_optimization": {"stage": 2},
}


def _run_client_style(tmp_path, world: int) -> dict:
    config = tmp_path / f"ds_config_{world}.json"
    # one process runs the two ranks' micro-batches in turn: the same samples per optimizer step
    config.write_text(json.dumps({**CLIENT_CONFIG, "gradient_accumulation_steps": 2 // world}))
    out = tmp_path / f"out{world}"
    script = ["-m", "tests.recipes.deepspeed_client_style", "--deepspeed_config", str(config), "--ep-world-size",
              str(world), "--out", str(out)]
    launch = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                 "--nproc_per_node", str(world)]
    done = subprocess.run(launch + script, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    warned = [line for line in done.stderr.splitlines() if "neither DeepSpeed nor this engine reads" in line]
    assert len(warned) == world and warned[0].endswith(": _comment, _precision_comment, _zero_comment")
    return json.loads((out / "losses.json").read_text())


@pytest.mark.slow
def test_a_script_with_its_own_adamw_its_model_built_first_and_comment_keys_runs_unchanged(tmp_path):
    """The model is built before init_distributed (its MoE layer with ep_size 2 under torchrun), the
    script's AdamW is passed to initialize, the JSON has comment keys; one process and two ranks with
    expert parallelism print the same losses."""
    one, two = _run_client_style(tmp_path, 1), _run_client_style(tmp_path, 2)
    assert (one["world"], two["world"]) == (1, 2) and one["optimizer"] == two["optimizer"] == "AdamW"
    torch.testing.assert_close(two["losses"], one["losses"], rtol=1e-5, atol=0)
    assert sum(one["losses"][-3:]) < sum(one["losses"][:3])


def test_the_same_script_on_deepspeed_prints_the_same_losses(tmp_path):
    """Where DeepSpeed is installed (it is never a dependency): its run of the script, one process
    under torchrun (its init_distributed needs a launcher), prints our losses within a unit of the
    sixth decimal (float sums in another order may round the last printed digit the other way)."""
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps({**CLIENT_CONFIG, "gradient_accumulation_steps": 2}))
    printed = {}
    for framework in ("ours", "deepspeed"):
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", "-m",
             "tests.recipes.deepspeed_client_style", "--framework", framework, "--deepspeed_config", str(config)],
            capture_output=True, text=True, timeout=240, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        printed[framework] = [float(line.split()[-1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(printed["ours"]) == 12
    torch.testing.assert_close(printed["ours"], printed["deepspeed"], rtol=0, atol=1.5e-6)
