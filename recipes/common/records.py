"""Records of measured runs: one JSON file per run, the source that `python -m recipes.report` renders
docs/results.md from.

A record is a dict with the fields in `FIELDS` (and an optional one-line `notes`), stored as
`<directory>/<benchmark>/<date>_<machine-slug>_<commit>.json`. Benchmarks write one when run with
`--record-dir DIR`; without the flag they write nothing, so tests and ad-hoc runs leave no files.
Figures are what the benchmark already printed, as a dict or a list of rows: this module never
measures anything itself.
"""

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch

from recipes.common.training import cpu_name

FIELDS = ("benchmark", "machine", "torch", "date", "commit", "command", "figures")
RECORD_FLAG = "--record-dir"


def machine_name() -> str:
    """The GPU's name where one is in use, else the CPU's model and vector extensions."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return cpu_name()


def commit() -> str:
    """The short hash of the repository's HEAD, "unknown" outside a git checkout."""
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def slug(text: str) -> str:
    """A file-name-safe form of a machine name: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def record_path(record: dict, directory="results") -> Path:
    """Where `record` is stored; another record of the same date, machine and commit gets a numbered name."""
    stem = f"{record['date']}_{slug(record['machine'])}_{record['commit']}"
    folder = Path(directory) / record["benchmark"]
    path, n = folder / f"{stem}.json", 2
    while path.exists():
        path, n = folder / f"{stem}-{n}.json", n + 1
    return path


def write_record(benchmark: str, command: str, figures, directory="results", notes: str | None = None,
                 **fields) -> Path:
    """Writes one run's figures as a record, filling machine, torch, date and commit from this process.

    Args:
        benchmark: the benchmark's name (bench_moe, bench_engine, ..., ablate).
        command: the command line that measured the figures.
        figures: a JSON-serialisable dict or list of rows.
        directory: the records' root folder; one subfolder per benchmark.
        notes: one line on the run, or None.
        **fields: values that override the filled ones (machine, torch, date, commit), for figures
            measured elsewhere.

    Returns:
        The path of the written file.
    """
    record = {"benchmark": benchmark, "machine": machine_name(), "torch": torch.__version__,
              "date": datetime.date.today().isoformat(), "commit": commit(), "command": command,
              "figures": figures}
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"write_record got unknown fields {sorted(unknown)}; valid: {list(FIELDS)}")
    record.update(fields)
    if notes:
        record["notes"] = notes
    path = record_path(record, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=float) + "\n")
    return path


def load_records(directory="results") -> list[dict]:
    """Every record under `directory`, each with its `path` (relative to `directory`), in path order.

    Raises:
        ValueError: a record lacks one of `FIELDS`.
    """
    records = []
    for path in sorted(Path(directory).glob("*/*.json")):
        record = json.loads(path.read_text())
        missing = [name for name in FIELDS if name not in record]
        if missing:
            raise ValueError(f"record {path} lacks {missing}")
        record["path"] = path.relative_to(directory).as_posix()
        records.append(record)
    return records


def add_record_flag(parser) -> None:
    """Adds `--record-dir DIR` to a benchmark's parser (off by default)."""
    parser.add_argument(RECORD_FLAG, default=None, metavar="DIR",
                        help="also write the figures as a JSON record under DIR/<benchmark>/ "
                             "(recipes.report renders them); default: no record")


def take_record_dir(args) -> str | None:
    """Removes the record flag's value from parsed `args` (so the rest fills the config) and returns it."""
    return args.__dict__.pop(RECORD_FLAG[2:].replace("-", "_"))


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that ran `module` with `argv` (sys.argv[1:] when None), less the record flag; torchrun's
    launch where the process is one of several ranks."""
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == RECORD_FLAG:
            skip = True
        elif not arg.startswith(RECORD_FLAG + "="):
            kept.append(arg)
    world = os.environ.get("WORLD_SIZE")
    launcher = (f"torchrun --standalone --nproc_per_node {world} -m" if world and world != "1"
                else "python -m")
    return " ".join([launcher, module] + ([shlex.join(kept)] if kept else []))


def record_run(directory: str | None, benchmark: str, module: str, argv: list[str] | None, figures) -> None:
    """Writes a record of a benchmark's figures when `directory` is set, on rank 0 only, and says where."""
    if directory is None or int(os.environ.get("RANK", "0")) != 0:
        return
    path = write_record(benchmark, command_line(module, argv), figures, directory)
    print(f"record written to {path}")
