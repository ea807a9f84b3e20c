"""One command for a GPU machine: the CUDA tests, the dispatch ops, our MoE layer beside DeepSpeed's and
torchtitan's, and the GPT recipe's MoE/dense ratio, each written as a result record.

    python -m recipes.gpu_report                              # on a GPU machine: every part, records under results/
    python -m recipes.gpu_report --parts moe gpt --steps 50
    python -m recipes.gpu_report --tiny --record-dir /tmp/r   # tiny sizes (always so on a CPU)
    python -m recipes.report                                  # then render docs/results.md from the records

Parts (--parts), each run in this one process, one after the other:

    tests    `python -m pytest -q -m gpu` in a subprocess: counts of passed, failed and skipped tests
    kernels  `recipes.bench.kernels`: permute and unpermute_combine against a copy (16,384 tokens, top-2,
             hidden 4096, bf16)
    moe      our layer beside DeepSpeed's and torchtitan's, SwiGLU experts with the same weights, bf16,
             forward+backward (`recipes.common.frameworks`): Mixtral-like (hidden 4096, ffn 14336,
             8 experts, top-2) and DeepSeek-like fine-grained (hidden 2048, ffn 1408, 64 experts,
             top-6), 16,384 tokens each; ms per step, tokens/s, the step's peak memory, and how far
             each library's output is from ours
    gpt      `recipes.bench.gpt`: MoE over dense tokens/s at the recipe's default size and at width
             1024 with 16 experts, eager, compiled (--compile) and graphed (--cuda-graphs); bf16 on a GPU

Each part writes one record, results/gpu_report_<part>/<date>_<machine>_<commit>.json: the machine,
torch, date, commit and this command, and as figures the environment (device, CUDA and driver
versions where a GPU is) and one row per measurement. What cannot run here is a row saying why
(no CUDA device, a library not importable); a part that fails is a row with its error, and the
other parts still run. The exit status is 1 when a part or a test failed, else 0.

Without a CUDA device --tiny is on: tiny sizes, so that the whole report is quick and the tests can
run it; under --tiny torch.compile is not run (compiling takes longer than the rest of the report).
"""

import dataclasses
import importlib.metadata
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from parallel import accelerator_name
from recipes.bench import gpt as bench_gpt
from recipes.bench import kernels as bench_kernels
from recipes.common import records
from recipes.common.cli import fail, flag_parser
from recipes.common.frameworks import LayerSize, compare, failure_row
from recipes.common.training import cpu_name

PARTS = ("tests", "kernels", "moe", "gpt")
ROOT = Path(__file__).resolve().parents[1]
TESTS_COMMAND = ("-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider")
TESTS_TIMEOUT = 3600  # seconds

MOE_SIZES = (LayerSize(name="Mixtral-like", hidden=4096, ffn=14336, experts=8, k=2, tokens=16384),
             LayerSize(name="DeepSeek-like", hidden=2048, ffn=1408, experts=64, k=6, tokens=16384))
TINY_MOE_SIZES = (LayerSize(name="Mixtral-like (tiny)", hidden=32, ffn=56, experts=8, k=2, tokens=64),
                  LayerSize(name="DeepSeek-like (tiny)", hidden=32, ffn=24, experts=64, k=6, tokens=64))
KERNEL_FLAGS = ["--tokens", "16384", "--k", "2", "--hidden", "4096", "--dtype", "bf16"]
TINY_KERNEL_FLAGS = ["--tokens", "64", "--k", "2", "--hidden", "32", "--experts", "4"]
GPT_SIZES = {"default": [], "width 1024, 16 experts": ["--n-embd", "1024", "--n-head", "16", "--ffn", "4096",
                                                       "--num-experts", "16"]}
TINY_GPT = ["--n-layer", "2", "--n-head", "2", "--seq-len", "16", "--batch-size", "4"]
TINY_GPT_SIZES = {"default (tiny)": TINY_GPT + ["--n-embd", "32", "--ffn", "64"],
                  "wide, 16 experts (tiny)": TINY_GPT + ["--n-embd", "64", "--ffn", "128", "--num-experts", "16"]}
GPT_MODES = {"eager": [], "compiled": ["--compile"], "graphed": ["--cuda-graphs"]}


@dataclass(kw_only=True)
class ReportConfig:
    tiny: bool = field(default=False, metadata={"help": "tiny sizes: a quick check that every part runs (always so without CUDA)"})
    parts: list[str] = field(default_factory=lambda: list(PARTS), metadata={
        "nargs": "+", "type": str, "help": f"which parts, of: {' '.join(PARTS)}"})
    record_dir: str = field(default="results", metadata={"help": "the records' root folder"})
    steps: int = field(default=0, metadata={"help": "timed steps of each benchmark (0: 20, or 2 with --tiny)"})


def _driver() -> str | None:
    """The NVIDIA driver's version from nvidia-smi, or None where it is not there or does not answer."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def environment(device: torch.device) -> dict:
    """Device name, torch, CUDA and driver versions (None without a GPU), Triton's where installed."""
    cuda = device.type == "cuda"
    try:
        triton = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        triton = None
    return {"device": torch.cuda.get_device_name(device) if cuda else cpu_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda if cuda else None, "driver": _driver() if cuda else None,
            "capability": ".".join(map(str, torch.cuda.get_device_capability(device))) if cuda else None,
            "triton": triton, "python": sys.version.split()[0]}


def pytest_counts(output: str) -> dict:
    """Counts from pytest's closing line ("3 passed, 1 failed, 2 skipped in 4.2s"): outcome -> number."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error|deselected)", line)]
    if not lines:
        return {}
    return {word.rstrip("s") if word == "errors" else word: int(n)
            for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1])}


def run_tests(cfg: ReportConfig, device: torch.device) -> list[dict]:
    """The tests marked gpu, in a subprocess: one row of counts, the failed tests' ids, the exit code."""
    command = "python " + " ".join(TESTS_COMMAND)
    if device.type != "cuda":
        return [{"command": command, "status": "not run", "reason": "no CUDA device"}]
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, *TESTS_COMMAND], cwd=ROOT, capture_output=True, text=True,
                              timeout=TESTS_TIMEOUT)
    except subprocess.TimeoutExpired:
        return [{"command": command, "status": "failed", "reason": f"did not finish in {TESTS_TIMEOUT} s"}]
    print(done.stdout[-6000:] + done.stderr[-3000:])
    failed = [line.split()[1] for line in done.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    # pytest exits 0 (all passed), 1 (some failed) or 5 (no test carries the marker): all are runs
    return [{"command": command, "status": "ran" if done.returncode in (0, 1, 5) else "failed",
             "exit_code": done.returncode, **pytest_counts(done.stdout), "failed_tests": failed,
             "seconds": time.perf_counter() - start}]


def run_kernels(cfg: ReportConfig, device: torch.device) -> list[dict]:
    """`recipes.bench.kernels`: one row per op and path, ms, GB/s and the share of a copy's bandwidth."""
    argv = (TINY_KERNEL_FLAGS if cfg.tiny else KERNEL_FLAGS) + ["--steps", str(cfg.steps), "--warmup",
                                                                "1" if cfg.tiny else "5", "--device", device.type]
    figures = bench_kernels.main(argv)
    copy = figures["copy"]["gbs"]
    return [{"op": name, "status": "ran", "ms": row["ms"], "gbs": row.get("gbs"),
             "share_of_copy": row["gbs"] / copy if "gbs" in row else None} for name, row in figures.items()]


def run_moe(cfg: ReportConfig, device: torch.device) -> list[dict]:
    """Our layer, DeepSpeed's and torchtitan's at each size (`recipes.common.frameworks.compare`): bf16 on a
    GPU; fp32 on a CPU, where bf16 products of a new row count each call are slow to set up."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for size in TINY_MOE_SIZES if cfg.tiny else MOE_SIZES:
        rows += compare(size, device, dtype, cfg.steps, 1 if cfg.tiny else 3)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def gpt_rows(cfg: ReportConfig, device: torch.device) -> list[dict]:
    """One row per size and mode: the `recipes.bench.gpt` flags, or why that mode does not run here."""
    common = ["--deepspeed", "off", "--steps", str(cfg.steps)] + (["--warmup", "1"] if cfg.tiny else [])
    common += ["--dtype", "bf16"] if device.type == "cuda" else []
    rows = []
    for size, size_flags in (TINY_GPT_SIZES if cfg.tiny else GPT_SIZES).items():
        for mode, mode_flags in GPT_MODES.items():
            row = {"size": size, "mode": mode, "status": None, "moe_over_dense": None, "moe_tokens_per_s": None,
                   "dense_tokens_per_s": None, "flags": " ".join(size_flags + mode_flags + common)}
            if mode == "graphed" and device.type != "cuda":  # the flag is refused without CUDA
                row.update(status="not run", reason="CUDA graphs need a CUDA device")
            elif mode == "compiled" and cfg.tiny:
                row.update(status="not run", reason="--tiny: compiling takes longer than the rest of the report")
            rows.append(row)
    return rows


def run_gpt(cfg: ReportConfig, device: torch.device) -> list[dict]:
    """`recipes.bench.gpt` per size and mode: each model's tokens/s and MoE over dense."""
    rows = gpt_rows(cfg, device)
    for row in rows:
        if row["status"] is not None:
            continue
        try:
            result = bench_gpt.main(row["flags"].split())
        except (Exception, SystemExit) as error:  # a flag refused or a failed run: a row saying so
            row.update(failure_row(error))
            continue
        row.update(status="ran", moe_tokens_per_s=result["moe"], dense_tokens_per_s=result["dense"],
                   moe_over_dense=result["moe"] / result["dense"])
    return rows


RUNS = {"tests": run_tests, "kernels": run_kernels, "moe": run_moe, "gpt": run_gpt}


def _figure(part: str, row: dict) -> tuple[str, str]:
    """(what, its figures) of one row for the summary."""
    if row.get("status") != "ran":
        label = (row.get("op") or row.get("command")
                 or " ".join(str(row[k]) for k in ("size", "layer", "mode") if k in row) or part)
        return label, f"{row.get('status')}: {row.get('reason', '')}"
    if part == "tests":
        counts = ", ".join(f"{row[k]} {k}" for k in ("passed", "failed", "skipped", "error") if k in row)
        return row["command"], counts or f"no test selected (exit {row['exit_code']})"
    if part == "kernels":
        share = f", {100 * row['share_of_copy']:.0f}% of copy" if row["share_of_copy"] is not None else ""
        return row["op"], f"{row['ms']:.3f} ms" + (f", {row['gbs']:.1f} GB/s" if row["gbs"] else "") + share
    if part == "moe":
        agrees = f", output {'agrees' if row['agrees'] else 'DIFFERS'}" if "agrees" in row else ""
        return (f"{row['size']} {row['layer']}", f"{row['ms']:.2f} ms, {row['tokens_per_s']:,.0f} tokens/s, "
                                                 f"peak {row['step_peak_mib']:,.1f} MiB{agrees}")
    return f"{row['size']} {row['mode']}", f"MoE / dense tokens/s {row['moe_over_dense']:.3f}"


def summary(results: dict[str, list[dict]]) -> str:
    """The short table printed at the end: part, what, figures."""
    lines = [(part, *_figure(part, row)) for part, rows in results.items() for row in rows]
    width = max(len(what) for _, what, _ in lines)
    return "\n".join(f"{part:<8} {what:<{width}}  {figures}" for part, what, figures in lines)


def failed(results: dict[str, list[dict]]) -> bool:
    """Whether a part, a measurement or a test failed."""
    return any(row.get("status") == "failed" or row.get("failed") for rows in results.values() for row in rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = flag_parser(ReportConfig, __doc__)
    parser.prog = "recipes.gpu_report"
    cfg = ReportConfig(**vars(parser.parse_args(argv)))
    unknown = [part for part in cfg.parts if part not in PARTS]
    if unknown:
        fail(parser, f"--parts must be among {list(PARTS)}, got {unknown}")
    if cfg.steps < 0:
        fail(parser, f"--steps must be at least 1 (or 0: the default), got {cfg.steps}")
    try:
        device = torch.device(accelerator_name())
    except ValueError as error:
        fail(parser, str(error))
    if device.type != "cuda" and not cfg.tiny:
        print("no CUDA device: --tiny")
        cfg.tiny = True
    cfg.steps = cfg.steps or (2 if cfg.tiny else 20)
    env = environment(device)
    command = records.command_line("recipes.gpu_report", argv)
    print("config:", dataclasses.asdict(cfg), "\nenvironment:", env)
    results = {}
    for part in (p for p in PARTS if p in cfg.parts):
        print(f"\n== {part} ==")
        try:
            results[part] = RUNS[part](cfg, device)
        except Exception as error:  # one part's failure is its record; the other parts still run
            results[part] = [failure_row(error)]
        path = records.write_record(f"gpu_report_{part}", command, {"environment": env, "table": results[part]},
                                    cfg.record_dir, machine=env["device"],
                                    notes="tiny sizes: a check that the report runs, not a measurement" if cfg.tiny
                                    else None)
        print(f"record written to {path}")
    print("\n" + summary(results))
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
