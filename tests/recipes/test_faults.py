"""What users do to runs: resuming another model's checkpoint, a learning rate that overflows the
weights. Each ends with one line (exit status 2 for a refusal, 1 for a stop), never a traceback, and
never with a checkpoint of weights that are not finite."""

import math
import re
import subprocess
import sys

import pytest
import torch

from optim import initialize
from optim.consolidate import consolidate
from recipes import gpt
from tests.optim.models import Net, batch, config, loss_of

TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--ffn", "64", "--seq-len", "16", "--batch-size", "2",
        "--num-experts", "4", "--top-k", "2", "--eval-interval", "100", "--eval-batches", "1"]


def _stopped(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as stop:
        gpt.main(argv)
    return stop.value.code, capsys.readouterr().err


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 4-expert, width-32, 2-layer MoE run with a checkpoint at step 2."""
    folder = tmp_path_factory.mktemp("run")
    gpt.main(TINY + ["--steps", "2", "--checkpoint-interval", "2", "--checkpoint-dir", str(folder / "ckpt"),
                     "--log-dir", str(folder / "runs")])
    return folder


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "8"], r"holds 4 experts for blocks.1.ffn.deepspeed_moe.experts.\w+, this model has 8"),
    (["--n-embd", "64"], r"holds blocks.0.\S+ with shape \[32\], this model's is \[64\]"),
    (["--n-layer", "4"], r"holds 0 experts for blocks.3.ffn.deepspeed_moe.experts.\w+, this model has 4"),
    (["--dense"], r"has no entry for parameter blocks.1.ffn.0.\w+: it was saved from a different model"),
])
def test_another_models_checkpoint_is_refused_in_one_line(saved_run, flags, message, capsys):
    code, err = _stopped(["--resume", "--checkpoint-dir", str(saved_run / "ckpt"), "--steps", "4",
                          "--log-dir", str(saved_run / "runs2"), *flags], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith(f"recipes.gpt: error: checkpoint {saved_run / 'ckpt' / 'global_step2'} ")
    assert re.search(message, lines[0]), lines[0]


@pytest.mark.slow
def test_another_models_checkpoint_is_refused_in_one_line_on_every_rank_under_torchrun(saved_run):
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "recipes.gpt",
         "--resume", "--checkpoint-dir", str(saved_run / "ckpt"), "--num-experts", "8", "--ep-world-size", "2",
         "--steps", "4", "--log-dir", str(saved_run / "runs3")],
        capture_output=True, text=True, timeout=240)
    refusals = [line for line in done.stderr.splitlines() if line.startswith("recipes.gpt: error: checkpoint ")]
    assert len(refusals) == 2 and "holds 4 experts" in refusals[0], done.stderr[-3000:]
    # torchrun's agent reports the failed workers with a traceback of its own; none comes from the workers
    assert not re.search(r'File ".*/(recipes|optim|moe|parallel)/', done.stderr), done.stderr[-3000:]
    assert done.returncode != 0


@pytest.mark.slow
def test_a_step_that_overflows_the_weights_stops_before_its_checkpoint(tmp_path, capsys):
    """--lr 3e38 (finite in fp32) with one warm-up step: the step writes inf from finite gradients."""
    folder = tmp_path / "ckpt"
    code, err = _stopped(TINY + ["--steps", "6", "--lr", "3e38", "--warmup-steps", "1", "--checkpoint-interval", "1",
                                 "--checkpoint-dir", str(folder), "--log-dir", str(tmp_path / "runs")], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    last = (folder / "latest").read_text().strip()
    assert lines[0].startswith("recipes.gpt: stopped: step ") and "wrote inf or nan into the weights" in lines[0]
    assert lines[0].endswith(f"the checkpoint was not written; last checkpoint: {folder / last}")
    for saved in sorted(p for p in folder.iterdir() if p.name.startswith("global_step")):
        assert all(bool(torch.isfinite(t).all()) for t in consolidate(str(saved)).values() if t.is_floating_point())


@pytest.mark.parametrize("flags, message", [
    (["--lr", "1e39"], r"param group 0's lr \(1e\+39\) is beyond the range of the model's float32 \(largest 3.403e\+38\)"),
    (["--lr", "1e5", "--dtype", "fp16"], r"lr \(100000\) is beyond the range of the model's float16 \(largest 6.55e\+04\)"),
])
def test_a_learning_rate_beyond_the_dtype_is_refused_up_front(tmp_path, flags, message, capsys):
    code, err = _stopped(TINY + ["--steps", "2", "--log-dir", str(tmp_path), *flags], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_a_schedules_own_rate_beyond_the_dtype_is_refused():
    schedule = {"type": "WarmupLR", "params": {"warmup_max_lr": 1e39, "warmup_num_steps": 5}}
    with pytest.raises(ValueError, match=r"the schedule's max_lrs \(1e\+39\) is beyond the range of the model's "
                                         r"float32"):
        initialize(model=Net(), config={**config(0, 1, 0.0), "scheduler": schedule})


def _overflowing_engine(nonfinite):
    model = Net()
    engine, *_ = initialize(model=model, config={**config(0, 1, 0.0, {"type": "SGD", "params": {"lr": 1e38}}),
                                                 "nonfinite": nonfinite})
    x, y = batch(0, 0, 0)
    engine.backward(1e3 * loss_of(engine(x), y))  # finite gradients of about 1e2: the update overflows
    engine.step()
    return engine, model


@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_the_engine_never_saves_weights_its_step_overflowed(tmp_path, nonfinite):
    engine, model = _overflowing_engine(nonfinite)
    assert engine.global_steps == 1 and not all(bool(torch.isfinite(p).all()) for p in model.parameters())
    message = (r"step 1: the optimizer step wrote inf or nan into the weights or optimizer states on rank\(s\) \[0\] "
               r"from finite gradients \(is the learning rate, 1e\+38, far too large\?\); the checkpoint was not "
               r"written; last checkpoint: none")
    with pytest.raises(FloatingPointError, match=message):
        engine.save_checkpoint(str(tmp_path), tag="bad")
    assert not any(tmp_path.iterdir())
    x, y = batch(1, 0, 0)
    engine.backward(loss_of(engine(x), y))
    with pytest.raises(FloatingPointError, match=r"step 1: the optimizer step wrote inf or nan .* training stopped"):
        engine.step()  # the next step's one read carries the flag


def test_nonfinite_off_reads_nothing_and_saves_what_it_has(tmp_path):
    engine, model = _overflowing_engine("off")
    engine.save_checkpoint(str(tmp_path), tag="as_asked")  # "off" does not look, as documented
    assert (tmp_path / "as_asked").is_dir() and not math.isfinite(float(model.inp.weight.detach().abs().max()))


@pytest.mark.slow
def test_a_lock_left_by_an_ended_process_or_agent_is_taken_over_with_a_warning(tmp_path):
    import socket

    from recipes.common.training import SetupError, claim_checkpoint_dir, release_checkpoint_dir

    lock, host = tmp_path / ".writer.lock", socket.gethostname()
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = ended.stdout.strip()
    # a worker whose agent died: not this test's child (a child would linger as a zombie), it stops in 2 s
    stopping = subprocess.run(["sh", "-c", "sleep 2 >/dev/null & echo $!"], capture_output=True, text=True).stdout.strip()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for holder in (f"{host} {gone}", f"{host} {stopping} {gone}"):  # its process, or agent and process, ended
            lock.write_text(holder)
            with pytest.warns(UserWarning, match=r"taking over the lock of process \d+, whose run ended"):
                claim_checkpoint_dir(str(tmp_path))
            release_checkpoint_dir(str(tmp_path))
            assert not lock.exists()
        lock.write_text("")  # a writer killed between creating its lock and writing it
        claim_checkpoint_dir(str(tmp_path))
        release_checkpoint_dir(str(tmp_path))
        lock.write_text(f"{host} {alive.pid}")  # a running writer keeps its folder
        with pytest.raises(SetupError, match=rf"is being written by another run \(host {host}, process {alive.pid}\)"):
            claim_checkpoint_dir(str(tmp_path))
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow
def test_a_restart_of_a_refused_attempt_is_refused_again(saved_run):
    """An earlier run in the folder and no --resume: torchrun's restart must not quietly continue it."""
    before = (saved_run / "ckpt" / "latest").read_text()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
         "-m", "recipes.gpt", *TINY, "--steps", "4", "--checkpoint-dir", str(saved_run / "ckpt"),
         "--log-dir", str(saved_run / "runs4")], capture_output=True, text=True, timeout=240)
    refusals = [line for line in done.stderr.splitlines() if "holds an earlier run" in line]
    assert done.returncode != 0 and len(refusals) == 4, done.stderr[-3000:]  # 2 ranks, 2 attempts
    assert "torchrun restart" not in done.stdout and (saved_run / "ckpt" / "latest").read_text() == before


@pytest.mark.slow
def test_workers_end_with_their_torchrun_agent_and_release_the_folder(tmp_path):
    """SIGKILL to torchrun's agent: its workers (detached from its process group) notice, stop, release the lock."""
    import os
    import signal
    import time

    folder = tmp_path / "ckpt"
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "recipes.gpt",
         *TINY, "--steps", "100000", "--checkpoint-interval", "5", "--checkpoint-dir", str(folder),
         "--log-dir", str(tmp_path / "runs")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while not (folder / "latest").exists() and time.time() < deadline:
            time.sleep(0.5)
        assert (folder / "latest").exists() and (folder / ".writer.lock").exists()
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait()
        deadline = time.time() + 20
        while subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 0 and \
                time.time() < deadline:
            time.sleep(0.5)
        assert subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 1, "workers outlived it"
        assert not (folder / ".writer.lock").exists()
    finally:
        subprocess.run(["pkill", "-9", "-f", str(folder)])
