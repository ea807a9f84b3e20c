"""The capturable step (optim.capturable) against the usual step, run eagerly on the CPU.

The same GPT, batches and engine config trained twice, once with `engine.set_capturable()`: the
losses, weights, loss scale and skipped steps must be equal bit for bit (the same operations, the rate
read as the CPU's fused step reads a Python one), also through fp16 overflows when no schedule runs
(a skipped step advances the schedule in the capturable step only, as the module says). What it
changes on the host side: the report's statistics, read every `report_every` steps, must equal those
written after every step, and a non-finite loss stops the run at that read.
"""

import math

import pytest
import torch

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.capturable import capture_problems
from recipes import gpt
from recipes.common.cli import engine_config
from recipes.gpt_model import GPT


def _engine(dtype="fp32", layout="padded", config=None, schedule=True, **model):
    torch.manual_seed(0)
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=4, num_experts=4, top_k=2,
                          dtype=dtype, expert_layout=layout, warmup_steps=5, log_dir="", **model)
    net = GPT(gpt.model_config(cfg))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "dense"})
    settings = engine_config(gpt.engine_fragments(cfg), set(), "")
    if not schedule:
        settings.pop("scheduler", None)
    settings.update(config or {})
    engine, *_ = initialize(net, model_parameters=groups, config=settings)
    return engine, cfg


def _train(engine, cfg, steps=20, poison=None, first=1):
    """Steps first..steps on the same batches every run; a run from step 1 seeds the router's sampling."""
    generator = torch.Generator().manual_seed(1)
    if first == 1:
        torch.manual_seed(2)  # the router samples its second choice (a checkpoint keeps the state)
    losses = []
    for step in range(1, steps + 1):
        tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1), generator=generator)
        if step < first:
            continue
        x, y = tokens[:, :-1], tokens[:, 1:]
        logits, l_aux, z_loss = engine(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        if step == poison:
            loss = loss * math.nan
        engine.backward(loss + cfg.aux_coef * l_aux + cfg.z_loss_coef * z_loss)
        engine.step()
        losses.append(loss.detach())
    return torch.stack(losses)


def _pair(dtype, layout, config=None, schedule=True, report_every=5, steps=20):
    usual, cfg = _engine(dtype, layout, config, schedule)
    capturable, _ = _engine(dtype, layout, config, schedule)
    capturable.set_capturable(report_every)
    return (usual, _train(usual, cfg, steps)), (capturable, _train(capturable, cfg, steps))


@pytest.mark.slow
@pytest.mark.parametrize("dtype, layout", [("fp32", "padded"), ("fp32", "grouped"), ("bf16", "padded"),
                                           ("fp16", "grouped")])
def test_the_capturable_step_equals_the_usual_step(dtype, layout):
    (usual, usual_losses), (capturable, losses) = _pair(dtype, layout, steps=12)
    assert torch.equal(usual_losses, losses)
    for (name, a), b in zip(usual.module.named_parameters(), capturable.module.parameters()):
        assert torch.equal(a, b), name
    assert capturable.loss_scale == usual.loss_scale and capturable.global_steps == usual.global_steps == 12
    assert capturable.get_lr() == usual.get_lr()


@pytest.mark.slow
def test_fp16_overflows_skip_the_same_steps_on_the_device():
    # a scale of 2^30 overflows fp16 at once: the first steps are skipped while the scale comes down
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 4, "hysteresis": 2}}
    (usual, usual_losses), (capturable, losses) = _pair("fp16", "padded", fp16, schedule=False)
    assert usual.skipped_steps > 2
    assert torch.equal(usual_losses, losses)
    assert capturable.skipped_steps == usual.skipped_steps  # read at step 20, a multiple of report_every
    assert capturable.was_step_skipped() == usual.was_step_skipped()
    assert capturable.loss_scale == usual.loss_scale
    assert capturable.scaler.state_dict() == usual.scaler.state_dict()
    for a, b in zip(usual.module.parameters(), capturable.module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_checkpoint_of_a_capturable_run_resumes_it(tmp_path):
    fp16 = {"fp16": {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 4, "hysteresis": 2}}
    usual, cfg = _engine("fp16", config=fp16, schedule=False)
    straight = _train(usual, cfg, steps=10)
    first, _ = _engine("fp16", config=fp16, schedule=False)
    first.set_capturable(report_every=4)
    before = _train(first, cfg, steps=6)  # step 6 is not a read: saving reads the skip counters first
    first.save_checkpoint(str(tmp_path))
    assert first.skipped_steps > 0  # read when saving, though step 6 is not a multiple of report_every
    resumed, _ = _engine("fp16", config=fp16, schedule=False)
    resumed.set_capturable(report_every=4)
    resumed.load_checkpoint(str(tmp_path))
    after = _train(resumed, cfg, steps=10, first=7)
    assert torch.equal(torch.cat([before, after]), straight)
    resumed.flush_report()
    assert resumed.skipped_steps == usual.skipped_steps and resumed.loss_scale == usual.loss_scale
    for a, b in zip(usual.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_the_report_reads_every_few_steps_what_the_usual_step_writes_after_each(monkeypatch, tmp_path):
    from optim.monitor import Monitor

    written = {}

    def record(self, step, samples, lr, loss_scale, seconds, batch_size, loss, layers):
        written.setdefault(self.log_dir, []).append((step, lr, loss_scale, loss, [l.exp_counts.tolist() for l in layers]))

    monkeypatch.setattr(Monitor, "train_step", record)
    board = {"tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "usual"}}
    usual, cfg = _engine(config=board)
    board["tensorboard"]["job_name"] = "capturable"
    capturable, _ = _engine(config=board)
    capturable.set_capturable(report_every=4)
    _train(usual, cfg, steps=6)
    _train(capturable, cfg, steps=6)
    usual_rows, rows = written[usual.monitor.log_dir], written[capturable.monitor.log_dir]
    assert len(usual_rows) == 6 and len(rows) == 4  # steps 5 and 6 wait for the next read
    assert rows == usual_rows[:4]
    capturable.flush_report()
    assert rows == usual_rows and capturable.last_routing_stats[0].exp_counts.tolist() == rows[-1][4][0]


@pytest.mark.slow
def test_a_nonfinite_loss_stops_the_run_at_the_next_read():
    usual, cfg = _engine()
    with pytest.raises(FloatingPointError, match="step 3: the loss was inf or nan"):
        _train(usual, cfg, steps=6, poison=3)
    capturable, _ = _engine()
    capturable.set_capturable(report_every=4)
    with pytest.raises(FloatingPointError, match=r"steps 1-4: 1 step\(s\) met inf or nan"):
        _train(capturable, cfg, steps=6, poison=3)
    skipping, _ = _engine(config={"nonfinite": "skip"})
    skipping.set_capturable(report_every=4)
    _train(skipping, cfg, steps=8, poison=3)
    assert skipping.skipped_steps == 1


def test_settings_a_graph_cannot_hold_are_named():
    engine, _ = _engine(config={"optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    problems = capture_problems(engine)
    assert len(problems) == 1 and "SGD, fused=False" in problems[0]
    with pytest.raises(ValueError, match="cannot run without host reads: the optimizer \\(SGD"):
        engine.set_capturable()
