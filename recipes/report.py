"""Renders docs/results.md (and its plots under docs/results/) from the records under results/.

    python -m recipes.report            # writes docs/results.md, the PNGs and the README's glance block
    python -m recipes.report --check    # exits 1 when a committed page differs from the render

For each benchmark, the latest record per machine and command is a table (machine, torch, date,
commit, command, then its figures). A "results at a glance" table gives the headline figure of
each headline benchmark per machine; where README.md holds the markers GLANCE_START and GLANCE_END,
the text between them is that table. The page depends on the records only (sorted, no render time),
so `--check` can compare it byte for byte. Plots need matplotlib (`pip install .[plots]`); without
it the markdown is still rendered and existing PNGs are left as they are.
"""

import argparse
import re
import sys
from pathlib import Path

from recipes.common.records import load_records, slug

GLANCE_START = "<!-- results-at-a-glance:start -->"
GLANCE_END = "<!-- results-at-a-glance:end -->"
PLOTS = "results"  # folder of the PNGs, beside the page
ORDER = ("bench_moe", "bench_engine", "bench_gpt", "bench_kernels", "bench_routing", "bench_checkpoint",
         "compare_dense_moe", "ablate", "gpt", "gpu_report_tests", "gpu_report_kernels", "gpu_report_moe",
         "gpu_report_gpt")
GPU_REPORT = "gpu_report_"  # the benchmarks of `python -m recipes.gpu_report`, one per part, share a section


def _sequence(record: dict) -> tuple:
    """Orders runs of one date: a numbered file (`...-2.json`) was written after the unnumbered one."""
    match = re.search(r"-(\d+)\.json$", record["path"])
    return record["date"], int(match.group(1)) if match else 1


def latest(records: list[dict]) -> list[dict]:
    """The newest record of each (benchmark, machine, command), sorted by benchmark, machine, command."""
    newest = {}
    for record in sorted(records, key=_sequence):
        newest[record["benchmark"], record["machine"], record["command"]] = record
    rank = {name: i for i, name in enumerate(ORDER)}
    return [newest[key] for key in sorted(newest, key=lambda k: (rank.get(k[0], len(ORDER)), k[0], k[1], k[2]))]


def _cell(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.3g}" if 0 < abs(value) < 0.01 else repr(round(value, 4))
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v) for v in value) or "-"
    if isinstance(value, dict):
        return "; ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def rows_of(figures) -> list[dict]:
    """A record's figures as table rows: a list of rows as it is, a dict of dicts one row per key, else one row."""
    if isinstance(figures, dict) and "table" in figures:
        figures = figures["table"]
    if isinstance(figures, list):
        return [row if isinstance(row, dict) else {"value": row} for row in figures]
    if isinstance(figures, dict) and figures and all(isinstance(v, dict) for v in figures.values()):
        return [{"name": name, **row} for name, row in figures.items()]
    return [figures if isinstance(figures, dict) else {"value": figures}]


def table(rows: list[dict]) -> str:
    columns = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _config(command: str) -> str:
    """The flags of a command that tell its configurations apart in a label ("experts 64 bf16 hidden 2048")."""
    words = command.split()
    found = [f"{flag[2:]} {words[i + 1]}" for i, flag in enumerate(words[:-1]) if flag in ("--experts", "--dtype", "--hidden")]
    return " ".join(found + (["overlap"] if "--overlap-comm" in words else []))


def speedups(record: dict) -> list[tuple[str, float]]:
    """(label, ours over DeepSpeed) pairs of a record: rows with a speedup, or ms of both layers or engines."""
    found = []
    figures, config = record["figures"], _config(record["command"])
    if isinstance(figures, dict) and isinstance(figures.get("ours"), dict) and isinstance(figures.get("deepspeed"), dict):
        found.append((config, figures["deepspeed"]["ms"] / figures["ours"]["ms"]))
    elif isinstance(figures, list):
        for row in figures:
            if not isinstance(row, dict):
                continue
            own = " ".join(f"{k} {row[k]}" for k in ("experts", "dtype") if k in row)
            label = " ".join(part for part in (own or config, f"stage {row['stage']}" if "stage" in row else "") if part)
            if isinstance(row.get("speedup"), (int, float)):
                found.append((label, float(row["speedup"])))
            elif isinstance(row.get("ms"), dict) and "deepspeed" in row["ms"]:
                found.append((label, row["ms"]["deepspeed"] / row["ms"]["ours"]))
    return found


def headline(record: dict) -> str | None:
    """The one figure a benchmark's record is known by, or None for benchmarks without one."""
    name, rows = record["benchmark"], rows_of(record["figures"])
    if name in ("bench_moe", "bench_engine"):
        pairs = speedups(record)
        return ", ".join(f"{label}: {value:.2f}x" if label else f"{value:.2f}x" for label, value in pairs) or None
    if name == "bench_gpt":
        row = rows[0]
        ratio = row.get("moe_over_dense_tokens_per_s")
        if ratio is None and "moe" in record["figures"] and "dense" in record["figures"]:
            ratio = record["figures"]["moe"] / record["figures"]["dense"]
        flags = record["command"].split(" -m recipes.bench.gpt")[-1].strip()
        return None if ratio is None else f"{ratio:.3f}" + (f" (`{flags}`)" if flags else "")
    if name == "compare_dense_moe":
        return "validation loss " + ", ".join(f"{row['model']} {_cell(row['val_loss'])}" for row in rows if "val_loss" in row)
    if name == "gpu_report_moe":
        return "; ".join(f"{size}: " + ", ".join(pairs) for size, pairs in _moe_speedups(rows).items() if pairs) or None
    if name == "gpu_report_gpt":
        found = [f"{row['size']} {row['mode']} {row['moe_over_dense']:.3f}" for row in rows
                 if isinstance(row.get("moe_over_dense"), (int, float))]
        return ", ".join(found) or None
    if name == "gpu_report_tests":
        counts = [f"{row[key]} {key}" for row in rows for key in ("passed", "failed", "skipped", "error") if key in row]
        return ", ".join(counts) or None
    return None


def _moe_speedups(rows: list[dict]) -> dict[str, list[str]]:
    """Per size of a gpu_report_moe record: ours over each library's layer run the same way (x as fast)."""
    ms = {(row["size"], row["layer"]): row["ms"] for row in rows if isinstance(row.get("ms"), (int, float))}
    found = {}
    for (size, layer), theirs in ms.items():
        library, _, kind = layer.partition(" ")
        if library != "ours" and (size, f"ours {kind}") in ms:
            found.setdefault(size, []).append(f"over {library} {theirs / ms[size, f'ours {kind}']:.2f}x")
    return found


def glance(records: list[dict]) -> str:
    """One row per headline benchmark and machine: the headline figures of its newest records, their dates
    and commits."""
    rows = {}
    for record in records:
        figure = headline(record)
        if figure:
            rows.setdefault((record["benchmark"], record["machine"]), []).append((figure, record))
    lines = ["| benchmark | machine | headline figures | date | commit |", "| --- | --- | --- | --- | --- |"]
    for (benchmark, machine), found in rows.items():
        dates = sorted({r["date"] for _, r in found})
        commits = sorted({r["commit"] for _, r in found})
        lines.append(f"| {benchmark} | {machine} | {'; '.join(f for f, _ in found)} | "
                     f"{dates[0] if len(dates) == 1 else dates[0] + ' to ' + dates[-1]} | {', '.join(commits)} |")
    return "\n".join(lines)


def _curves(records: list[dict]) -> list[dict]:
    return [r for r in records if r["benchmark"] == "ablate" and isinstance(r["figures"], dict)
            and r["figures"].get("curves")]


def plot_names(records: list[dict]) -> list[str]:
    """The PNGs the page links to: one speed-up chart per machine, two curve charts per ablation with curves."""
    machines = sorted({r["machine"] for r in records if speedups(r)})
    names = [f"speedup_{slug(machine)}.png" for machine in machines]
    for record in _curves(records):
        stem = Path(record["path"]).stem
        names += [f"ablate_{stem}_val_loss.png", f"ablate_{stem}_max_vio.png"]
    return names


def render(records: list[dict]) -> str:
    """The whole page, from the newest records."""
    parts = ["# Results\n",
             "Rendered by `python -m recipes.report` from the records under `results/` (one JSON file per "
             "measured run; a benchmark run with `--record-dir results` adds one). Do not edit by hand. Each "
             "table is the newest record of its benchmark for one machine and command; every figure is "
             "specific to its machine.\n",
             "## Results at a glance\n",
             "Headline figures: bench_moe and bench_engine, ours over DeepSpeed's (x as fast); bench_gpt, MoE over "
             "dense tokens/s; compare_dense_moe, final validation loss in nats/byte; gpu_report_moe, ours over "
             "torchtitan's and DeepSpeed's layers; gpu_report_gpt, MoE over dense tokens/s per mode.\n",
             glance(records) + "\n"]
    machines = sorted({r["machine"] for r in records if speedups(r)})
    if machines:
        parts.append("## Speed-ups over DeepSpeed, per machine\n")
        parts += [f"![{m}]({PLOTS}/speedup_{slug(m)}.png)\n" for m in machines]
    section = None
    for record in records:
        benchmark = record["benchmark"]
        if _section(benchmark) != section:
            section = _section(benchmark)
            parts.append(f"## {section}\n")
            if section == GPU_REPORT.rstrip("_"):
                parts.append(GPU_REPORT_INTRO)
        if benchmark.startswith(GPU_REPORT):
            parts.append(f"### {benchmark.removeprefix(GPU_REPORT)}, {record['machine']}: `{record['command']}`\n")
        else:
            parts.append(f"### {record['machine']}: `{record['command']}`\n")
        parts.append(f"torch {record['torch']}{_versions(record)}, {record['date']}, commit {record['commit']}"
                     + (f"; {record['notes']}" if record.get("notes") else "") + f" (`results/{record['path']}`)\n")
        parts.append(table(rows_of(record["figures"])) + "\n")
        if record in _curves(records):
            stem = Path(record["path"]).stem
            parts += [f"![validation loss]({PLOTS}/ablate_{stem}_val_loss.png)\n",
                      f"![MaxVio]({PLOTS}/ablate_{stem}_max_vio.png)\n"]
    return "\n".join(parts)


GPU_REPORT_INTRO = ("Written by `python -m recipes.gpu_report` on a GPU machine ([gpus](gpus.md)), one record "
                    "per part: the tests marked gpu, the dispatch ops, our MoE layer beside torchtitan's and "
                    "DeepSpeed's (same weights, SwiGLU experts), the GPT recipe's MoE over dense tokens/s. A row "
                    "that did not run says why.\n")


def _section(benchmark: str) -> str:
    """The page section of a benchmark: its own, but one for all parts of the GPU report."""
    return GPU_REPORT.rstrip("_") if benchmark.startswith(GPU_REPORT) else benchmark


def _versions(record: dict) -> str:
    """", CUDA 12.8, driver 570.86" from a record's environment (GPU report records), else ""."""
    figures = record["figures"]
    env = figures.get("environment") if isinstance(figures, dict) else None
    if not isinstance(env, dict):
        return ""
    found = [f"{name} {env[key]}" for key, name in (("cuda", "CUDA"), ("driver", "driver"), ("triton", "Triton"))
             if env.get(key)]
    return "".join(f", {item}" for item in found)


def readme_block(readme: str, records: list[dict]) -> str | None:
    """README.md with the text between the glance markers replaced, or None where it has no markers."""
    start, end = readme.find(GLANCE_START), readme.find(GLANCE_END)
    if start < 0 or end < start:
        return None
    return readme[:start + len(GLANCE_START)] + "\n" + glance(records) + "\n" + readme[end:]


def write_plots(records: list[dict], folder: Path) -> bool:
    """Draws the PNGs into `folder`; False (and nothing drawn) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "results"
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    for machine in sorted({r["machine"] for r in records if speedups(r)}):
        bars = [(f"{r['benchmark']} {label}".strip(), value) for r in records if r["machine"] == machine
                for label, value in speedups(r)]
        fig, ax = plt.subplots(figsize=(8, 0.4 * len(bars) + 1.2))
        ax.barh([label for label, _ in bars][::-1], [value for _, value in bars][::-1])
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel("ours over DeepSpeed (x as fast)")
        ax.set_title(machine, fontsize=9)
        fig.tight_layout()
        fig.savefig(folder / f"speedup_{slug(machine)}.png", metadata={"Software": None})
        plt.close(fig)
    for record in _curves(records):
        stem = Path(record["path"]).stem
        for key, label in (("val_loss", "validation loss (nats/byte)"), ("max_vio", "MaxVio")):
            fig, ax = plt.subplots(figsize=(7, 4))
            for variant, runs in sorted(record["figures"]["curves"].items()):
                for seed, run in enumerate(runs):
                    points = run.get(key) or []
                    if points:
                        ax.plot([p[0] for p in points], [p[1] for p in points],
                                label=variant if len(runs) == 1 else f"{variant} ({seed})")
            ax.set_xlabel("step")
            ax.set_ylabel(label)
            ax.legend(fontsize=7)
            fig.tight_layout()
            fig.savefig(folder / f"ablate_{stem}_{key}.png", metadata={"Software": None})
            plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="recipes.report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default="results", help="the records' folder (default: %(default)s)")
    parser.add_argument("--out", default="docs/results.md", help="the page (default: %(default)s)")
    parser.add_argument("--readme", default="README.md", help="where the glance block goes (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page or README block differs")
    args = parser.parse_args(argv)
    records = latest(load_records(args.results))
    page, out, readme = render(records), Path(args.out), Path(args.readme)
    new_readme = readme_block(readme.read_text(), records) if readme.exists() else None
    if args.check:
        stale = [str(out)] if not out.exists() or out.read_text() != page else []
        if new_readme is not None and readme.read_text() != new_readme:
            stale.append(str(readme))
        missing = [name for name in plot_names(records) if not (out.parent / PLOTS / name).exists()]
        stale += [str(out.parent / PLOTS / name) for name in missing]
        for path in stale:
            print(f"{path} differs from the records' render: run python -m recipes.report")
        return 1 if stale else 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"wrote {out}")
    if new_readme is not None:
        readme.write_text(new_readme)
        print(f"wrote the glance block of {readme}")
    if write_plots(records, out.parent / PLOTS):
        print(f"wrote {len(plot_names(records))} plots under {out.parent / PLOTS}")
    else:
        print("matplotlib is not installed (pip install matplotlib): plots left as they are")
    return 0


if __name__ == "__main__":
    sys.exit(main())
