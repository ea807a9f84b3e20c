"""The demo and the benchmark run end to end at tiny sizes."""

from recipes import bench_moe, demo


def test_demo_trains_and_the_moe_beats_its_dense_twin():
    result = demo.main(["--steps", "400", "--batch", "256", "--log-interval", "50"])
    assert result["moe"] < result["dense"]


def test_benchmark_prints_figures(capsys):
    results = bench_moe.main(["--tokens", "256", "--hidden", "32", "--ffn", "64", "--experts", "4", "--k", "2",
                              "--steps", "2", "--warmup", "1", "--deepspeed", "off"])
    out = capsys.readouterr().out
    assert "tokens/s" in out and "expert matmuls alone" in out
    assert results["ours"]["ms"] > 0 and results["ours"]["matmul_ms"] > 0


def test_kernel_benchmark_prints_bandwidth(capsys):
    from recipes import bench_kernels

    bench_kernels.main(["--tokens", "64", "--hidden", "32", "--experts", "4", "--steps", "1", "--warmup", "0",
                        "--dtype", "fp32", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "GB/s" in out and "permute (torch)" in out and "% of copy" in out


def test_demo_under_torchrun_with_expert_parallelism(tmp_path):
    import subprocess
    import sys

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "recipes.demo", "--experts", "4", "--ep-world-size", "2", "--steps", "20", "--log-interval", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 0: holds experts 0..1" in done.stdout and "rank 1: holds experts 2..3" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "recipes.demo", "--ep-world-size", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--ep-world-size (3) must divide" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_engine_benchmark_matches_the_zero_accounting_in_one_process(capsys):
    from recipes import bench_engine

    rows = bench_engine.main(["--blocks", "2", "--hidden", "32", "--ffn", "64", "--experts", "4", "--tokens", "64",
                              "--steps", "1", "--warmup", "1", "--stages", "0", "1", "2", "3", "--deepspeed", "off"])
    out = capsys.readouterr().out
    assert len(rows) == 4 and "ZeRO says" in out and "CPU: " in out
    for row in rows:  # one process: nothing to shard, so every stage holds everything
        assert abs(row["model_states"] - row["zero"]) <= 0.01 * row["zero"], row
        assert row["ms"]["ours"] > 0 and row["peak"]["ours"] > 0 and "deepspeed" not in row["ms"]
