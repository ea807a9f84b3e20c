"""Dense GPT against MoE GPT at equal active compute: the table in the README comes from here.

    python -m recipes.compare_dense_moe                               # CPython's docs, about 10 minutes
    python -m recipes.compare_dense_moe --data stdlib --steps 3000    # the README's table (~11 MB of Python source)

Both models come from `recipes.gpt` with the same flags: the dense twin has a feed-forward of width
--ffn in every block; the MoE model replaces every other block's feed-forward with --num-experts
experts of width ffn / top-k, top-k routed, so each token meets the same number of parameters apart
from the router. Both see the same number of tokens, in the same batches, with the same schedule.
The table (final validation loss, tokens/s, total and active parameters) is printed and written
to --out as Markdown.

--data takes what `recipes.gpt --data` takes, or `stdlib`: the `.py` files of this Python's standard
library (its `test` folders left out), joined into --log-dir/stdlib_corpus.txt.
"""

import os
import sysconfig
from dataclasses import dataclass, field

from recipes import gpt
from recipes.common import records
from recipes.common.cli import fail, flag_parser


@dataclass(kw_only=True)
class CompareConfig:
    data: str = field(default="", metadata={"help": "as recipes.gpt --data, or 'stdlib'; empty: CPython's docs"})
    steps: int = 1200
    batch_size: int = 32
    seq_len: int = 128
    n_layer: int = 4
    n_embd: int = 128
    ffn: int = 512
    num_experts: int = 8
    top_k: int = 2
    eval_interval: int = 200
    eval_batches: int = 32
    log_dir: str = "runs/compare"
    out: str = field(default="runs/compare/dense_vs_moe.md", metadata={"help": "where the Markdown table goes"})
    seed: int = 0


def stdlib_corpus(folder: str) -> str:
    """Write the standard library's .py files (tests left out), sorted, into one text file; return its path."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    path = os.path.join(folder, "stdlib_corpus.txt")
    os.makedirs(folder, exist_ok=True)
    with open(path + ".partial", "wb") as out:
        for base, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in skip)
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(base, name), "rb") as handle:
                    out.write(handle.read() + b"\n")
    os.replace(path + ".partial", path)
    return path


def main(argv: list[str] | None = None) -> list[dict]:
    parser = flag_parser(CompareConfig, __doc__)
    parser.prog = "recipes.compare_dense_moe"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = CompareConfig(**vars(args))
    if cfg.top_k > cfg.num_experts:
        fail(parser, f"--top-k ({cfg.top_k}) must be at most --num-experts ({cfg.num_experts})")
    data = stdlib_corpus(cfg.log_dir) if cfg.data == "stdlib" else cfg.data
    common = ["--data", data, "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size),
              "--seq-len", str(cfg.seq_len), "--n-layer", str(cfg.n_layer), "--n-embd", str(cfg.n_embd),
              "--ffn", str(cfg.ffn), "--eval-interval", str(cfg.eval_interval), "--eval-batches", str(cfg.eval_batches),
              "--log-dir", cfg.log_dir, "--log-interval", str(max(cfg.steps // 20, 1)), "--seed", str(cfg.seed)]
    runs = [("dense", common + ["--dense", "--run-name", "dense"]),
            (f"MoE {cfg.num_experts} experts, top-{cfg.top_k}",
             common + ["--num-experts", str(cfg.num_experts), "--top-k", str(cfg.top_k), "--run-name", "moe"])]
    rows = []
    for name, argv_run in runs:
        print(f"== {name}", flush=True)
        result = gpt.main(argv_run)
        rows.append({"model": name, "total": result["total_params"], "active": result["active_params"],
                     "tokens": cfg.steps * cfg.batch_size * cfg.seq_len, "val_loss": result["val_loss"],
                     "tokens_per_s": result["tokens_per_s"], "unigram": result["unigram"]})
    table = render(cfg, rows)
    print(table)
    os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
    partial = cfg.out + ".partial"
    with open(partial, "w") as handle:
        handle.write(table)
    os.replace(partial, cfg.out)
    print(f"table written to {cfg.out}")
    records.record_run(record_dir, "compare_dense_moe", "recipes.compare_dense_moe", argv, rows)
    return rows


def render(cfg: CompareConfig, rows: list[dict]) -> str:
    head = (f"{cfg.n_layer} blocks, width {cfg.n_embd}, dense ffn {cfg.ffn}, sequence {cfg.seq_len}, "
            f"{cfg.steps} steps of {cfg.batch_size} sequences; unigram baseline {rows[0]['unigram']:.4f} nats/byte\n\n")
    lines = ["| model | total parameters | active parameters per token | tokens | final validation loss | tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['model']} | {r['total']:,} | {r['active']:,} | {r['tokens']:,} | {r['val_loss']:.4f} | "
              f"{r['tokens_per_s']:,.0f} |" for r in rows]
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
