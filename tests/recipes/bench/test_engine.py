"""recipes.bench.engine: in one process every ZeRO stage holds the model states the ZeRO accounting gives."""

import re

import pytest

from recipes.bench import engine as bench_engine
from tests.recipes.bench import floats


def test_engine_benchmark_matches_the_zero_accounting_in_one_process(capsys):
    rows = bench_engine.main(["--blocks", "2", "--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64",
                              "--steps", "1", "--warmup", "1", "--stages", "0", "1", "2", "3", "--deepspeed", "off"])
    printed = {int(stage): floats(*figures) for stage, *figures in re.findall(
        r"^stage (\d): ours +([0-9.]+) ms +\| ours step peak +([0-9.]+) MiB, model states +([0-9.]+) MiB "
        r"\(ZeRO says +([0-9.]+)\)$", capsys.readouterr().out, re.MULTILINE)}
    assert len(rows) == 4 and sorted(printed) == [row["stage"] for row in rows] == [0, 1, 2, 3]
    for row in rows:  # one process: nothing to shard, so every stage holds everything
        assert abs(row["model_states"] - row["zero"]) <= 0.01 * row["zero"], row
        assert row["ms"]["ours"] > 0 and row["peak"]["ours"] > 0 and "deepspeed" not in row["ms"]
        ms, peak, states, zero = printed[row["stage"]]
        assert ms == pytest.approx(row["ms"]["ours"], abs=0.051)
        assert (peak, states, zero) == pytest.approx(
            (row["peak"]["ours"] / 2**20, row["model_states"] / 2**20, row["zero"] / 2**20), abs=0.051)
