"""recipes.ablate at a tiny size: every variant trains on the same batches at equal active compute, the
table and TensorBoard runs are written, bad variants and combinations stop before anything trains."""

import re
import statistics

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes import ablate

TINY = ["--steps", "4", "--batch-size", "4", "--gradient-accumulation-steps", "2", "--seq-len", "16",
        "--n-layer", "2", "--n-embd", "32", "--ffn", "64", "--num-experts", "4", "--top-k", "2",
        "--eval-interval", "2", "--eval-batches", "2"]


def test_every_variant_runs_at_equal_active_compute_and_writes_table_and_runs(tmp_path):
    out = tmp_path / "table.md"
    rows = ablate.main(TINY + ["--log-dir", str(tmp_path), "--out", str(out)])
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == list(ablate.VARIANTS)

    dense_active = by_name["dense"]["active"]
    for name, row in by_name.items():
        # routers (E x M) and one output bias per routed expert are the only extra active parameters
        extra = row["active"] - dense_active
        assert 0 <= extra <= 4 * 4 * 32 + 8 * 32, (name, row["active"], dense_active)
        assert len(row["val_loss"]) == 1 and 0 < row["val_loss"][0] < 6
        assert row["tokens_per_s"][0] > 0
        if name == "dense":
            assert row["max_vio"] == [] and row["dropped"] == []
        else:
            assert row["total"] > row["active"]
            assert len(row["max_vio"]) == 1 and row["max_vio"][0] >= 0
            assert 0 <= row["dropped"][0] < 1
    assert by_name["expert_choice"]["max_vio"] == [0.0]  # every expert takes exactly C tokens

    table = out.read_text()
    assert table.count("\n| ") == len(ablate.VARIANTS) + 2  # header, separator and one row per variant
    assert "| dense: dense twin, ffn 64 | 34,048 | 34,048 |" in table
    assert "| fine_grained: 16 experts of width 8, top-8 |" in table
    assert not (tmp_path / "table.md.partial").exists()
    for name in ablate.VARIANTS:  # one TensorBoard run per variant, side by side
        board = EventAccumulator(str(tmp_path / name), size_guidance={"scalars": 0})
        board.Reload()
        assert [e.step for e in board.Scalars("Train/loss")] == [1, 2, 3, 4]
        assert ("MoE/max_vio" in board.Tags()["scalars"]) == (name != "dense")


def test_variants_see_the_same_batches_and_seeds_give_mean_and_spread(tmp_path):
    """Two variants that differ only in how the load-balancing loss is counted start alike; two seeds
    give two runs per variant and a +- column. The aux coefficient is 0: Train/loss is the loss the
    engine backpropagates, aux term included, and the two variants' aux losses differ by design (by
    a few parts per million of the loss at coefficient 0.01)."""
    rows = ablate.main(TINY + ["--steps", "2", "--aux-coef", "0", "--variants", "softmax_aux", "global_aux",
                               "--seeds", "0", "1", "--log-dir", str(tmp_path), "--out", str(tmp_path / "t.md")])
    assert [len(row["val_loss"]) for row in rows] == [2, 2]
    assert (tmp_path / "softmax_aux-seed1").is_dir() and (tmp_path / "global_aux-seed0").is_dir()
    number = r"([0-9.]+) \+- ([0-9.]+)"
    cells = re.findall(rf"^\| (\w+): .*? \| {number} \| {number} \| ", (tmp_path / "t.md").read_text(), re.MULTILINE)
    assert [cell[0] for cell in cells] == ["softmax_aux", "global_aux"]
    for (_, *figures), row in zip(cells, rows):  # final validation loss and MaxVio: mean +- spread over the seeds
        loss, loss_spread, max_vio, max_vio_spread = map(float, figures)
        assert (loss, loss_spread) == pytest.approx(
            (statistics.fmean(row["val_loss"]), statistics.stdev(row["val_loss"])), abs=5e-5)
        assert (max_vio, max_vio_spread) == pytest.approx(
            (statistics.fmean(row["max_vio"]), statistics.stdev(row["max_vio"])), abs=5e-4)
        assert max_vio_spread > 0  # the seeds route differently
    first = EventAccumulator(str(tmp_path / "softmax_aux-seed0"), size_guidance={"scalars": 0})
    second = EventAccumulator(str(tmp_path / "global_aux-seed0"), size_guidance={"scalars": 0})
    first.Reload(), second.Reload()
    # step 1's loss is taken before any update: same data, same model, the same bits
    assert first.Scalars("Train/loss")[0].value == second.Scalars("Train/loss")[0].value


def test_tail_mean_takes_the_last_tenth_of_steps():
    history = [(step, float(step)) for step in range(1, 21)]
    assert ablate.tail_mean(history, 20) == pytest.approx(19.5)  # steps 19 and 20
    assert ablate.tail_mean(history[:3], 3) == 3.0               # at least one step
    assert ablate.tail_mean([], 10) is None


@pytest.mark.parametrize("argv, message", [
    (["--variants", "dense", "sigmoid"], "--variants sigmoid: unknown; valid: dense softmax_aux"),
    (["--variants", "dense", "dense"], "--variants and --seeds must not repeat"),
    (["--top-k", "9"], r"--top-k \(9\) must be between 1 and --num-experts \(8\)"),
    (["--variants", "expert_choice", "--load-balancing-type", "seq_aux_loss"],
     "variant expert_choice: recipes.gpt: error: routing='expert_choice'"),
    (["--variants", "dense", "--n-embd", "30", "--n-head", "4"],
     r"--n-embd \(30\) must be divisible by --n-head \(4\)"),
    (["--variants", "dense", "--seed", "3"], r"--seed is set per run by recipes.ablate \(use --seeds\)"),
])
def test_bad_flags_stop_with_one_line_before_training(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ablate.main(argv + ["--log-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "t.md")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err), err
    assert not (tmp_path / "t.md").exists() and not any((tmp_path / "runs").glob("*/events*"))
