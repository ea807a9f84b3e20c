"""recipes.bench.moe: the figures it prints are the ones it measured; flags that cannot work stop in one line."""

import re

import pytest

from recipes.bench import moe as bench_moe
from tests.recipes.bench import floats


@pytest.mark.parametrize("flags", [[], ["--input-grad"]], ids=["first-layer", "input-grad"])
def test_benchmark_prints_the_figures_it_returns(capsys, flags):
    tokens, k = 256, 2
    results = bench_moe.main(["--tokens", str(tokens), "--hidden", "32", "--ffn", "64", "--experts", "4", "--k", str(k),
                              "--steps", "2", "--warmup", "1", "--deepspeed", "off", *flags])
    row = re.search(r"^ours +([0-9.]+) ms/step +([0-9.]+) tokens/s  peak +([0-9.]+) MiB  expert matmuls alone +"
                    r"([0-9.]+) ms on (\d+) rows = +([0-9.]+)% of the step$", capsys.readouterr().out, re.MULTILINE)
    assert row, "the row of our layer"
    ms, tokens_per_s, peak_mib, matmul_ms, rows, percent = floats(*row.groups())
    ours = results["ours"]
    assert ours["ms"] > 0 and ours["matmul_ms"] > 0 and ours["peak_bytes"] > 0
    assert (ms, matmul_ms) == (pytest.approx(ours["ms"], abs=0.051), pytest.approx(ours["matmul_ms"], abs=0.051))
    assert tokens_per_s == pytest.approx(tokens / ours["ms"] * 1e3, abs=0.51)
    assert peak_mib == pytest.approx(ours["peak_bytes"] / 2**20, abs=0.051)
    assert percent == pytest.approx(100 * ours["matmul_ms"] / ours["ms"], abs=0.051)
    assert tokens <= rows <= tokens * k  # the expert rows are the kept choices; few are dropped at capacity 1.25
    # the step holds at once at least the dispatch buffer and the experts' hidden rows (kept for the backward):
    # a measure of bytes held, not of resident growth (none once freed memory is kept, as it is after one run in this process)
    assert ours["peak_bytes"] >= rows * (32 + 64) * 4


@pytest.mark.parametrize("argv, message", [
    (["--experts", "0"], "--experts must be at least 1, got 0"),
    (["--k", "3", "--experts", "2"], "--k (3) must be between 1 and --experts (2)"),
    (["--capacity-factor", "0"], "--capacity-factor must be a positive finite number, got 0.0"),
    (["--tokens", "2"], "--tokens (2) must be at least 4, the layers' min_capacity"),
    (["--warmup", "-1"], "--warmup must be 0 or more, got -1"),
])
def test_flags_that_cannot_work_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_moe.main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("recipes.bench.moe: error: "), err
    assert message in err, err
