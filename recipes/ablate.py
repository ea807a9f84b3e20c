"""Routing ablation: the GPT recipe's model trained once per router variant, at equal active compute.

    python -m recipes.ablate                                          # every variant, CPython's docs
    python -m recipes.ablate --data stdlib --steps 1000               # the README's table (~11 MB of Python source)
    python -m recipes.ablate --variants softmax_aux sigmoid_bias --seeds 0 1 2
    python -m recipes.ablate --variants dense softmax_aux --dropless --n-layer 6   # other recipes.gpt flags pass through

Every variant is `recipes.gpt` with the same data, batches (seeded by step, not by variant), schedule,
number of tokens and active parameters per token; only the router and the expert shapes differ.
With --num-experts E, --top-k k and --ffn F (experts of width F / k, k per token: F active):

    dense            the dense twin: a feed-forward of width F in every block
    softmax_aux      softmax top-k, DeepSpeed's load-balancing loss (the recipe's default)
    sigmoid_bias     sigmoid scores, auxiliary-loss-free balancing by an expert bias (u = --bias-update-speed), no loss
    sigmoid_bias_seq the same plus DeepSeek-V3's sequence-wise loss (coefficient --seq-aux-coef)
    global_aux       softmax top-k, the global-batch loss (counts over all micro-batches and ranks of the step)
    shared           one shared expert of width F / k plus top-(k-1) routed experts (k = 1: two of width F / 2)
    fine_grained     4E experts of width F / 4k, top-4k
    expert_choice    each expert takes its top C tokens, C = S * k / E (k experts per token on average)
    copy_init        softmax_aux with every expert a copy of one template (DeepSpeed's init) instead of
                     independently seeded experts (the recipe's default)

Expert choice leaks across positions (whether an expert takes token t depends on later tokens), so
its validation loss is not a causal model's. The global-batch loss differs from the micro-batch one
only when a step has several micro-batches or processes: the default step is 4 micro-batches.

The table (final validation loss, MaxVio and dropped fraction as means over the last 10% of steps,
tokens/s, total and active parameters) is printed and written to --out; TensorBoard runs go to
--log-dir/<variant>[-seed<s>], side by side. With several --seeds each figure is the mean, +- the
standard deviation over seeds.
"""

import math
import os
import statistics
import sys
from dataclasses import dataclass, field

from recipes import gpt
from recipes.common import records, runner
from recipes.common.cli import fail, flag_names, flag_parser
from recipes.compare_dense_moe import stdlib_corpus
from recipes.gpt_model import GPT

VARIANTS = ("dense", "softmax_aux", "sigmoid_bias", "sigmoid_bias_seq", "global_aux", "shared", "fine_grained",
            "expert_choice", "copy_init")


@dataclass(kw_only=True)
class AblateConfig:
    variants: list[str] = field(default_factory=lambda: list(VARIANTS), metadata={
        "nargs": "+", "type": str, "help": f"which variants, of: {' '.join(VARIANTS)}"})
    seeds: list[int] = field(default_factory=lambda: [0], metadata={
        "nargs": "+", "type": int, "help": "one run per variant and seed"})
    data: str = field(default="", metadata={"help": "as recipes.gpt --data, or 'stdlib'; empty: CPython's docs"})
    steps: int = 1000
    batch_size: int = field(default=8, metadata={"help": "sequences per micro-batch"})
    gradient_accumulation_steps: int = field(default=4, metadata={"help": "micro-batches per optimizer step"})
    seq_len: int = 128
    n_layer: int = 4
    n_embd: int = 128
    ffn: int = field(default=512, metadata={"help": "dense feed-forward width; routed experts get ffn / top-k"})
    num_experts: int = 8
    top_k: int = 2
    aux_coef: float = field(default=0.01, metadata={"help": "coefficient of the aux and global-batch losses"})
    seq_aux_coef: float = field(default=1e-4, metadata={"help": "coefficient of the sequence-wise loss (DeepSeek-V3)"})
    bias_update_speed: float = field(default=1e-3, metadata={"help": "the expert bias's step u"})
    eval_interval: int = 200
    eval_batches: int = 32
    log_dir: str = "runs/ablate"
    out: str = field(default="runs/ablate/ablation.md", metadata={"help": "where the Markdown table goes"})


def variant_flags(cfg: AblateConfig, name: str) -> list[str]:
    """The recipes.gpt flags that make variant `name` (on top of the flags every variant shares)."""
    E, k, F = cfg.num_experts, cfg.top_k, cfg.ffn
    width = str(max(F // k, 1))
    softmax = ["--aux-coef", str(cfg.aux_coef)]
    bias = ["--scoring-func", "sigmoid", "--bias-update-speed", str(cfg.bias_update_speed)]
    flags = {
        "dense": ["--dense"],
        "softmax_aux": softmax,
        "sigmoid_bias": bias + ["--load-balancing-type", "none"],
        "sigmoid_bias_seq": bias + ["--load-balancing-type", "seq_aux_loss", "--aux-coef", str(cfg.seq_aux_coef)],
        "global_aux": softmax + ["--load-balancing-type", "global_aux_loss"],
        "shared": (softmax + ["--n-shared-experts", "1", "--top-k", str(k - 1), "--expert-ffn", width] if k > 1 else
                   softmax + ["--n-shared-experts", "1", "--top-k", "1", "--expert-ffn", str(max(F // 2, 1))]),
        "fine_grained": softmax + ["--num-experts", str(4 * E), "--top-k", str(4 * k),
                                   "--expert-ffn", str(max(F // (4 * k), 1))],
        "expert_choice": ["--routing", "expert_choice", "--capacity-factor", str(k)],
        "copy_init": softmax + ["--expert-init", "copy"],
    }
    return flags[name]


def describe(cfg: AblateConfig, name: str) -> str:
    """The variant in words, with the shapes it runs at."""
    E, k, F = cfg.num_experts, cfg.top_k, cfg.ffn
    return {
        "dense": f"dense twin, ffn {F}",
        "softmax_aux": f"softmax top-{k}, aux loss {cfg.aux_coef:g}",
        "sigmoid_bias": f"sigmoid top-{k}, aux-loss-free bias (u {cfg.bias_update_speed:g}), no loss",
        "sigmoid_bias_seq": f"sigmoid top-{k}, bias + sequence-wise loss {cfg.seq_aux_coef:g}",
        "global_aux": f"softmax top-{k}, global-batch aux loss {cfg.aux_coef:g}",
        "shared": (f"1 shared + top-{k - 1} of {E} routed, width {F // k}" if k > 1 else
                   f"1 shared + top-1 of {E} routed, width {F // 2}"),
        "fine_grained": f"{4 * E} experts of width {F // (4 * k)}, top-{4 * k}",
        "expert_choice": f"expert choice, {k} experts per token on average (leaks across positions)",
        "copy_init": f"softmax top-{k}, aux loss, experts copied from one template",
    }[name]


def run_argv(cfg: AblateConfig, name: str, seed: int, data: str, extra: list[str]) -> list[str]:
    """The full recipes.gpt command line of one run."""
    run_name = name if len(cfg.seeds) == 1 else f"{name}-seed{seed}"
    shared = ["--data", data, "--steps", str(cfg.steps), "--batch-size", str(cfg.batch_size),
              "--gradient-accumulation-steps", str(cfg.gradient_accumulation_steps), "--seq-len", str(cfg.seq_len),
              "--n-layer", str(cfg.n_layer), "--n-embd", str(cfg.n_embd), "--ffn", str(cfg.ffn),
              "--num-experts", str(cfg.num_experts), "--top-k", str(cfg.top_k),
              "--eval-interval", str(cfg.eval_interval), "--eval-batches", str(cfg.eval_batches),
              "--log-interval", str(max(cfg.steps // 20, 1)), "--log-dir", cfg.log_dir, "--run-name", run_name,
              "--seed", str(seed)]
    return shared + variant_flags(cfg, name) + extra


def tail_mean(history: list[tuple[int, float]], steps: int) -> float | None:
    """Mean of the values of the last 10% of steps (at least one step); None when there are none."""
    first = steps - max(math.ceil(steps / 10), 1)
    tail = [value for step, value in history if step > first]
    return sum(tail) / len(tail) if tail else None


def summarise(cfg: AblateConfig, name: str, results: list[dict]) -> dict:
    """One table row from a variant's runs (one per seed)."""
    def figures(key):
        return [r[key] for r in results if r[key] is not None]

    return {"variant": name, "description": describe(cfg, name), "total": results[0]["total_params"],
            "active": results[0]["active_params"], "unigram": results[0]["unigram"],
            "val_loss": figures("val_loss"), "tokens_per_s": figures("tokens_per_s"),
            "max_vio": [v for r in results if (v := tail_mean(r["history"]["max_vio"], cfg.steps)) is not None],
            "dropped": [v for r in results
                        if (v := tail_mean(r["history"]["dropped_fraction"], cfg.steps)) is not None]}


def curves(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each variant's validation loss and MaxVio by step, one entry per seed, for the run's record."""
    return {name: [{"val_loss": r["history"]["val"], "max_vio": r["history"]["max_vio"]} for r in runs]
            for name, runs in results.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = flag_parser(AblateConfig, __doc__)
    parser.prog = "recipes.ablate"
    records.add_record_flag(parser)
    names, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    record_dir = records.take_record_dir(names)
    cfg = AblateConfig(**vars(names))
    for flag in ("--seed", "--run-name", "--resume", "--checkpoint-dir"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            fail(parser, f"{flag} is set per run by recipes.ablate (use --seeds); it cannot pass through")
    check(parser, cfg)
    data = stdlib_corpus(cfg.log_dir) if cfg.data == "stdlib" else cfg.data
    runs = [(name, seed, run_argv(cfg, name, seed, data, extra)) for name in cfg.variants for seed in cfg.seeds]
    for name, _, argv_run in runs:  # every combination is checked before the first run trains
        check_run(name, argv_run)
    results: dict[str, list[dict]] = {name: [] for name in cfg.variants}
    for i, (name, seed, argv_run) in enumerate(runs):
        print(f"== {i + 1}/{len(runs)} {name} (seed {seed}): {' '.join(variant_flags(cfg, name) + extra)}", flush=True)
        results[name].append(gpt.main(argv_run))
    rows = [summarise(cfg, name, results[name]) for name in cfg.variants]
    table = render(cfg, rows, extra)
    print(table)
    os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
    with open(cfg.out + ".partial", "w") as handle:
        handle.write(table)
    os.replace(cfg.out + ".partial", cfg.out)
    print(f"table written to {cfg.out}; TensorBoard: tensorboard --logdir {cfg.log_dir}")
    records.record_run(record_dir, "ablate", "recipes.ablate", argv, {"table": rows, "curves": curves(results)})
    return rows


def check(parser, cfg: AblateConfig) -> None:
    """Ablation flags that cannot work stop with one line before anything trains."""
    unknown = [name for name in cfg.variants if name not in VARIANTS]
    if unknown:
        fail(parser, f"--variants {' '.join(unknown)}: unknown; valid: {' '.join(VARIANTS)}")
    if len(set(cfg.variants)) != len(cfg.variants) or len(set(cfg.seeds)) != len(cfg.seeds):
        fail(parser, f"--variants and --seeds must not repeat, got {cfg.variants} and {cfg.seeds}")
    if not 1 <= cfg.top_k <= cfg.num_experts:
        fail(parser, f"--top-k ({cfg.top_k}) must be between 1 and --num-experts ({cfg.num_experts})")
    if "fine_grained" in cfg.variants and cfg.ffn < 4 * cfg.top_k:
        fail(parser, f"--ffn ({cfg.ffn}) must be at least 4 x --top-k ({4 * cfg.top_k}) for fine_grained experts")


def check_run(name: str, argv_run: list[str]) -> None:
    """Parse one run's flags as recipes.gpt would and build its model (one process): bad ones stop here."""
    gpt_parser = runner.parser_for(gpt.RECIPE)
    gpt_parser.prog = f"recipes.ablate: variant {name}: recipes.gpt"
    run_cfg, _ = runner.checked_config(gpt.RECIPE, gpt_parser, argv_run, world=int(os.environ.get("WORLD_SIZE", "1")))
    run_cfg.ep_world_size = 1  # the layout was checked above; one process builds every expert
    try:
        GPT(gpt.model_config(run_cfg))
    except (TypeError, ValueError) as error:
        fail(gpt_parser, flag_names(str(error), gpt.TrainConfig))


def _cell(values: list[float], digits: int, percent: bool = False) -> str:
    if not values:
        return "-"
    scale, unit = (100.0, "%") if percent else (1.0, "")
    mean = statistics.fmean(values) * scale
    text = f"{mean:,.{digits}f}{unit}"
    if len(values) > 1:
        text += f" +- {statistics.stdev(values) * scale:,.{digits}f}"
    return text


def render(cfg: AblateConfig, rows: list[dict], extra: list[str]) -> str:
    micro = cfg.batch_size * cfg.seq_len
    head = (f"{cfg.n_layer} blocks, width {cfg.n_embd}, dense ffn {cfg.ffn}, {cfg.num_experts} experts top-{cfg.top_k} "
            f"as the base; {cfg.steps} steps of {cfg.gradient_accumulation_steps} x {cfg.batch_size} sequences of "
            f"{cfg.seq_len} bytes ({cfg.steps * cfg.gradient_accumulation_steps * micro:,} tokens); "
            f"seeds {' '.join(map(str, cfg.seeds))}; unigram baseline {rows[0]['unigram']:.4f} nats/byte"
            + (f"; extra flags {' '.join(extra)}" if extra else "") + "\n\n")
    lines = ["| variant | total parameters | active per token | final val loss | MaxVio (last 10%) | "
             "dropped (last 10%) | tokens/s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['variant']}: {r['description']} | {r['total']:,} | {r['active']:,} | {_cell(r['val_loss'], 4)} | "
              f"{_cell(r['max_vio'], 3)} | {_cell(r['dropped'], 2, percent=True)} | {_cell(r['tokens_per_s'], 0)} |"
              for r in rows]
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
