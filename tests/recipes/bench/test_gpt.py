"""recipes.bench.gpt: the MoE model and its dense twin timed side by side, and DeepSpeed's layer as a third
model where it has a counterpart for the flags."""

import re
import sys

import pytest
import torch

from moe import MoE
from recipes import gpt
from recipes.bench import gpt as bench_gpt
from recipes.gpt_model import GPT
from tests.recipes.test_recipes import GPT_TINY, _numbers, _parsed


def test_bench_gpt_times_both_models(capsys):
    results = bench_gpt.main(GPT_TINY + ["--steps", "2", "--warmup", "1", "--deepspeed", "off"])
    assert set(results) == {"moe", "dense"} and all(rate > 0 for rate in results.values())
    out = capsys.readouterr().out
    printed = {name: _numbers(r"([0-9.,]+)", figures) for name, figures in re.findall(
        r"^(moe|dense) +([0-9,]+ parameters +[0-9,]+ active +[0-9.]+ ms/step +[0-9.]+) tokens/s$", out, re.MULTILINE)}
    assert set(printed) == {"moe", "dense"}, out
    for name, (total, active, ms, tokens_per_s) in printed.items():
        cfg = gpt.TrainConfig(**{**_parsed(GPT_TINY), "dense": name == "dense"})
        assert (total, active) == GPT(gpt.model_config(cfg)).parameter_counts(), name
        assert tokens_per_s == pytest.approx(results[name], abs=0.51)
        assert ms == pytest.approx(8 * 32 / results[name] * 1e3, abs=0.051)  # 8 sequences of 32 tokens per step
    ratio = _numbers(r"^MoE / dense tokens/s: ([0-9.]+)$", out)
    assert ratio == [pytest.approx(results["moe"] / results["dense"], abs=5e-4)]
    spread = re.search(r"^per-step pairs \(dense / MoE ms\): median ([0-9.]+), quartiles ([0-9.]+)-([0-9.]+); "
                       r"first half ([0-9.]+), second half ([0-9.]+)$", out, re.MULTILINE)
    assert spread, out
    median, low, high, first, second = map(float, spread.groups())
    assert 0 < low <= median <= high and min(first, second) <= high and max(first, second) >= low
    assert len(_numbers(r"^MoE choices dropped over capacity in the timed steps: ([0-9.]+)% \(after 1 untimed steps\)$",
                        out)) == 1, out
    faults = re.search(r"^minor page faults per step \(median\): moe ([0-9]+), dense ([0-9]+)$", out, re.MULTILINE)
    assert faults or sys.platform == "win32", out  # counted wherever the OS counts them


@pytest.mark.parametrize("flags, named", [
    ([], None), (["--noisy-gate-policy", "Jitter", "--dropless"], None), (["--stage", "2"], None),
    (["--scoring-func", "sigmoid"], "--scoring-func sigmoid"), (["--n-shared-experts", "1"], "--n-shared-experts 1"),
    (["--bias-update-speed", "0.001"], "--bias-update-speed 0.001"),
    (["--routing", "expert_choice"], "--routing expert_choice"),
    (["--ep-world-size", "2"], "--ep-world-size 2"), (["--compile"], "--compile"), (["--stage", "3"], "--stage 3"),
])
def test_bench_gpt_names_the_flag_deepspeeds_layer_has_no_counterpart_for(flags, named):
    assert bench_gpt.deepspeed_unfit(gpt.TrainConfig(**_parsed(GPT_TINY + flags))) == named


def test_bench_gpt_leaves_deepspeeds_layer_out_or_fails_where_it_cannot_run(monkeypatch, capsys):
    timed = GPT_TINY + ["--steps", "1", "--warmup", "1"]
    with pytest.raises(SystemExit) as failed:
        bench_gpt.main(timed + ["--scoring-func", "sigmoid", "--deepspeed", "on"])
    assert failed.value.code == 2
    assert "--deepspeed on: DeepSpeed's MoE layer cannot run here: it has no counterpart for --scoring-func sigmoid" \
        in capsys.readouterr().err
    results = bench_gpt.main(timed + ["--scoring-func", "sigmoid"])  # auto: left out, with a line saying why
    assert set(results) == {"moe", "dense"}
    assert "DeepSpeed's MoE layer left out: it has no counterpart for --scoring-func sigmoid" in capsys.readouterr().out
    monkeypatch.setattr(bench_gpt, "_deepspeed_layer", lambda: None)  # as where deepspeed is not installed
    with pytest.raises(SystemExit):
        bench_gpt.main(timed + ["--deepspeed", "on"])
    assert "deepspeed is not importable in this environment" in capsys.readouterr().err
    assert set(bench_gpt.main(timed)) == {"moe", "dense"}  # auto, silently
    assert "DeepSpeed" not in capsys.readouterr().out


def test_bench_gpt_times_a_third_model_with_the_other_layer_in_each_moe_block(monkeypatch, capsys):
    # this project's layer stands in for DeepSpeed's (the same constructor): the swap, the engine and the report
    built, forwards = [], []

    def stand_in(mc, ours):
        assert isinstance(ours, MoE)  # the layer it replaces, whose weights DeepSpeed's layer starts from
        layer = MoE(mc.n_embd, torch.nn.Sequential(torch.nn.Linear(mc.n_embd, mc.expert_ffn), torch.nn.GELU(),
                                                     torch.nn.Linear(mc.expert_ffn, mc.n_embd)),
                    num_experts=mc.num_experts, k=mc.top_k, capacity_factor=mc.capacity_factor,
                    min_capacity=mc.min_capacity)
        layer.register_forward_hook(lambda *_: forwards.append(1))
        built.append(layer)
        return layer

    monkeypatch.setattr(bench_gpt, "_deepspeed_layer", lambda: stand_in)
    results = bench_gpt.main(GPT_TINY + ["--n-layer", "4", "--steps", "2", "--warmup", "1", "--deepspeed", "on",
                                         "--breakdown"])
    assert set(results) == {"moe", "dense", "deepspeed"} and all(rate > 0 for rate in results.values())
    assert len(built) == 2 and len(forwards) == 2 * 3  # blocks 1 and 3, in one untimed and two timed steps
    out = capsys.readouterr().out
    (ratio,) = _numbers(r"^MoE with DeepSpeed's layer / dense tokens/s: ([0-9.]+)$", out)
    assert ratio == pytest.approx(results["deepspeed"] / results["dense"], abs=5e-4)
    (printed,) = _numbers(r"^deepspeed +[0-9,]+ parameters +[0-9,]+ active +[0-9.]+ ms/step +([0-9.]+) tokens/s$", out)
    assert printed == pytest.approx(results["deepspeed"], abs=0.51)
    pairs = r"^DeepSpeed's layer, per-step pairs \(dense / DeepSpeed ms\): median [0-9.]+"
    assert re.search(pairs, out, re.MULTILINE), out
    table = out.split("deepspeed model, parts of the timed steps:")[1].split("CPU products")[0]
    assert re.search(r"^\s+block 3 MoE\s+[0-9.]+\s+[0-9.]+$", table, re.MULTILINE), table


def test_bench_gpt_counts_a_config_files_zero_stage_3_as_without_counterpart(tmp_path):
    config = tmp_path / "engine.json"
    cfg = gpt.TrainConfig(**_parsed(GPT_TINY + ["--config", str(config)]))
    config.write_text('{"zero_optimization": {"stage": 3}}')
    assert bench_gpt.deepspeed_unfit(cfg) == f"--config {config} (ZeRO stage 3)"
    for text in ('{"zero_optimization": {"stage": 2}}', '{"zero_optimization": null}', "{}"):
        config.write_text(text)
        assert bench_gpt.deepspeed_unfit(cfg) is None, text


class _DeepSpeedShaped(torch.nn.Module):
    """DeepSpeed's MoE layer's parameter layout: a router `wg` and one Linear-GELU-Linear module per expert."""

    def __init__(self, width: int, hidden: int, experts: int):
        super().__init__()
        self.deepspeed_moe = torch.nn.Module()
        self.deepspeed_moe.gate = torch.nn.Module()
        self.deepspeed_moe.gate.wg = torch.nn.Linear(width, experts, bias=False)
        self.deepspeed_moe.experts = torch.nn.Module()
        self.deepspeed_moe.experts.deepspeed_experts = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
            for _ in range(experts))


def test_bench_gpt_copies_our_layers_router_and_each_experts_weights_into_deepspeeds_layout():
    torch.manual_seed(0)
    ours = MoE(16, torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 16)),
               num_experts=3, k=2, expert_init="per_expert_seed")
    theirs = _DeepSpeedShaped(16, 40, 3)
    bench_gpt._copy_weights(ours, theirs)
    mine = ours.deepspeed_moe.experts
    assert torch.equal(theirs.deepspeed_moe.gate.wg.weight, ours.deepspeed_moe.gate.wg.weight)
    for e, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
        assert torch.equal(expert[0].weight, mine.weight1[e]) and torch.equal(expert[0].bias, mine.bias1[e])
        assert torch.equal(expert[2].weight, mine.weight2[e]) and torch.equal(expert[2].bias, mine.bias2[e])
    x = torch.randn(5, 16)  # the same experts, so the same outputs expert by expert
    for e, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
        linear, gelu = torch.nn.functional.linear, torch.nn.functional.gelu
        ref = linear(gelu(linear(x, mine.weight1[e], mine.bias1[e])), mine.weight2[e], mine.bias2[e])
        torch.testing.assert_close(expert(x), ref, rtol=0, atol=0)


def test_bench_gpt_runs_deepspeeds_own_layer_on_the_config_from_our_layers_weights(monkeypatch):
    # where deepspeed is installed (its own virtual environment): the real layer, built and trained
    deepspeed_moe = pytest.importorskip("deepspeed.moe.layer", reason="deepspeed is not installed")
    import torch.distributed as dist

    real, made = bench_gpt._deepspeed_layer, []

    def recording():
        build = real()

        def built(mc, ours):
            layer = build(mc, ours)
            theirs, mine = layer.deepspeed_moe.experts.deepspeed_experts, ours.deepspeed_moe.experts
            pairs = [(layer.deepspeed_moe.gate.wg.weight, ours.deepspeed_moe.gate.wg.weight)]
            for e in range(mc.num_experts):
                pairs += [(theirs[e][0].weight, mine.weight1[e]), (theirs[e][0].bias, mine.bias1[e]),
                          (theirs[e][2].weight, mine.weight2[e]), (theirs[e][2].bias, mine.bias2[e])]
            made.append((layer, all(torch.equal(a, b) for a, b in pairs)))
            return layer
        return built

    monkeypatch.setattr(bench_gpt, "_deepspeed_layer", recording)
    flags = GPT_TINY + ["--ffn", "128", "--steps", "1", "--warmup", "1", "--deepspeed", "on",  # experts 32 -> 64
                        "--noisy-gate-policy", "Jitter", "--dropless", "--capacity-factor", "1.5"]
    for _ in range(2):  # run twice in one process: DeepSpeed's groups are closed at the end of each run
        results = bench_gpt.main(flags)
        assert set(results) == {"moe", "dense", "deepspeed"}
        assert not dist.is_initialized()  # the process group it opened for DeepSpeed is closed
    layer, same_weights = made[0]  # GPT_TINY's one MoE block, in each run
    assert len(made) == 2 and isinstance(layer, deepspeed_moe.MoE) and same_weights and made[1][1]
    assert "z_loss" not in layer.state_dict()
    gate = layer.deepspeed_moe.gate
    assert (gate.k, gate.capacity_factor, gate.eval_capacity_factor, gate.min_capacity, gate.noisy_gate_policy,
            gate.drop_tokens) == (2, 1.5, 2.0, 4, "Jitter", False)


def test_bench_gpt_reports_the_choices_dropped_while_timed(capsys):
    # capacity factor 0.5 with top-2: the experts hold S slots for 2 S choices, so at least half are dropped
    bench_gpt.main(GPT_TINY + ["--steps", "2", "--warmup", "1", "--capacity-factor", "0.5", "--deepspeed", "off"])
    out = capsys.readouterr().out
    (percent,) = _numbers(r"^MoE choices dropped over capacity in the timed steps: ([0-9.]+)%", out)
    assert 50.0 <= percent <= 100.0, out
