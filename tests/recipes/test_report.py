"""recipes.report: the committed page is the render of the committed records; records written by
write_record and by a benchmark's --record-dir load and render."""

import json
from pathlib import Path

from recipes import report
from recipes.bench import routing as bench_routing
from recipes.common.records import FIELDS, load_records, write_record

ROOT = Path(__file__).resolve().parents[2]


def test_committed_page_and_readme_block_are_the_render_of_the_committed_records():
    records = report.latest(load_records(ROOT / "results"))
    assert (ROOT / "docs" / "results.md").read_text() == report.render(records)
    readme = (ROOT / "README.md").read_text()
    block = report.readme_block(readme, records)
    assert block is None or block == readme
    for name in report.plot_names(records):
        assert (ROOT / "docs" / "results" / name).exists(), name


def test_check_passes_on_the_committed_tree(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert report.main(["--check"]) == 0


def test_check_fails_on_a_stale_page(tmp_path):
    write_record("bench_demo", "python -m demo", {"ours": {"ms": 1.0}, "deepspeed": {"ms": 2.0}}, tmp_path / "r")
    (tmp_path / "page.md").write_text("old\n")
    assert report.main(["--check", "--results", str(tmp_path / "r"), "--out", str(tmp_path / "page.md"),
                        "--readme", str(tmp_path / "none.md")]) == 1


def test_a_written_record_loads_and_renders(tmp_path):
    path = write_record("bench_demo", "python -m demo --x 1", [{"speedup": 1.5, "stage": 0}], tmp_path,
                        notes="a note", date="2026-01-02", commit="abc1234")
    again = write_record("bench_demo", "python -m demo --x 1", [{"speedup": 2.0, "stage": 0}], tmp_path,
                         date="2026-01-02", commit="abc1234")
    assert path != again and path.parent == tmp_path / "bench_demo"
    records = load_records(tmp_path)
    assert all(set(FIELDS) <= set(r) for r in records)
    assert [r.get("notes") for r in records if r["path"] == path.relative_to(tmp_path).as_posix()] == ["a note"]
    newest = report.latest(records)
    assert len(newest) == 1 and newest[0]["figures"][0]["speedup"] == 2.0
    page = report.render(newest)
    assert "## bench_demo" in page and "abc1234" in page and "| 2.0 | 0 |" in page
    assert report.speedups(newest[0]) == [("stage 0", 2.0)]


def test_the_glance_block_replaces_the_text_between_the_markers(tmp_path):
    write_record("bench_engine", "torchrun -m recipes.bench.engine", [{"stage": 1, "speedup": 1.25}], tmp_path,
                 date="2026-01-02", commit="abc1234", machine="Some CPU")
    records = report.latest(load_records(tmp_path))
    readme = f"intro\n{report.GLANCE_START}\nold table\n{report.GLANCE_END}\nrest\n"
    block = report.readme_block(readme, records)
    assert block.startswith("intro\n" + report.GLANCE_START + "\n| benchmark |") and block.endswith(
        report.GLANCE_END + "\nrest\n")
    assert "| bench_engine | Some CPU | stage 1: 1.25x | 2026-01-02 | abc1234 |" in block and "old table" not in block


def test_a_benchmark_with_record_dir_writes_a_valid_record(tmp_path, capsys):
    rows = bench_routing.main(["--tokens", "64", "--experts", "8", "--k", "2", "--ep", "4", "--hidden", "8",
                               "--record-dir", str(tmp_path)])
    (path,) = (tmp_path / "bench_routing").glob("*.json")
    record = json.loads(path.read_text())
    assert set(FIELDS) <= set(record) and record["benchmark"] == "bench_routing"
    assert record["command"] == "python -m recipes.bench.routing --tokens 64 --experts 8 --k 2 --ep 4 --hidden 8"
    assert record["figures"] == json.loads(json.dumps(rows))
    assert f"record written to {path}" in capsys.readouterr().out
    assert "## bench_routing" in report.render(report.latest(load_records(tmp_path)))


def test_without_record_dir_a_benchmark_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bench_routing.main(["--tokens", "64", "--experts", "8", "--k", "2", "--ep", "4", "--hidden", "8"])
    assert list(tmp_path.iterdir()) == []


def test_gpu_report_records_share_a_section_with_their_versions_and_headlines(tmp_path):
    env = {"device": "Some GPU", "torch": "2.13.0", "cuda": "12.8", "driver": "570.1", "triton": "3.4.0"}
    moe_rows = [{"size": "Mixtral-like", "layer": "ours (dropless)", "status": "ran", "ms": 10.0},
                {"size": "Mixtral-like", "layer": "torchtitan (dropless)", "status": "ran", "ms": 20.0},
                {"size": "Mixtral-like", "layer": "ours (capacity)", "status": "ran", "ms": 8.0},
                {"size": "Mixtral-like", "layer": "deepspeed (capacity)", "status": "ran", "ms": 12.0},
                {"size": "DeepSeek-like", "layer": "ours (dropless)", "status": "ran", "ms": 5.0},
                {"size": "DeepSeek-like", "layer": "torchtitan (dropless)", "status": "not run", "ms": None,
                 "reason": "torchtitan is not importable here"}]
    gpt_rows = [{"size": "default", "mode": "eager", "status": "ran", "moe_over_dense": 0.5},
                {"size": "default", "mode": "graphed", "status": "not run", "moe_over_dense": None}]
    tests_rows = [{"command": "python -m pytest -q -m gpu", "status": "ran", "passed": 40, "failed": 1}]
    for part, rows in (("moe", moe_rows), ("gpt", gpt_rows), ("tests", tests_rows)):
        write_record(f"gpu_report_{part}", "python -m recipes.gpu_report", {"environment": env, "table": rows},
                     tmp_path, machine="Some GPU", torch="2.13.0", date="2026-01-02", commit="abc1234")
    records = report.latest(load_records(tmp_path))
    assert [r["benchmark"] for r in records] == ["gpu_report_tests", "gpu_report_moe", "gpu_report_gpt"]
    assert [report.headline(r) for r in records] == [
        "40 passed, 1 failed", "Mixtral-like: over torchtitan 2.00x, over deepspeed 1.50x", "default eager 0.500"]
    page = report.render(records)
    assert page.count("## gpu_report\n") == 1 and report.GPU_REPORT_INTRO in page
    assert "### moe, Some GPU: `python -m recipes.gpu_report`" in page
    assert "torch 2.13.0, CUDA 12.8, driver 570.1, Triton 3.4.0, 2026-01-02, commit abc1234" in page
    assert "| DeepSeek-like | torchtitan (dropless) | not run | - | torchtitan is not importable here |" in page
    assert report.plot_names(records) == []  # no speed-up chart: those are ours over DeepSpeed's benchmarks
