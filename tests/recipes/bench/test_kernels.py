"""recipes.bench.kernels: bandwidth from the bytes each dispatch op moves, printed as measured."""

import math
import re

import pytest

from recipes.bench import kernels as bench_kernels
from tests.recipes.bench import floats


def test_kernel_benchmark_reports_bandwidth_from_the_bytes_each_op_moves(capsys):
    S, K, M, E, capacity_factor = 64, 2, 32, 4, 1.25
    results = bench_kernels.main(["--tokens", str(S), "--hidden", str(M), "--experts", str(E), "--k", str(K),
                                  "--capacity-factor", str(capacity_factor), "--steps", "1", "--warmup", "0",
                                  "--dtype", "fp32", "--device", "cpu"])
    printed = {name: floats(*figures) for name, *figures in re.findall(
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
