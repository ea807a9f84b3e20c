"""recipes.estimate: model states (the engine's accounting, memory_breakdown) against the ZeRO formula, activations
(measured by LiveBytes) growing with the micro-batch."""

import pytest

from recipes import estimate

SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--ffn", "256", "--num-experts", "8", "--seq-len", "32",
         "--world-size", "16", "--ep-world-size", "4"]


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (3, "bf16"), (2, "fp32")])
def test_model_states_accounting_matches_zero_formula(stage, dtype, capsys):
    result = estimate.main(SMALL + ["--stage", str(stage), "--dtype", dtype, "--micro-batch", "2"])
    for key, expected in result["zero"].items():
        assert abs(result["model_states"][key] - expected) <= 0.05 * expected, (key, result["model_states"][key], expected)
    printed = capsys.readouterr().out
    assert "peak per GPU" in printed and "fits in 80 GB" in printed
    assert result["peak"] >= sum(result["model_states"].values()) + result["activations"]


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
