"""recipes.gpu_report: on a CPU it runs at tiny sizes, writes one record per part with the environment,
and records what needs CUDA (the tests, CUDA graphs) as not run, with the reason; on CUDA it passes
the flags each mode needs; pytest's closing line becomes counts."""

import contextlib
import io
import subprocess

import pytest
import torch

from recipes import gpu_report, report
from recipes.common.records import FIELDS, load_records
from recipes.common.training import cpu_name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The report run once on the CPU (the tests' DS_ACCELERATOR is cpu) without --tiny: (exit, output, records)."""
    folder = tmp_path_factory.mktemp("records")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = gpu_report.main(["--record-dir", str(folder)])
    found = {r["benchmark"]: r for r in load_records(folder)}
    return code, out.getvalue(), found, folder


@pytest.mark.slow
def test_each_part_writes_a_record_with_the_environment(tiny_run):
    code, output, found, _ = tiny_run
    assert code == 0, output[-3000:]
    assert "no CUDA device: --tiny" in output
    assert sorted(found) == [f"gpu_report_{part}" for part in sorted(gpu_report.PARTS)]
    for record in found.values():
        assert set(FIELDS) <= set(record)
        assert record["machine"] == cpu_name() and record["torch"] == torch.__version__
        assert record["command"] == "python -m recipes.gpu_report" and record["commit"] and record["date"]
        assert record["notes"].startswith("tiny sizes")
        env = record["figures"]["environment"]
        assert env["device"] == cpu_name() and env["torch"] == torch.__version__
        assert env["cuda"] is None and env["driver"] is None  # versions only where a GPU is
        assert record["figures"]["table"] and all(row["status"] in ("ran", "not run") for row in record["figures"]["table"])


@pytest.mark.slow
def test_what_needs_cuda_is_recorded_as_not_run_with_the_reason(tiny_run):
    _, _, found, _ = tiny_run
    assert found["gpu_report_tests"]["figures"]["table"] == [
        {"command": "python -m pytest -q -m gpu -p no:cacheprovider", "status": "not run", "reason": "no CUDA device"}]
    rows = {(row["size"], row["mode"]): row for row in found["gpu_report_gpt"]["figures"]["table"]}
    assert sorted({size for size, _ in rows}) == sorted(gpu_report.TINY_GPT_SIZES)
    for (size, mode), row in rows.items():
        if mode == "eager":
            assert row["status"] == "ran" and row["moe_over_dense"] == pytest.approx(
                row["moe_tokens_per_s"] / row["dense_tokens_per_s"]) and row["moe_over_dense"] > 0
        elif mode == "graphed":
            assert (row["status"], row["reason"]) == ("not run", "CUDA graphs need a CUDA device")
        else:
            assert row["status"] == "not run" and row["reason"].startswith("--tiny")


@pytest.mark.slow
def test_kernels_and_moe_rows_hold_their_figures(tiny_run):
    _, output, found, _ = tiny_run
    kernels = {row["op"]: row for row in found["gpu_report_kernels"]["figures"]["table"]}
    assert {"copy", "permute (torch)", "unpermute_combine (torch)"} <= set(kernels)
    assert kernels["copy"]["share_of_copy"] == 1.0 and all(row["ms"] > 0 for row in kernels.values())
    rows = found["gpu_report_moe"]["figures"]["table"]
    assert [row["size"] for row in rows[::4]] == [size.name for size in gpu_report.TINY_MOE_SIZES]
    for row in rows:
        if row["layer"].startswith("ours"):
            assert row["status"] == "ran" and row["ms"] > 0 and row["step_peak_mib"] > 0
        elif row["status"] == "not run":  # torchtitan or deepspeed is not installed here
            assert "is not importable here" in row["reason"]
        else:
            assert row["status"] == "ran" and row["agrees"] is True
    assert "moe      Mixtral-like (tiny) ours (dropless)" in output  # the summary table


@pytest.mark.slow
def test_report_renders_the_records_in_one_section(tiny_run):
    _, _, _, folder = tiny_run
    page = report.render(report.latest(load_records(folder)))
    assert page.count("## gpu_report\n") == 1 and "## gpu_report_" not in page
    for part in gpu_report.PARTS:
        assert f"### {part}, {cpu_name()}: `python -m recipes.gpu_report`" in page
    assert "| python -m pytest -q -m gpu -p no:cacheprovider | not run | no CUDA device |" in page


def test_on_cuda_each_mode_passes_its_flag():
    cfg = gpu_report.ReportConfig(steps=20)
    rows = {(row["size"], row["mode"]): row for row in gpu_report.gpt_rows(cfg, torch.device("cuda"))}
    assert sorted({size for size, _ in rows}) == sorted(gpu_report.GPT_SIZES)
    wide = rows["width 1024, 16 experts", "eager"]["flags"].split()
    assert wide[:wide.index("--deepspeed")] == ["--n-embd", "1024", "--n-head", "16", "--ffn", "4096",
                                                "--num-experts", "16"]
    for (size, mode), row in rows.items():
        flags = row["flags"].split()
        assert flags[-2:] == ["--dtype", "bf16"] and "--steps" in flags and "--warmup" not in flags
        assert ("--compile" in flags) == (mode == "compiled") and ("--cuda-graphs" in flags) == (mode == "graphed")
    assert all(row["status"] is None for row in rows.values())  # every mode is run on a GPU


@pytest.mark.parametrize("line, counts", [
    ("1 failed, 3 passed, 2 skipped in 1.20s", {"failed": 1, "passed": 3, "skipped": 2}),
    ("==== 5 passed, 100 deselected, 1 error in 3.4s ====", {"passed": 5, "deselected": 100, "error": 1}),
    ("2 errors in 0.5s", {"error": 2}),
    ("no tests ran in 0.01s", {}),
])
def test_pytest_counts_reads_the_closing_line(line, counts):
    assert gpu_report.pytest_counts("tests/a.py ..F\n" + line + "\n") == counts


@pytest.mark.parametrize("exit_code, stdout, row", [
    (1, "FAILED tests/kernels/test_permute.py::test_x[cuda] - AssertionError\n1 failed, 3 passed in 2.0s\n",
     {"status": "ran", "exit_code": 1, "failed": 1, "passed": 3,
      "failed_tests": ["tests/kernels/test_permute.py::test_x[cuda]"]}),
    (5, "no tests ran in 0.01s\n", {"status": "ran", "exit_code": 5, "failed_tests": []}),
    (4, "ERROR: file or directory not found\n", {"status": "failed", "exit_code": 4, "failed_tests": []}),
])
def test_on_cuda_the_tests_part_records_pytests_outcome(monkeypatch, exit_code, stdout, row):
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, exit_code, stdout=stdout, stderr="")

    monkeypatch.setattr(gpu_report.subprocess, "run", run)
    (found,) = gpu_report.run_tests(gpu_report.ReportConfig(), torch.device("cuda"))
    assert calls[0][1:] == ["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    assert {key: value for key, value in found.items() if key not in ("command", "seconds")} == row
    assert gpu_report.failed({"tests": [found]}) == (exit_code != 5)


def test_a_part_not_in_the_list_stops_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_report.main(["--parts", "moe", "bench"])
    assert stop.value.code == 2
    assert "recipes.gpu_report: error: --parts must be among ['tests', 'kernels', 'moe', 'gpt'], got ['bench']" in (
        capsys.readouterr().err)
