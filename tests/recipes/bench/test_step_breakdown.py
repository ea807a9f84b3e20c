"""recipes.bench.step_breakdown: timers on a GPT's feed-forward blocks, its MoE layers' parts, and the optimizer."""

import re
import statistics

import pytest
import torch
import torch.nn.functional as F

from recipes import gpt
from recipes.bench import gpt as bench_gpt
from recipes.bench.step_breakdown import StepBreakdown
from recipes.gpt_model import GPT

TINY = dict(n_layer=2, n_embd=32, n_head=2, ffn=64, seq_len=32, batch_size=8, num_experts=4, top_k=2)


def _train(model, optimizer, steps: int) -> None:
    torch.manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(0, 256, (4, 32))
        logits, l_aux, _ = model(idx)
        (F.cross_entropy(logits.flatten(0, 1), idx.flatten()) + 0.01 * l_aux).backward()
        optimizer.step()
        optimizer.zero_grad()


def _timed_gpt():
    """A tiny MoE GPT (block 0 dense, block 1 MoE), its AdamW and timers on both."""
    torch.manual_seed(0)
    model = GPT(gpt.model_config(gpt.TrainConfig(**TINY)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, StepBreakdown(model, optimizer)


def test_each_block_and_the_moe_layers_parts_are_timed_once_per_step():
    model, optimizer, timer = _timed_gpt()
    _train(model, optimizer, 3)
    seconds = timer.seconds
    layer, mlp = "block 1 MoE", "block 0 MLP"
    expected = {f"{mlp} forward", f"{mlp} backward", f"{layer} forward", f"{layer} backward", f"{layer} gate forward",
                f"{layer} experts forward", f"{layer} experts backward", "optimizer step"}
    assert set(seconds) == expected, sorted(seconds)
    assert all(len(times) == 3 and min(times) > 0 for times in seconds.values()), dict(seconds)
    for i in range(3):  # the parts lie inside the layer's own windows, call by call
        inside = seconds[f"{layer} gate forward"][i] + seconds[f"{layer} experts forward"][i]
        assert inside <= seconds[f"{layer} forward"][i]
        assert seconds[f"{layer} experts backward"][i] <= seconds[f"{layer} backward"][i]
    ms = timer.medians()
    rest_forward = [whole - gate - experts for whole, gate, experts in zip(
        seconds[f"{layer} forward"], seconds[f"{layer} gate forward"], seconds[f"{layer} experts forward"])]
    rest_backward = [whole - experts for whole, experts in zip(seconds[f"{layer} backward"],
                                                               seconds[f"{layer} experts backward"])]
    assert ms[f"{layer} rest forward"] == 1e3 * statistics.median(rest_forward)
    assert ms[f"{layer} rest backward"] == 1e3 * statistics.median(rest_backward)
    assert f"{mlp} rest forward" not in ms
    table = "\n".join(timer.lines())
    assert "(median ms of 3 calls)" in table.splitlines()[0], table
    for label in (mlp, layer, "gate (router, plan)", "experts", "dispatch, combine, the rest", "optimizer step"):
        assert label in table, table


def test_evaluation_forwards_and_inputs_without_gradient_are_not_timed():
    model, optimizer, timer = _timed_gpt()
    with torch.no_grad():
        model(torch.randint(0, 256, (4, 32)))
    assert not timer.seconds
    for param in model.parameters():  # nothing before the blocks' feed-forward needs a gradient
        param.requires_grad_(False)
    for param in model.blocks[1].ffn.parameters():
        param.requires_grad_(True)
    logits, l_aux, _ = model(torch.randint(0, 256, (4, 32)))
    (logits.float().square().mean() + l_aux).backward()
    assert {part for part in timer.seconds if part.endswith("backward")} == set(), dict(timer.seconds)
    assert len(timer.seconds["block 1 MoE forward"]) == 1


def test_only_a_torch_optimizer_is_timed():
    model = GPT(gpt.model_config(gpt.TrainConfig(**TINY)))
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got dict"):
        StepBreakdown(model, {"lr": 1e-3})


def test_cleared_times_start_over_and_removed_hooks_time_nothing():
    model, optimizer, timer = _timed_gpt()
    _train(model, optimizer, 2)
    timer.clear()
    _train(model, optimizer, 1)
    assert {len(times) for times in timer.seconds.values()} == {1}
    timer.remove()
    timer.clear()
    _train(model, optimizer, 1)
    assert not timer.seconds


class _Foreign(torch.nn.Module):
    """An MoE layer of another class with DeepSpeed's layout (`deepspeed_moe.gate`, `.experts`): DeepSpeed's own."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.deepspeed_moe = inner.deepspeed_moe
        self.z_loss = inner.z_loss

    def forward(self, x):
        out = self.inner(x)
        self.z_loss = self.inner.z_loss
        return out


def test_an_moe_layer_of_another_class_is_timed_with_its_gate_and_experts():
    torch.manual_seed(0)
    model = GPT(gpt.model_config(gpt.TrainConfig(**TINY)))
    model.blocks[1].ffn = _Foreign(model.blocks[1].ffn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timer = StepBreakdown(model, optimizer)
    _train(model, optimizer, 2)
    layer = "block 1 MoE"
    assert {f"{layer} forward", f"{layer} backward", f"{layer} gate forward", f"{layer} experts forward",
            f"{layer} experts backward"} <= set(timer.seconds), sorted(timer.seconds)
    assert all(len(timer.seconds[f"{layer} {part}"]) == 2 for part in ("forward", "gate forward", "experts backward"))


def test_bench_gpt_prints_the_breakdown_of_both_models(capsys):
    args = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--ffn", "64", "--seq-len", "32", "--batch-size", "8",
            "--num-experts", "4", "--top-k", "2", "--steps", "2", "--warmup", "1", "--deepspeed", "off", "--breakdown"]
    bench_gpt.main(args)
    out = capsys.readouterr().out
    for name in ("moe", "dense"):
        assert f"{name} model, parts of the timed steps:" in out, out
    moe_table = out.split("moe model, parts of the timed steps:")[1].split("dense model")[0]
    numbers = r"\s+([0-9.]+)\s+([0-9.]+)$"
    assert re.search(r"^\s+block 1 MoE" + numbers, moe_table, re.MULTILINE), moe_table
    assert re.search(r"^\s+experts" + numbers, moe_table, re.MULTILINE), moe_table
    assert re.search(r"^\s+gate \(router, plan\)\s+([0-9.]+)\s+-$", moe_table, re.MULTILINE), moe_table
    assert "(median ms of 2 calls)" in moe_table, moe_table  # the untimed step's calls were cleared
    dense_table = out.split("dense model, parts of the timed steps:")[1]
    assert re.search(r"^\s+block 1 MLP" + numbers, dense_table, re.MULTILINE), dense_table
    assert "MoE" not in dense_table.split("CPU products")[0], dense_table
    bench_gpt.main(args[:-1])
    assert "parts of the timed steps" not in capsys.readouterr().out


def test_bench_gpt_profiles_both_models(capsys):
    bench_gpt.main(["--steps", "1", "--warmup", "1", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--ffn", "64",
                    "--seq-len", "16", "--batch-size", "2", "--num-experts", "4", "--deepspeed", "off", "--profile"])
    out = capsys.readouterr().out
    assert f"profile of {bench_gpt.PROFILED_STEPS} more steps of each model" in out, out
    lines = {name: (float(ms), float(items)) for name, ms, items in re.findall(
        r"^  (moe|dense) +host +([0-9.]+) ms, +([0-9.]+) \.item\(\) calls", out, re.MULTILINE)}
    assert set(lines) == {"moe", "dense"} and all(ms > 0 and items >= 0 for ms, items in lines.values()), out
    for name in ("moe", "dense"):
        block = out.split(f"{name} model, the ops with the most host time (calls and ms per step):\n")[1]
        rows = re.findall(r"^  (\S.*?) +([0-9.]+) +([0-9.]+)$", block.split("model, the ops")[0].split("CPU products")[0],
                          re.MULTILINE)
        assert 1 <= len(rows) <= 10 and all(float(calls) > 0 for _, calls, _ in rows), out
        assert [float(ms) for *_, ms in rows] == sorted((float(ms) for *_, ms in rows), reverse=True), out
    moe_ops = out.split("moe model, the ops")[1].split("dense model, the ops")[0]
    assert "_PerExpertMLP" in moe_ops or "_GroupedGemmMLP" in moe_ops or "_ConcurrentMLP" in moe_ops, out
