"""recipes.estimate: model states (the engine's accounting, memory_breakdown) against the ZeRO formula, activations
(measured by LiveBytes) growing with the micro-batch."""

import inspect
import re
import sys
import warnings

import pytest

from recipes import estimate, gpt

SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--ffn", "256", "--num-experts", "8", "--seq-len", "32",
         "--world-size", "16", "--ep-world-size", "4"]


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (3, "bf16"), (2, "fp32")])
def test_model_states_accounting_matches_zero_formula(stage, dtype, capsys):
    result = estimate.main(SMALL + ["--stage", str(stage), "--dtype", dtype, "--micro-batch", "2"])
    for key, expected in result["zero"].items():
        assert abs(result["model_states"][key] - expected) <= 0.05 * expected, (key, result["model_states"][key], expected)
    assert result["peak"] >= sum(result["model_states"].values()) + result["activations"]
    (peak, verdict, gpu), = _peak_lines(capsys.readouterr().out)
    assert peak == pytest.approx(result["peak"], abs=0.051e6) and (verdict, gpu) == ("fits", 80)


def _peak_lines(out: str) -> list[tuple[float, str, float]]:
    """(bytes, verdict, GPU GB) of each printed 'peak per GPU' line."""
    lines = re.findall(r"^peak per GPU +([0-9.]+) (GB|MB) +(fits|does NOT fit) in ([0-9.]+) GB$", out, re.MULTILINE)
    return [(float(size) * {"GB": 1e9, "MB": 1e6}[unit], verdict, float(gpu)) for size, unit, verdict, gpu in lines]


def test_the_verdict_compares_the_peak_with_the_gpu_memory(capsys):
    result = estimate.main(SMALL + ["--micro-batch", "2"])
    (peak, _, _), = _peak_lines(capsys.readouterr().out)
    for gpu_gb, verdict in ((2 * peak / 1e9, "fits"), (peak / 2 / 1e9, "does NOT fit")):
        assert estimate.main(SMALL + ["--micro-batch", "2", "--gpu-memory-gb", str(gpu_gb)])["peak"] == result["peak"]
        assert _peak_lines(capsys.readouterr().out) == [(peak, verdict, pytest.approx(gpu_gb, rel=1e-5))]


def test_measured_activations_grow_with_the_micro_batch():
    a2, a4, a8 = (estimate.main(SMALL + ["--micro-batch", str(b)]) for b in (2, 4, 8))
    assert a2["model_states"] == a4["model_states"] == a8["model_states"]
    assert a2["activations"] < a4["activations"] < a8["activations"]
    per_sequence = (a4["activations"] - a2["activations"]) / 2  # linear in the micro-batch beyond a fixed part
    assert abs((a8["activations"] - a4["activations"]) - 4 * per_sequence) <= 0.1 * 4 * per_sequence


def test_bad_flags_stop_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        estimate.main(SMALL + ["--ep-world-size", "3"])
    assert stop.value.code == 2
    assert "--ep-world-size (3) must divide --world-size (16)" in capsys.readouterr().err


def test_the_gpt_recipes_router_and_shared_expert_flags_reach_the_model():
    """A shared expert adds dense parameters (and the bytes ZeRO counts for them); --dense leaves no experts;
    group-limited routing with per-rank exchange and expert choice run through the simulated step."""
    plain = estimate.main(SMALL + ["--micro-batch", "2"])
    shared = estimate.main(SMALL + ["--micro-batch", "2", "--n-shared-experts", "1", "--shared-expert-gate"])
    # one shared expert as wide as a routed one (ffn / top-k), plus its gate's [1, width] weight
    width, expert = 64, 256 // 2
    per_block = (width * expert + expert) + (expert * width + width) + width
    assert shared["dense_params"] - plain["dense_params"] == per_block  # SMALL: 2 blocks, MoE in the second
    assert shared["expert_params"] == plain["expert_params"]
    assert shared["model_states"]["parameters"] > plain["model_states"]["parameters"]
    dense = estimate.main(SMALL[:-2] + ["--micro-batch", "2", "--dense"])
    assert dense["expert_params"] == 0 and dense["dense_params"] < plain["dense_params"] + plain["expert_params"]
    for flags in (["--n-group", "4", "--topk-group", "2", "--exchange", "per_rank", "--scoring-func", "sigmoid"],
                  ["--routing", "expert_choice", "--stage", "2"]):
        assert estimate.main(SMALL + ["--micro-batch", "2"] + flags)["peak"] > 0, flags


def test_every_router_flag_reaches_the_gpt_model_it_estimates():
    """Each of ROUTER_FLAGS set away from its default arrives in the model's config (--dense as no MoE block)."""
    changed = {"dense": True, "min_capacity": 7, "n_shared_experts": 2, "shared_expert_gate": True,
               "scoring_func": "sigmoid", "norm_topk_prob": "false", "routed_scaling_factor": 2.5,
               "bias_update_speed": 1e-3, "load_balancing_type": "seq_aux_loss", "n_group": 4, "topk_group": 2,
               "routing": "expert_choice", "exchange": "per_rank"}
    assert set(changed) == set(estimate.ROUTER_FLAGS)
    default = gpt.model_config(estimate._train_config(estimate.EstimateConfig()))
    for name, value in changed.items():
        model = gpt.model_config(estimate._train_config(estimate.EstimateConfig(**{name: value})))
        if name == "dense":
            assert model.moe_every == 0 and default.moe_every == 2
        else:
            assert getattr(model, name) == value != getattr(default, name), name


@pytest.mark.parametrize("argv, message", [
    (["--ep-world-size", "3"], r"--ep-world-size \(3\) must divide --world-size \(16\)"),
    (["--n-group", "3", "--topk-group", "1"], r"--n-group \(3\) must divide --num-experts \(8\)"),
    (["--dense"], r"--dense has no experts to spread: use --ep-world-size 1, got 4"),
    (["--n-group", "4"], r"needs both --n-group and --topk-group \(0: off\), got --n-group 4 and --topk-group 0"),
    (["--micro-batch", "1", "--seq-len", "2"], r"--micro-batch x --seq-len \(1 x 2 = 2 tokens a micro-batch\) must "
                                               r"be at least --min-capacity \(4\)"),
])
def test_bad_model_flags_stop_with_one_line_naming_the_flags(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        estimate.main(SMALL + argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_the_estimate_runs_without_triton_installed(monkeypatch):
    """A plain `pip install -e .` has no Triton: the simulated GPU world takes the kernels' shape-only
    implementations on meta tensors, which need no compiler, so the estimate runs all the same."""
    from kernels import backend

    monkeypatch.setattr(backend, "_triton_importable", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)  # and any import of it fails
    without = estimate.main(SMALL + ["--micro-batch", "2"])
    monkeypatch.undo()
    assert estimate.main(SMALL + ["--micro-batch", "2"]) == without  # the same figures as with Triton


def _fully_shard_warns_on_views() -> bool:
    """Whether the running torch's fully_shard warns when a module returns a view (2.13's does, 2.11's not)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_state

    return "returned a view tensor" in inspect.getsource(_fsdp_state)


@pytest.mark.parametrize("quiet", [True, False])
def test_stage_3_prints_no_view_warning_for_the_experts(quiet, monkeypatch):
    """fully_shard warns when a module returns a view; the padded experts' [N, M] view of their product is
    only read by the layer, so that warning (printed by every stage-3 process) is silenced, and only it
    (without the filter, the control, it shows where the running torch warns at all)."""
    from optim import fsdp

    if not quiet:
        monkeypatch.setattr(fsdp, "_quiet_view_warning", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # every warning shows, whatever earlier tests printed
        estimate.main(SMALL + ["--stage", "3", "--dtype", "bf16", "--micro-batch", "2"])
        warnings.warn("FSDP2-wrapped module (FSDPBlock) returned a view tensor", UserWarning)
    views = {str(w.message).split(")")[0] for w in caught if "returned a view tensor" in str(w.message)}
    shown = not quiet and _fully_shard_warns_on_views()
    assert views == {"FSDP2-wrapped module (FSDPBlock"} | ({"FSDP2-wrapped module (FSDPExperts"} if shown else set())
