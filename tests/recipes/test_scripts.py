"""The demo and the benchmarks run end to end at tiny sizes; what they print is what they measured."""

import importlib
import math
import re
import subprocess
import sys

import pytest

from recipes import bench_moe, demo


def _floats(*groups: str) -> list[float]:
    return [float(g.replace(",", "")) for g in groups]


def test_demo_trains_and_the_moe_beats_its_dense_twin():
    result = demo.main(["--steps", "400", "--batch", "256", "--log-interval", "50"])
    assert result["moe"] < result["dense"]


@pytest.mark.parametrize("flags", [[], ["--input-grad"]], ids=["first-layer", "input-grad"])
def test_benchmark_prints_the_figures_it_returns(capsys, flags):
    tokens, k = 256, 2
    results = bench_moe.main(["--tokens", str(tokens), "--hidden", "32", "--ffn", "64", "--experts", "4", "--k", str(k),
                              "--steps", "2", "--warmup", "1", "--deepspeed", "off", *flags])
    row = re.search(r"^ours +([0-9.]+) ms/step +([0-9.]+) tokens/s  peak +([0-9.]+) MiB  expert matmuls alone +"
                    r"([0-9.]+) ms on (\d+) rows = +([0-9.]+)% of the step$", capsys.readouterr().out, re.MULTILINE)
    assert row, "the row of our layer"
    ms, tokens_per_s, peak_mib, matmul_ms, rows, percent = _floats(*row.groups())
    ours = results["ours"]
    assert ours["ms"] > 0 and ours["matmul_ms"] > 0 and ours["peak_bytes"] > 0
    assert (ms, matmul_ms) == (pytest.approx(ours["ms"], abs=0.051), pytest.approx(ours["matmul_ms"], abs=0.051))
    assert tokens_per_s == pytest.approx(tokens / ours["ms"] * 1e3, abs=0.51)
    assert peak_mib == pytest.approx(ours["peak_bytes"] / 2**20, abs=0.051)
    assert percent == pytest.approx(100 * ours["matmul_ms"] / ours["ms"], abs=0.051)
    assert tokens <= rows <= tokens * k  # the expert rows are the kept choices; few are dropped at capacity 1.25
    # the step holds at once at least the dispatch buffer and the experts' hidden rows (kept for the backward):
    # a measure of bytes held, not of resident growth (none once freed memory is kept, as from the second run here)
    assert ours["peak_bytes"] >= rows * (32 + 64) * 4


def test_kernel_benchmark_reports_bandwidth_from_the_bytes_each_op_moves(capsys):
    from recipes import bench_kernels

    S, K, M, E, capacity_factor = 64, 2, 32, 4, 1.25
    results = bench_kernels.main(["--tokens", str(S), "--hidden", str(M), "--experts", str(E), "--k", str(K),
                                  "--capacity-factor", str(capacity_factor), "--steps", "1", "--warmup", "0",
                                  "--dtype", "fp32", "--device", "cpu"])
    printed = {name: _floats(*figures) for name, *figures in re.findall(
        r"^(\S.*?) +([0-9.]+) ms +([0-9.]+) GB/s +([0-9.]+)% of copy$", capsys.readouterr().out, re.MULTILINE)}
    assert set(printed) == {"permute (torch)", "permute (reference)", "unpermute_combine (torch)",
                            "unpermute_combine (reference)"}
    copy = results["copy"]
    assert copy["gbs"] == pytest.approx(copy["bytes"] / copy["ms"] / 1e6)
    for name, (ms, gbs, percent) in printed.items():
        row = results[name]
        assert row["gbs"] == pytest.approx(row["bytes"] / row["ms"] / 1e6), name
        assert (ms, gbs) == (pytest.approx(row["ms"], abs=6e-4), pytest.approx(row["gbs"], abs=0.051)), name
        assert percent == pytest.approx(100 * row["gbs"] / copy["gbs"], abs=0.051), name
    # permute reads each kept row and writes the whole buffer (E x capacity rows); combine reads each kept row
    # and writes every token: the same kept rows in both
    rows_N = E * math.ceil(S * K * capacity_factor / E)
    kept_permute = results["permute (torch)"]["bytes"] / (M * 4) - rows_N
    kept_combine = results["unpermute_combine (torch)"]["bytes"] / (M * 4) - S
    assert kept_permute == kept_combine and 0 < kept_permute <= S * K
    assert results["permute (reference)"]["bytes"] == results["permute (torch)"]["bytes"]


def test_demo_under_torchrun_with_expert_parallelism(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "recipes.demo", "--experts", "4", "--ep-world-size", "2", "--steps", "20", "--log-interval", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.findall(r"^rank (\d): holds experts (\d+)\.\.(\d+); its tokens went to experts \[([0-9, ]+)\] in the "
                       r"last step$", done.stdout, re.MULTILINE)  # whole lines: rank 0 prints every rank's
    assert [int(rank) for rank, *_ in found] == [0, 1], done.stdout  # once each, in rank order
    held = {int(rank): (int(first), int(last), [int(c) for c in counts.split(",")])
            for rank, first, last, counts in found}
    assert [held[rank][:2] for rank in (0, 1)] == [(0, 1), (2, 3)]  # blocks of experts / ep_size, in rank order
    for _, _, counts in held.values():  # a rank's tokens, by global expert: at most one choice per token (k = 1)
        assert len(counts) == 4 and 0 < sum(counts) <= 512
    bad = subprocess.run([sys.executable, "-m", "recipes.demo", "--ep-world-size", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--ep-world-size (3) must divide" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("argv, message", [
    (["--ep-world-size", "0"], "--ep-world-size must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--k", "0"], "--k must be at least 1, got 0"),
    (["--k", "5"], "--k (5) must be at most --experts (4)"),
    (["--capacity-factor", "-1"], "--capacity-factor must be a positive finite number, got -1.0"),
])
def test_demo_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        demo.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_engine_benchmark_matches_the_zero_accounting_in_one_process(capsys):
    from recipes import bench_engine

    rows = bench_engine.main(["--blocks", "2", "--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64",
                              "--steps", "1", "--warmup", "1", "--stages", "0", "1", "2", "3", "--deepspeed", "off"])
    printed = {int(stage): _floats(*figures) for stage, *figures in re.findall(
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


@pytest.mark.parametrize("module, argv, message", [
    ("bench_routing", ["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    ("bench_routing", ["--k", "99"], "--k (99) must be between 1 and --experts (64)"),
    ("bench_routing", ["--ep", "3"], "--experts (64) must be divisible by --ep (3)"),
    ("bench_moe", ["--experts", "0"], "--experts must be at least 1, got 0"),
    ("bench_moe", ["--k", "3", "--experts", "2"], "--k (3) must be between 1 and --experts (2)"),
    ("bench_moe", ["--capacity-factor", "0"], "--capacity-factor must be a positive finite number, got 0.0"),
    ("bench_moe", ["--tokens", "2"], "--tokens (2) must be at least 4, the layers' min_capacity"),
    ("bench_moe", ["--warmup", "-1"], "--warmup must be 0 or more, got -1"),
])
def test_benchmark_flags_that_cannot_work_stop_with_one_line(module, argv, message, capsys):
    bench = importlib.import_module(f"recipes.{module}")
    with pytest.raises(SystemExit) as stop:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"recipes.{module}: error: "), err
    assert message in err, err
