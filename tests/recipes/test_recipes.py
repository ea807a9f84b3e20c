"""The GPT and CIFAR recipes at tiny sizes: the loss falls, TensorBoard gets every statistic, resume continues."""

import dataclasses
import math
import os
import pathlib
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from kernels.cpu import gemm
from moe import TopKGate
from recipes import cifar, compare_dense_moe, gpt
from recipes.common import runner
from recipes.common.cli import engine_config, saved_recipe
from recipes.gpt_model import GPT

CIFAR_JSON = pathlib.Path(cifar.__file__).parent / "configs" / "cifar.json"
GPT_TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--ffn", "64", "--seq-len", "32", "--batch-size", "8",
            "--num-experts", "4", "--top-k", "2", "--eval-batches", "2", "--lr", "3e-3", "--warmup-steps", "5"]
CIFAR_TINY = ["--moe", "--num-experts", "4", "--top-k", "2", "--train-size", "384", "--test-size", "100",
              "--batch-size", "16", "--log-interval", "8"]
RTOL = 1e-5  # fp32
TRAIN_SCALARS = {"Train/loss", "Train/lr", "Train/loss_scale", "Train/step_time_ms", "Train/samples_per_s",
                 "MoE/l_aux", "MoE/z_loss", "MoE/dropped_fraction", "Val/loss"}


def _events(folder):
    board = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "histograms": 0})
    board.Reload()
    return board


def _same_curve(resumed: list[tuple[int, float]], straight: list[tuple[int, float]]) -> None:
    """Same steps, losses within fp32 tolerance (products may round differently in a fresh process)."""
    assert [step for step, _ in resumed] == [step for step, _ in straight]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight], rel=RTOL)


def _logged_losses(text: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in re.findall(r"step (\d+)/\d+ .*?loss ([0-9.]+)", text)}


@pytest.mark.slow
def test_gpt_trains_logs_every_statistic_and_resumes_exactly(tmp_path, capsys):
    args = GPT_TINY + ["--steps", "40", "--eval-interval", "20", "--log-interval", "10", "--log-dir", str(tmp_path),
                       "--run-name", "run", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "20"]
    straight = gpt.main(args)
    train = [loss for _, loss in straight["history"]["train"]]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5 - 0.5
    val = [loss for _, loss in straight["history"]["val"]]
    assert val[1] < val[0] < 5.6  # below the loss of a uniform guess over 256 bytes (5.55) and falling

    board = _events(tmp_path / "run")
    scalars = set(board.Tags()["scalars"])
    assert TRAIN_SCALARS | {"Train/tokens_per_s", "MoE/blocks.1.ffn/l_aux"} <= scalars, scalars
    assert board.Tags()["histograms"] == ["MoE/blocks.1.ffn/expert_load"]
    assert board.Tags()["images"] == ["MoE/expert_load"]
    assert [e.step for e in board.Scalars("Train/loss")] == list(range(1, 41))
    dropped = [e.value for e in board.Scalars("MoE/dropped_fraction")]
    assert all(0 <= d < 1 for d in dropped)

    (tmp_path / "ckpt" / "latest").write_text("global_step20")  # as if the run had died after step 20's checkpoint
    capsys.readouterr()
    resumed = gpt.main(["--resume", "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert f"resumed from {tmp_path / 'ckpt' / 'global_step20'} at step 20\n" in capsys.readouterr().out
    assert [s for s, _ in resumed["history"]["train"]] == list(range(21, 41))
    gpt.main(["--resume", "--checkpoint-dir", str(tmp_path / "ckpt")])  # the run is complete: it says so
    assert "at step 40; --steps 40 are done: nothing to train" in capsys.readouterr().out
    _same_curve(resumed["history"]["train"], straight["history"]["train"][20:])
    _same_curve(resumed["history"]["val"], straight["history"]["val"][1:])

    capsys.readouterr()
    sample = ["sample", "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "The ", "--new-tokens", "20"]
    sampled = gpt.main(sample)
    assert capsys.readouterr().out == sampled["text"] + "\n" and sampled["text"].startswith("The ")
    assert gpt.main(sample)["text"] == sampled["text"]  # --seed 0 both times
    short = gpt.main(sample[:3] + ["--prompt", "T", "--new-tokens", "5"])["text"]  # fewer tokens than min_capacity
    assert short.startswith("T") and len(short) > 1


def _parsed(argv: list[str]) -> dict:
    return vars(gpt.flag_parser(gpt.TrainConfig, "").parse_args(argv))


def _numbers(pattern: str, text: str) -> list[float]:
    return [float(x.replace(",", "")) for x in re.findall(pattern, text, re.MULTILINE)]


@pytest.mark.slow
def test_cifar_trains_logs_and_resumes_exactly(tmp_path, capsys):
    args = CIFAR_TINY + ["--log-dir", str(tmp_path), "--run-name", "run", "--checkpoint-dir", str(tmp_path / "ckpt")]
    straight = cifar.main(args + ["--epochs", "2"])
    first, second = straight["history"]
    # epoch 1's speed: its 384 images over the time of its steps, which the progress reports at steps 8, 16
    # and 24 (128 images each) measured; the epoch line prints the returned figure
    step_rates = [e.value for e in _events(tmp_path / "run").Scalars("Train/images_per_s") if e.step <= 24]
    assert len(step_rates) == 3 and straight["data"] == "synthetic"
    assert first["images_per_s"] == pytest.approx(384 / sum(128 / r for r in step_rates), rel=0.1)
    printed = _numbers(r"epoch \d: .* ([0-9,]+) img/s", capsys.readouterr().out)
    assert printed == [round(e["images_per_s"]) for e in (first, second)]
    assert second["train_loss"] < first["train_loss"] and len(second["per_class"]) == 10
    assert 0 <= second["accuracy"] <= 1
    scalars = set(_events(tmp_path / "run").Tags()["scalars"])
    assert TRAIN_SCALARS | {"Val/accuracy", "Val/accuracy_cat", "Train/images_per_s", "Train/tokens_per_s"} <= scalars

    (tmp_path / "ckpt" / "latest").write_text("global_step24")  # the end of epoch 1
    capsys.readouterr()
    resumed = cifar.main(["--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--epochs", "2"])
    assert f"resumed from {tmp_path / 'ckpt' / 'global_step24'} after epoch 1\n" in capsys.readouterr().out
    assert resumed["global_steps"] == 48 and len(resumed["history"]) == 1
    again = resumed["history"][0]
    assert (again["epoch"], again["step"]) == (2, 48)
    for key in ("train_loss", "test_loss", "accuracy", "per_class"):
        assert again[key] == pytest.approx(second[key], rel=RTOL), key


@pytest.mark.slow
def test_cifar_without_its_files_says_what_to_pass_and_trains_on_the_synthetic_set(tmp_path, capsys):
    _write_cifar_batches(tmp_path)
    (tmp_path / "data_batch_3").unlink()
    tiny = ["--train-size", "32", "--test-size", "16", "--epochs", "1", "--log-dir", str(tmp_path / "runs")]
    for data_dir in ("", str(tmp_path)):
        result = cifar.main(tiny + (["--data-dir", data_dir] if data_dir else []))
        assert result["data"] == "synthetic" and result["global_steps"] == 2  # 32 of the synthetic set's images
        said = [line for line in capsys.readouterr().out.splitlines() if "SYNTHETIC" in line]
        assert len(said) == 1, said
        flags = {"--" + field.name.replace("_", "-") for field in dataclasses.fields(cifar.CifarConfig)}
        assert set(re.findall(r"--[a-z][a-z-]*", said[0])) == {"--data-dir"} <= flags
        if data_dir:  # the folder and what it lacks
            assert re.search(rf"in --data-dir {re.escape(data_dir)} \(missing: data_batch_3\)", said[0]), said[0]
        else:
            assert said[0].startswith("no --data-dir given: ") and "cifar-10-batches-py" in said[0], said[0]


def _write_cifar_batches(folder, images_per_batch=20):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (images_per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, images_per_batch).tolist(), b"batch_label": name.encode()}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)


def test_cifar_reads_the_python_batches_and_refuses_other_pickles(tmp_path, capsys):
    _write_cifar_batches(tmp_path)
    train_x, _, _, test_y = cifar.load_cifar(str(tmp_path))
    assert train_x.shape == (100, 3, 32, 32) and train_x.dtype == torch.uint8 and test_y.shape == (20,)
    result = cifar.main(["--moe", "--num-experts", "2", "--data-dir", str(tmp_path), "--epochs", "1",
                         "--log-dir", str(tmp_path / "runs")])
    assert "SYNTHETIC" not in capsys.readouterr().out and result["global_steps"] == 6

    with open(tmp_path / "test_batch", "wb") as handle:
        pickle.dump({b"data": os.getcwd, b"labels": []}, handle, protocol=2)  # a pickle that names a function
    with pytest.raises(SystemExit):
        cifar.main(["--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "test_batch is not a CIFAR-10 python batch" in err and "posix.getcwd" in err


def _torchrun(module: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", module, *args]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_gpt_under_torchrun_with_expert_parallelism_resumes(tmp_path, capsys):
    args = GPT_TINY + ["--ep-world-size", "2", "--stage", "3", "--steps", "30", "--eval-interval", "15",
                       "--log-interval", "5", "--log-dir", str(tmp_path), "--run-name", "run",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "15"]
    out = _torchrun("recipes.gpt", *args).stdout
    total, active = GPT(gpt.model_config(gpt.TrainConfig(**vars(gpt.flag_parser(gpt.TrainConfig, "").parse_args(
        GPT_TINY))))).parameter_counts()
    assert f"{total:,} parameters, {active:,} active per token; 2 process(es), ep 2, ZeRO stage 3" in out, out
    straight = _logged_losses(out)
    assert set(straight) == {5, 10, 15, 20, 25, 30} and straight[30] < straight[5] - 0.3
    board = _events(tmp_path / "run")
    assert TRAIN_SCALARS <= set(board.Tags()["scalars"])
    assert board.Tags()["images"] == ["MoE/expert_load"]

    (tmp_path / "ckpt" / "latest").write_text("global_step15")
    resumed = _logged_losses(_torchrun("recipes.gpt", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt")).stdout)
    expected = {s: loss for s, loss in straight.items() if s > 15}
    assert resumed.keys() == expected.keys() and list(resumed.values()) == pytest.approx(list(expected.values()),
                                                                                       abs=1e-4)  # 4 printed digits

    # in one process, without --ep-world-size: the checkpoint's ep 2 does not fit, so the run goes on at ep 1
    (tmp_path / "ckpt" / "latest").write_text("global_step15")
    capsys.readouterr()
    alone = gpt.main(["--resume", "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-dir", str(tmp_path / "alone")])
    out = capsys.readouterr().out
    assert "resuming at --ep-world-size 1: the checkpoint's run used 2, which does not divide 1 process(es)" in out
    assert "1 process(es), ep 1, ZeRO stage 3" in out and "at step 15" in out, out
    assert [s for s, _ in alone["history"]["train"]] == list(range(16, 31))


@pytest.mark.slow
def test_cifar_under_torchrun_with_expert_parallelism(tmp_path):
    args = CIFAR_TINY + ["--num-experts", "2", "4", "--ep-world-size", "2", "--stage", "1", "--epochs", "2",
                         "--config", str(CIFAR_JSON),
                         "--log-dir", str(tmp_path), "--run-name", "run"]
    out = _torchrun("recipes.cifar", *args).stdout
    losses = _numbers(r"^epoch \d: train loss ([0-9.]+)", out)
    assert len(losses) == 2 and losses[1] < losses[0], out
    accuracy = _numbers(r"^epoch \d: .* test accuracy ([0-9.]+)%", out)
    assert len(accuracy) == 2 and all(0 <= a <= 100 for a in accuracy), out
    assert len([line for line in out.splitlines() if "SYNTHETIC" in line]) == 1  # said once, by rank 0
    assert TRAIN_SCALARS <= set(_events(tmp_path / "run").Tags()["scalars"])


@pytest.mark.parametrize("recipe, argv, message", [
    (gpt, ["--top-k", "3", "--num-experts", "2"], r"--top-k \(3\) must be between 1 and --num-experts \(2\)"),
    (gpt, ["--ep-world-size", "2"], r"--ep-world-size \(2\) must divide the number of processes \(1\)"),
    (gpt, ["--stage", "5"], r"argument --stage: invalid choice: 5"),
    (gpt, ["--n-embd", "30", "--n-head", "4"], r"--n-embd \(30\) must be divisible by --n-head \(4\)"),
    (gpt, ["--ep-world-size", "0"], r"--ep-world-size must be at least 1, got 0"),
    (gpt, ["--num-experts", "0"], r"--num-experts must be at least 1, got 0"),
    (gpt, ["--moe-every", "0"], r"--moe-every \(0\) must be between 1 and --n-layer \(4\)"),
    (gpt, ["--n-layer", "0"], r"--n-layer must be at least 1, got 0"),
    (gpt, ["--moe-every", "5"], r"--moe-every \(5\) must be between 1 and --n-layer \(4\)"),
    (gpt, ["--data", "/nonexistent"], r"--data /nonexistent does not exist"),
    (gpt, ["--topk", "2"], r"unrecognized arguments: --topk 2"),  # no prefix of --topk-group
    (gpt, ["--steps", "1", "--capacity-factor", "-1"], r"^recipes.gpt: error: --capacity-factor must be a number > 0"),
    (gpt, ["--steps", "1", "--n-group", "3", "--topk-group", "1"], r"--n-group \(3\) must divide --num-experts \(8\)"),
    (cifar, ["--moe", "--ep-world-size", "0"], r"--ep-world-size must be at least 1, got 0"),
    (cifar, ["--moe", "--epochs", "1", "--capacity-factor", "-1"], r"^recipes.cifar: error: --capacity-factor must be"),
    (gpt, ["--resume"], r"--resume needs --checkpoint-dir"),
    (cifar, ["--resume", "--checkpoint-dir", "/nonexistent"],
     r"--resume: --checkpoint-dir /nonexistent holds no checkpoint \(no file 'latest'\); leave out --resume .*--resume auto"),
    (gpt, ["--config", "/nonexistent.json"], r"--config /nonexistent.json does not exist"),
    (cifar, ["--moe", "--num-experts", "2", "--top-k", "3"], r"--top-k \(3\) must be between 1 and --num-experts \(2\)"),
    (cifar, ["--moe", "--ep-world-size", "2"], r"--ep-world-size \(2\) must divide the number of processes \(1\)"),
    (cifar, ["--dtype", "fp8"], r"argument --dtype: invalid choice: 'fp8'"),
    (gpt, ["--checkpoint-interval", "-1"], r"--checkpoint-interval must be 0 or more, got -1"),
    (gpt, ["--warmup-steps", "-5"], r"--warmup-steps must be 0 or more, got -5"),
    (gpt, ["--lr", "inf"], r"--lr must be a positive finite number, got inf"),
    (gpt, ["--resume", "sometimes"], r"argument --resume: invalid choice: 'sometimes'"),
    (gpt, ["--dropout", "1.5"], r"--dropout must be at least 0 and below 1, got 1.5"),
    (gpt, ["--n-group", "3"], r"needs both --n-group and --topk-group \(0: off\), got --n-group 3 and --topk-group 0"),
    (gpt, ["--gradient-accumulation-steps", "0"], r"--gradient-accumulation-steps must be at least 1, got 0"),
    (gpt, ["--batch-size", "1", "--seq-len", "2"],
     r"--batch-size x --seq-len \(1 x 2 = 2 tokens a micro-batch\) must be at least --min-capacity \(4\)"),
    (cifar, ["--moe", "--num-experts", "4", "--batch-size", "8", "--min-capacity", "100"],
     r"--batch-size \(8\) must be at least --min-capacity \(100\)"),
])
def test_a_wrong_flag_stops_with_one_line(recipe, argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        recipe.main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert "tag=" not in err, err  # the engine's Python argument is no flag of the recipes


@pytest.mark.parametrize("flag, policy", [("None", None), ("Jitter", "Jitter"), ("RSample", "RSample")])
def test_the_noisy_gate_policy_flag_reaches_every_gate(flag, policy):
    """The flag's "None" is the gate's None (the gate itself refuses the string)."""
    gpt_cfg, _ = runner.checked_config(gpt.RECIPE, runner.parser_for(gpt.RECIPE),
                                       GPT_TINY + ["--noisy-gate-policy", flag], world=1)
    cifar_cfg, _ = runner.checked_config(cifar.RECIPE, runner.parser_for(cifar.RECIPE),
                                         ["--moe", "--num-experts", "2", "2", "--noisy-gate-policy", flag], world=1)
    for model, layers in ((GPT(gpt.model_config(gpt_cfg)), 1), (cifar.Net(cifar_cfg), 2)):
        gates = [m for m in model.modules() if isinstance(m, TopKGate)]
        assert len(gates) == layers and all(g.config.noisy_gate_policy == policy for g in gates)


@pytest.mark.slow
def test_a_bad_engine_config_file_stops_with_one_line(tmp_path):
    config = tmp_path / "engine.json"
    config.write_text('{"zero_optimization": {"stage": 7}}')
    done = subprocess.run([sys.executable, "-m", "recipes.cifar", "--config", str(config), "--train-size", "32"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "recipes.cifar: error: zero_optimization.stage must be 0, 1, 2 or 3, got 7"], done.stderr


def test_the_comparison_writes_its_table(tmp_path):
    out = tmp_path / "table.md"
    rows = compare_dense_moe.main(["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--n-layer", "2",
                                   "--n-embd", "16", "--ffn", "32", "--eval-interval", "6", "--eval-batches", "1",
                                   "--log-dir", str(tmp_path), "--out", str(out)])
    dense, moe = rows
    assert dense["total"] == dense["active"] < moe["total"]
    assert moe["active"] - dense["active"] == 16 * 8 + 16  # the router, and a second output bias per token
    table = [line.strip("|").split(" | ") for line in out.read_text().splitlines() if line.startswith("| ")][2:]
    assert [cells[0].strip() for cells in table] == ["dense", "MoE 8 experts, top-2"]
    for cells, row in zip(table, rows):
        total, active, tokens, val_loss, tokens_per_s = (float(c.replace(",", "")) for c in cells[1:])
        assert (total, active, tokens) == (row["total"], row["active"], 6 * 4 * 16)
        assert val_loss == pytest.approx(row["val_loss"], abs=5e-5) and 0 < val_loss < 6
        assert tokens_per_s == pytest.approx(row["tokens_per_s"], abs=0.51)


@pytest.mark.slow
def test_gpt_compile_flag_compiles_the_model_in_place(tmp_path, monkeypatch):
    # the eager backend: dynamo traces the model (graph breaks, guards) without Inductor's C++ build,
    # which would take minutes here; tests/moe/test_compile.py covers Inductor itself
    compiled = []
    original = torch.nn.Module.compile

    def compile_eager(self, *args, **kwargs):
        compiled.append(type(self).__name__)
        original(self, backend="eager")

    monkeypatch.setattr(torch.nn.Module, "compile", compile_eager)
    args = GPT_TINY + ["--steps", "3", "--eval-interval", "3", "--log-interval", "1", "--log-dir", str(tmp_path)]
    plain = gpt.main(args)
    result = gpt.main(args + ["--compile"])
    assert compiled == ["GPT"]
    _same_curve(result["history"]["train"], plain["history"]["train"])


def test_two_identical_gpt_runs_in_one_process_are_bitwise_equal(tmp_path, monkeypatch):
    """The first run measures the CPU products' backends, the second reuses them: same bits."""
    monkeypatch.setattr(gemm, "MEASURE_FROM", 0)  # the tiny model's products are measured all the same
    gemm.clear()
    args = GPT_TINY + ["--steps", "6", "--eval-interval", "6", "--log-interval", "3", "--log-dir", str(tmp_path)]
    try:
        first, second = gpt.main(args), gpt.main(args)
        assert gemm.choices() or not gemm.measuring(torch.float32), "the CPU products were chosen by measurement"
    finally:
        gemm.clear()  # the choices of products too small to measure stay out of later tests
    assert first["history"]["train"] == second["history"]["train"]
    assert first["history"]["val"] == second["history"]["val"]


def test_a_diverging_run_stops_with_one_line_and_saves_no_nonfinite_weights(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt"
    args = GPT_TINY + ["--dense", "--lr", "1e6", "--warmup-steps", "0", "--steps", "40", "--eval-interval", "40",
                       "--checkpoint-dir", str(folder), "--checkpoint-interval", "1", "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as stopped:
        gpt.main(args)
    assert stopped.value.code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("recipes.gpt: stopped: step ") and "inf or nan on rank(s) [0]" in line, line
    assert "last checkpoint: " + str(folder) in line
    saved = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert saved, "the run saved checkpoints before it diverged"
    for path in saved:
        reader = dcp.FileSystemReader(str(path))
        entries = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
                   for k, v in reader.read_metadata().state_dict_metadata.items() if k.startswith("model/")}
        dcp.load(entries, storage_reader=reader, no_dist=True)
        assert all(torch.isfinite(t).all() for t in entries.values()), f"{path.name} holds non-finite weights"


def _gpt_exit(args, capsys):
    with pytest.raises(SystemExit) as stopped:
        gpt.main(args)
    return stopped.value.code, capsys.readouterr().err.strip()


def test_checkpoint_folder_guards(tmp_path, capsys):
    """`latest` never moves back, one writer per folder, --resume auto, --keep-last, interrupted saves cleared."""
    import socket

    folder = tmp_path / "ckpt"
    base = GPT_TINY + ["--steps", "4", "--eval-interval", "4", "--log-dir", str(tmp_path), "--checkpoint-dir", str(folder)]
    first = gpt.main(base + ["--resume", "auto", "--checkpoint-interval", "1", "--keep-last", "2"])  # nothing yet: starts
    assert [s for s, _ in first["history"]["train"]] == [1, 2, 3, 4]
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == \
        ["global_step3", "global_step4", "latest"]
    assert not (folder / ".writer.lock").exists(), "the lock goes with the run"

    code, err = _gpt_exit(base, capsys)  # a run that does not resume must not move `latest` back
    assert code == 2 and err.endswith("holds an earlier run (latest: global_step4): add --resume to continue it, "
                                      "--start-over to write over it, or name another folder"), err
    (folder / ".global_step9.partial").mkdir()  # a save that was interrupted
    resumed = gpt.main(base + ["--resume", "auto", "--steps", "6"])
    assert [s for s, _ in resumed["history"]["train"]] == [5, 6]
    assert not (folder / ".global_step9.partial").exists()

    (folder / ".writer.lock").write_text(f"{socket.gethostname()} {os.getppid()}")  # a live writer
    code, err = _gpt_exit(base + ["--resume"], capsys)
    assert code == 2 and "is being written by another run" in err and str(os.getppid()) in err, err
    (folder / ".writer.lock").write_text(f"{socket.gethostname()} 999999999")  # a writer that is gone
    gpt.main(base + ["--start-over", "--steps", "2", "--checkpoint-interval", "1", "--keep-last", "1"])
    assert (folder / "latest").read_text() == "global_step2"
    # pruned: this run's older checkpoint; the earlier run's later ones are not this run's to count
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("global_step")) == \
        ["global_step2", "global_step5", "global_step6"]
    code, err = _gpt_exit(base + ["--start-over", "--resume", "auto"], capsys)
    assert code == 2 and "--start-over and --resume cannot be combined" in err, err

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    code, err = _gpt_exit(GPT_TINY + ["--checkpoint-dir", str(a_file)], capsys)
    assert code == 2 and err.endswith(f"--checkpoint-dir {a_file} is a file, not a folder"), err
    code, err = _gpt_exit(GPT_TINY + ["--keep-last", "-1"], capsys)
    assert code == 2 and "--keep-last must be 0 (keep all) or more, got -1" in err, err


def _flags(config_class) -> set[str]:
    return {"--" + field.name.replace("_", "-") for field in dataclasses.fields(config_class)}


def test_help_names_the_sample_command_and_it_answers_help_with_its_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        gpt.main(["--help"])
    assert stop.value.code == 0
    usage = capsys.readouterr().out.split("\n\n")[0]
    commands = re.findall(r"recipes\.gpt((?: [a-z]+)*) \[flags\]", usage)
    assert commands == ["", " sample"], usage
    with pytest.raises(SystemExit) as stop:
        gpt.main(commands[1].split() + ["--help"])
    assert stop.value.code == 0
    assert set(re.findall(r"^  (--[a-z-]+)", capsys.readouterr().out, re.MULTILINE)) == _flags(gpt.SampleConfig)


@pytest.mark.parametrize("where", ["missing", "empty", "unnamed"])
def test_sample_without_a_checkpoint_names_the_folder_and_flags_sample_has(where, tmp_path, capsys):
    folder = {"missing": str(tmp_path / "nothing"), "empty": str(tmp_path), "unnamed": ""}[where]
    code, err = _gpt_exit(["sample"] + (["--checkpoint-dir", folder] if folder else []), capsys)
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"recipes.gpt sample: error: --checkpoint-dir {folder} " if folder else
                          "recipes.gpt sample: error: --checkpoint-dir is needed: "), err
    named = set(re.findall(r"--[a-z][a-z-]*", err))
    assert named and named <= _flags(gpt.SampleConfig) & _flags(gpt.TrainConfig), err  # flags of both commands
    assert "tag=" not in err, err


def test_bad_data_and_config_files_stop_with_one_line(tmp_path, capsys):
    empty, binary, folder, bad_json = tmp_path / "empty.txt", tmp_path / "blob.bin", tmp_path / "nothing", tmp_path / "e.json"
    empty.write_bytes(b"")
    binary.write_bytes(bytes(range(256)) * 8)
    folder.mkdir()
    bad_json.write_text("{not json")
    for argv, message in [(["--data", str(empty)], f"--data {empty} is empty"),
                          (["--data", str(binary)], f"--data {binary} is a binary file, not text"),
                          (["--data", str(folder)], f"--data {folder} holds no text file"),
                          (["--config", str(bad_json)], f"--config {bad_json} is not valid JSON")]:
        code, err = _gpt_exit(GPT_TINY + argv + ["--steps", "1", "--log-dir", str(tmp_path)], capsys)
        assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_the_recipes_default_engine_configs():
    gpt_config = engine_config(gpt.engine_fragments(gpt.TrainConfig()), {"lr", "steps"}, "")
    assert gpt_config["optimizer"] == {"type": "AdamW",
                                       "params": {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    assert gpt_config["scheduler"] == {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 1200, "warmup_num_steps": 50, "cos_min_ratio": 0.1}}
    cifar_config = engine_config(cifar.engine_fragments(cifar.CifarConfig()), {"lr"}, "")
    assert cifar_config["optimizer"] == {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8,
                                                                    "weight_decay": 3e-7}}
    assert cifar_config["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 1000}}


def test_a_config_of_another_optimizer_or_schedule_keeps_its_type_and_takes_the_written_flags(tmp_path):
    warmup = tmp_path / "warmup.json"
    warmup.write_text('{"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},'
                      ' "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}')
    cfg = gpt.TrainConfig(steps=2, warmup_steps=3, lr=0.25)
    fragments = gpt.engine_fragments(cfg)
    quiet = engine_config(fragments, set(), str(warmup))  # the JSON's blocks whole: no AdamW betas, no cosine keys
    assert quiet["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
    assert quiet["optimizer"] == {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}
    with pytest.warns(UserWarning) as said:
        written = engine_config(fragments, {"steps", "warmup_steps", "min_lr_ratio", "lr", "weight_decay"},
                                str(warmup))
    assert sorted(str(w.message) for w in said) == [  # --steps still sets the run's length: not said to be ignored
        "--lr sets the optimizer's lr, but WarmupLR (from --config) sets the learning rate from its own rates "
        "(warmup_max_lr, ...): --lr does not change the run's learning rate",
        "WarmupLR (from --config) takes no scheduler.params cos_min_ratio: --min-lr-ratio does not set it",
        "WarmupLR (from --config) takes no scheduler.params total_num_steps: --steps does not set it"]
    # the flags set what these types take (warmup steps, lr, weight decay), never the type
    assert written["scheduler"] == {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}
    assert written["optimizer"] == {"type": "SGD", "params": {"lr": 0.25, "momentum": 0.9, "weight_decay": 0.1}}
    # a config of the recipe's own types still merges key by key, and a written --lr leaves its betas
    tutorial = engine_config(fragments, {"lr"}, str(CIFAR_JSON))
    assert tutorial["optimizer"] == {"type": "Adam", "params": {"lr": 0.25, "betas": [0.8, 0.999], "eps": 1e-8,
                                                              "weight_decay": 3e-7}}
    assert tutorial["scheduler"]["type"] == "WarmupLR"  # cifar.json's, where the GPT recipe's is WarmupCosineLR
    # the type compared in any case: an "adamw" config is the recipe's AdamW, merged key by key
    lower = tmp_path / "lower.json"
    lower.write_text('{"optimizer": {"type": "adamw", "params": {"lr": 0.5}}}')
    assert engine_config(fragments, set(), str(lower))["optimizer"] == {
        "type": "adamw", "params": {"lr": 0.5, "betas": [0.9, 0.95], "weight_decay": 0.1}}
    # a type the engine will refuse keeps the written params (the engine names the type); a null block stays null
    odd = tmp_path / "odd.json"
    odd.write_text('{"scheduler": {"type": "Cosine"}, "optimizer": null}')
    kept = engine_config(fragments, {"steps", "lr"}, str(odd))
    assert kept["scheduler"] == {"type": "Cosine", "params": {"total_num_steps": 2}} and kept["optimizer"] is None
    # the CIFAR recipe's --lr onto a WarmupCosineLR config: the optimizer's lr, and a warning for the schedule's key
    cifar_cfg = cifar.CifarConfig(lr=0.125)
    cosine_json = tmp_path / "cosine.json"
    cosine_json.write_text('{"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}}')
    with pytest.warns(UserWarning, match=r"^WarmupCosineLR \(from --config\) takes no scheduler.params warmup_max_lr: "
                                         r"--lr does not set it$"):
        mixed = engine_config(cifar.engine_fragments(cifar_cfg), {"lr"}, str(cosine_json))
    assert mixed["scheduler"] == {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}
    assert mixed["optimizer"]["params"]["lr"] == 0.125 and mixed["optimizer"]["type"] == "Adam"
    # and the runs: the tutorial's config in the GPT recipe, a WarmupLR config with --steps, no schedule
    no_schedule = tmp_path / "null.json"
    no_schedule.write_text('{"scheduler": null}')  # as DeepSpeed reads it
    for config in (CIFAR_JSON, warmup, no_schedule):
        result = gpt.main(GPT_TINY + ["--steps", "2", "--config", str(config), "--log-dir", str(tmp_path)])
        assert result["history"]["train"] and all(math.isfinite(loss) for _, loss in result["history"]["train"])


@pytest.mark.parametrize("entry, message", [
    ('{"train_batch_size": "32"}', "train_batch_size must be int, got str '32'"),
    ('{"optimizer": {"params": {"lr": "fast"}}}', "optimizer.params.lr for AdamW must be a number, got str 'fast'"),
    ('{"scheduler": {"params": {"warmup_num_steps": "ten"}}}',
     "scheduler.params.warmup_num_steps for WarmupCosineLR must be a number, got str 'ten'"),
    ('{"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "high"}}}',
     "scheduler.params.warmup_max_lr for WarmupLR must be a number (or a list of one per param group), got str"),
    ('{"optimizer": {"params": {"betas": [0.9]}}}', "optimizer.params.betas for AdamW must be a list of 2 numbers"),
])
def test_a_config_value_of_the_wrong_type_stops_with_one_line_naming_its_key(tmp_path, capsys, entry, message):
    config = tmp_path / "engine.json"
    config.write_text(entry)
    unwritten = GPT_TINY[:GPT_TINY.index("--lr")]  # written --lr and --warmup-steps would override the file
    code, err = _gpt_exit(unwritten + ["--steps", "1", "--config", str(config), "--log-dir", str(tmp_path)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_corrupt_latest_or_manifest_is_named(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    gpt.main(GPT_TINY + ["--steps", "1", "--log-dir", str(tmp_path), "--checkpoint-dir", str(folder)])
    (folder / "latest").write_bytes(b"\xff\xfe\x00garbage")
    code, err = _gpt_exit(["--resume", "--checkpoint-dir", str(folder)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "latest is corrupt: it should name a checkpoint folder" in err
    (folder / "latest").write_text("global_step1")
    (folder / "global_step1" / "manifest.json").write_text("[]")
    code, err = _gpt_exit(["--resume", "--checkpoint-dir", str(folder)], capsys)
    assert code == 2 and len(err.splitlines()) == 1 and "manifest.json lists no files" in err, err


def _torchrun_restarting(die_at: str, folder: pathlib.Path, *args: str) -> tuple[str, list[str]]:
    """Two ranks under `torchrun --max-restarts 1`; rank 1 of the first attempt dies at `die_at`.
    Returns the job's output and every value `latest` had while it ran (polled)."""
    import tempfile
    import time

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "--max-restarts", "1", "-m", "tests.recipes.dying_rank", *args, "--checkpoint-dir", str(folder)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        job = subprocess.Popen(command, stdout=out, stderr=err, text=True, env={**os.environ, "DIE_AT": die_at})
        seen, deadline = [], time.time() + 240
        while job.poll() is None and time.time() < deadline:
            latest = folder / "latest"
            value = latest.read_text() if latest.exists() else None
            if value and (not seen or seen[-1] != value):
                seen.append(value)
            time.sleep(0.02)
        if job.poll() is None:
            job.kill()
        job.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert job.returncode == 0, f"DIE_AT={die_at}\n" + stdout[-3000:] + stderr[-3000:]
    return stdout, seen


RESTARTED = GPT_TINY + ["--ep-world-size", "2", "--stage", "2", "--steps", "30", "--log-interval", "5",
                        "--eval-interval", "1000", "--checkpoint-interval", "10"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    return folder, _logged_losses(_torchrun("recipes.gpt", *RESTARTED, "--checkpoint-dir", str(folder / "ckpt")).stdout)


@pytest.mark.slow
@pytest.mark.parametrize("die_at, resumed_from", [("save:20", 10), ("step:25", 20)])
def test_torchrun_restarts_a_run_that_lost_a_rank_and_it_ends_as_if_never_interrupted(tmp_path, uninterrupted,
                                                                                       die_at, resumed_from):
    """Rank 1 is killed (SIGKILL) inside step 20's save, or inside step 25's optimizer step; torchrun's
    --max-restarts 1 starts the job again, which resumes from the last whole checkpoint by itself
    (no --resume flag) and ends with the weights of a run that was never interrupted, bit for bit; no
    checkpoint is lost, `latest` never names an older one, and no process of the run is left."""
    from optim.consolidate import consolidate

    straight_folder, straight = uninterrupted
    folder = tmp_path / "faulty"
    stdout, seen = _torchrun_restarting(die_at, folder, *RESTARTED)
    assert f"torchrun restart 1: resuming from global_step{resumed_from} in --checkpoint-dir {folder}" in stdout
    assert f"resumed from {folder / f'global_step{resumed_from}'} at step {resumed_from}" in stdout
    steps = [int(value.removeprefix("global_step")) for value in seen]
    assert steps == sorted(steps) and steps[-1] == 30, seen  # `latest` never named an older checkpoint
    logged = _logged_losses(stdout)  # the first attempt's lines, then the restarted one's
    assert logged.keys() == straight.keys() == {5, 10, 15, 20, 25, 30}
    assert list(logged.values()) == pytest.approx([straight[s] for s in logged], abs=1e-4)  # 4 printed digits
    assert (folder / "latest").read_text() == "global_step30"
    assert {p.name for p in folder.iterdir() if p.name.startswith("global_step")} == {
        "global_step10", "global_step20", "global_step30"}
    assert not (folder / ".writer.lock").exists()
    resumed, reference = consolidate(str(folder)), consolidate(str(straight_folder / "ckpt"))
    assert resumed.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(resumed[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    left = subprocess.run(["pgrep", "-f", str(folder)], capture_output=True, text=True)
    assert left.stdout == "", f"processes of the run are left: {left.stdout}"


def test_a_checkpoint_config_saved_under_an_earlier_field_name_still_resumes():
    old = {"recipe": {"expert_compute": "packed", "steps": 7}}
    assert saved_recipe(old) == {"expert_layout": "packed", "steps": 7}
    assert old["recipe"] == {"expert_compute": "packed", "steps": 7}  # the client state itself is left alone
    earlier = dataclasses.asdict(gpt.TrainConfig())  # a whole config as an earlier version saved it
    earlier["expert_compute"] = earlier.pop("expert_layout")
    earlier["expert_compute"] = "padded"
    assert gpt.TrainConfig(**saved_recipe({"recipe": earlier})).expert_layout == "padded"


def test_the_recipes_page_lists_every_gpt_flag():
    page = (pathlib.Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    start = page.index("| flags | what |", page.index("## `recipes.gpt`"))
    listed = set(re.findall(r"--[a-z][a-z-]*", page[start:page.index("`sample` takes", start)]))
    flags = {"--" + field.name.replace("_", "-") for field in dataclasses.fields(gpt.TrainConfig)}
    assert flags - listed == set()
    assert listed - flags == set()


def test_flag_names_rewrites_field_names_but_not_paths_attributes_or_quoted_keys():
    from recipes.common.cli import flag_names

    assert flag_names("n_embd (30) must be divisible by n_head (4).", gpt.TrainConfig) == \
        "--n-embd (30) must be divisible by --n-head (4)."
    for untouched in ("/data/log_dir/run_name/x", "cfg.top_k", "'top_k'", "routing must be ...", "top_kx"):
        assert flag_names(untouched, gpt.TrainConfig) == untouched
    # the model's ep_size is the recipes' --ep-world-size
    assert flag_names("num_experts (6) must be divisible by ep_size (4)", gpt.TrainConfig) == \
        "--num-experts (6) must be divisible by --ep-world-size (4)"


@pytest.mark.parametrize("argv, message", [
    (["--new-tokens", "-5"], "--new-tokens must be 0 or more, got -5"),
    (["--top-k", "-1"], "--top-k must be 0 or more, got -1"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--prompt", ""], "--prompt must hold at least one character"),
])
def test_sample_refuses_bad_values_before_reading_a_checkpoint(argv, message, capsys):
    code, err = _gpt_exit(["sample"] + argv, capsys)  # no --checkpoint-dir: the value is named first
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith(f"recipes.gpt sample: error: {message}"), err
