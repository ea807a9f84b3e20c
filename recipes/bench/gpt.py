"""The GPT recipe's MoE model against its dense twin: training tokens/s, side by side in one process.

    python -m recipes.bench.gpt                      # the recipe's defaults: 32 x 128 tokens per step
    python -m recipes.bench.gpt --steps 40 --n-embd 256 --ffn 1024
    python -m recipes.bench.gpt --breakdown          # also where each model's step goes, block by block
    python -m recipes.bench.gpt --profile            # also torch.profiler over 3 more steps of each model
    python -m recipes.bench.gpt --deepspeed on       # also the model with DeepSpeed's MoE layer (needs deepspeed)

Both models are built by `recipes.gpt` from the same flags (the dense twin with `--dense`: the same
active parameters per token) and trained through the same engine with the same batches, writing
the same TensorBoard statistics as the recipe does (to a temporary folder). Steps
alternate between the models, so drift in the machine's speed hits them alike; the first --warmup
steps of each are not timed: the CPU products are measured and chosen there (see `kernels.cpu.gemm`),
and the router settles. A fresh router drops about a tenth of the choices over capacity, so the MoE
model's experts do less work than later in training; after about a hundred steps nearly every
choice is kept, as for the rest of a run (--warmup 5 times the first steps instead).
Prints the CPU, the median ms per step, tokens/s and their ratio, the fraction of choices the MoE
layers dropped over the timed steps, and the ratio step by step (each pair of adjacent steps:
median, quartiles, and the median of each half of the run), which shows how far the figure can be
trusted on a shared machine. With --breakdown, also each model's feed-forward blocks (and the MoE
layers' gate and experts) forward and backward, and its optimizer step (`recipes.bench.step_breakdown`).
With --profile, torch.profiler records 3 more steps of each model and the bench prints, per step,
the host time and `.item()` calls; on a GPU also the host's waits for it (stream synchronizations),
the kernel launches and the device time; and the ops that took the most device time (host time on a
CPU). A small model on a GPU is launch-bound when its host time per step exceeds its device time.
Where `deepspeed` is importable (--deepspeed auto, the default; "on" requires it, "off" skips it), a
third model runs beside them: the MoE model with DeepSpeed's MoE layer in place of each of ours,
starting from our layers' weights, on the same routing config (but for the z-loss, which DeepSpeed's
layer does not have: its model trains without one), through the same engine on the same batches;
its ratio to the dense twin is printed too, the yardstick `bench.moe` gives for one layer. It runs
for the configs DeepSpeed's layer has a counterpart for (softmax top-k token choice with the
auxiliary loss, one process, no shared experts, eager, ZeRO stages 0-2); for others it is left out
with a line saying which flag has none (an error with --deepspeed on). DeepSpeed's layer needs
torch.distributed: the bench opens a one-process gloo group for the run (every model's engine then
sums its step's statistics over it, a few tens of microseconds) and closes it at the end.
Any other `recipes.gpt` flag passes through to every model.
"""

import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

try:
    import resource
except ImportError:  # not on POSIX systems: no page-fault counts
    resource = None

from kernels.cpu import gemm
from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.graphs import GraphedStep
from recipes import gpt
from recipes.bench.step_breakdown import StepBreakdown
from recipes.common import records
from recipes.common.cli import engine_config, flag_parser
from recipes.common.training import cpu_name
from recipes.gpt_model import GPT, GPTConfig, mlp


def _engine(cfg: gpt.TrainConfig, moe_layer=None):
    """The recipe's model (its MoE layers replaced by `moe_layer(model config, layer)`), its engine, its counts."""
    torch.manual_seed(cfg.seed)
    model = GPT(gpt.model_config(cfg))
    counts = model.parameter_counts()
    if moe_layer is not None:
        for block in model.blocks:
            if isinstance(block.ffn, MoE):
                block.ffn = moe_layer(model.cfg, block.ffn)
    if cfg.compile:  # as the recipe does: in place, before the engine wraps it (steps run in gpt.compile_setup)
        model.compile()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    config = engine_config(gpt.engine_fragments(cfg), set(), cfg.config)
    engine, *_ = initialize(model, model_parameters=groups, config=config)
    return engine, counts


# the flags (TrainConfig fields) DeepSpeed's MoE layer has no counterpart for away from these values
_DEEPSPEED_COUNTERPARTS = {
    "scoring_func": "softmax", "norm_topk_prob": "auto", "routed_scaling_factor": 1.0, "bias_update_speed": 0.0,
    "load_balancing_type": "aux_loss", "n_group": 0, "topk_group": 0, "routing": "token_choice", "n_shared_experts": 0,
    "ep_world_size": 1, "compile": False, "cuda_graphs": False,  # its layer reads on the host: no graph holds it
}


def deepspeed_unfit(cfg: gpt.TrainConfig) -> str | None:
    """Which flag of `cfg`, if any, DeepSpeed's MoE layer has no counterpart for.

    ZeRO stage 3 (from --stage or the --config file) counts as one: our engine would shard DeepSpeed's layer.

    Args:
        cfg: the bench's flags.

    Returns:
        the first such flag as written ("--scoring-func sigmoid", "--compile", "--config FILE (ZeRO
        stage 3)"), or None where DeepSpeed's layer runs the same routing config.
    """
    for name, value in _DEEPSPEED_COUNTERPARTS.items():
        given = getattr(cfg, name)
        if given != value:
            return f"--{name.replace('_', '-')}" + ("" if given is True else f" {given}")
    if cfg.stage == 3:
        return "--stage 3"
    zero = engine_config(gpt.engine_fragments(cfg), set(), cfg.config).get("zero_optimization") or {}
    return f"--config {cfg.config} (ZeRO stage 3)" if zero.get("stage", 0) == 3 else None


def _deepspeed_layer():
    """(model config, our layer) -> DeepSpeed's layer on that config, with our layer's weights; None without it."""
    try:
        import deepspeed  # optional: only for side-by-side figures
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError:
        return None
    if not _distributed():  # DeepSpeed's layer needs a process group: one process, an in-memory store
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo")

    def build(mc: GPTConfig, ours: MoE) -> torch.nn.Module:
        layer = DeepSpeedMoE(mc.n_embd, mlp(mc.n_embd, mc.expert_ffn), num_experts=mc.num_experts, k=mc.top_k,
                             capacity_factor=mc.capacity_factor, eval_capacity_factor=mc.eval_capacity_factor,
                             min_capacity=mc.min_capacity, noisy_gate_policy=mc.noisy_gate_policy,
                             drop_tokens=not mc.dropless)
        layer.set_deepspeed_parallelism()
        _copy_weights(ours, layer)
        layer.register_buffer("z_loss", torch.zeros(()), persistent=False)  # the block reads one; DeepSpeed has none
        return layer
    return build


def _distributed() -> bool:
    """Whether this process is in a torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def _copy_weights(ours: MoE, theirs: torch.nn.Module) -> None:
    """Our layer's router and stacked experts into DeepSpeed's layer (one Linear-act-Linear module per expert)."""
    mine, their_experts = ours.deepspeed_moe.experts, theirs.deepspeed_moe.experts.deepspeed_experts
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(ours.deepspeed_moe.gate.wg.weight)
        for e, expert in enumerate(their_experts):
            for linear, weight, bias in ((expert[0], mine.weight1, mine.bias1), (expert[-1], mine.weight2, mine.bias2)):
                linear.weight.copy_(weight[e])
                if bias is not None:
                    linear.bias.copy_(bias[e])


def _close_deepspeed() -> None:
    """Close the process group `_deepspeed_layer` opened, with DeepSpeed's expert groups cached on it."""
    try:
        from deepspeed.utils import groups  # a later run in this process makes its groups anew
    except ImportError:
        groups = None
    if groups is not None:
        for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                     "_EXPERT_DATA_PARALLEL_GROUP_RANKS"):
            getattr(groups, name, {}).clear()
        groups._WORLD_GROUP = None
    dist.destroy_process_group()


def _minor_faults() -> int | None:
    """The process's minor page faults so far (None where the OS does not count them): each is a fresh
    page of memory touched for the first time, about a microsecond or more apiece."""
    return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _spread(dense: list[float], moe: list[float], name: str = "MoE") -> str:
    """The ratio step by step: dense / `name` time of each pair of adjacent steps, its median and quartiles,
    and its median over each half of the run (a shared machine's slow phases show as a gap between them)."""
    pairs = [d / m for d, m in zip(dense, moe)]
    if len(pairs) < 2:
        return f"per-step pairs: {', '.join(f'{r:.3f}' for r in pairs)}"
    q1, median, q3 = statistics.quantiles(pairs, n=4, method="inclusive")
    half = len(pairs) // 2
    return (f"per-step pairs (dense / {name} ms): median {median:.3f}, quartiles {q1:.3f}-{q3:.3f}; "
            f"first half {statistics.median(pairs[:half]):.3f}, second half {statistics.median(pairs[half:]):.3f}")


PROFILED_STEPS = 3
_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _profile(engines: dict, runs: dict, tokens: torch.Tensor, first_step: int) -> None:
    """torch.profiler over PROFILED_STEPS more steps of each model: launches, device and host time,
    host reads per step, and the ops that took the most time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = any(engine.device.type == "cuda" for engine, _ in engines.values())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    print(f"profile of {PROFILED_STEPS} more steps of each model (torch.profiler, per step):")
    tops = {}
    for name, cfg in runs.items():
        engine = engines[name][0]
        with profile(activities=activities) as prof:
            for step in range(first_step, first_step + PROFILED_STEPS):
                gpt.train_step(engine, cfg, *gpt.train_batch(tokens, cfg, step, 0, 0))
            if cuda:
                torch.cuda.synchronize(engine.device)
        events = prof.key_averages()
        per_step = lambda total: total / PROFILED_STEPS  # noqa: E731
        items = sum(e.count for e in events if e.key == "aten::_local_scalar_dense")
        host_ms = sum(e.self_cpu_time_total for e in events) / 1e3
        line = f"  {name:<9} host {per_step(host_ms):8.2f} ms, {per_step(items):5.1f} .item() calls"
        if cuda:
            launches = sum(e.count for e in events if e.key in _LAUNCHES)
            waits = sum(e.count for e in events if e.key == "cudaStreamSynchronize")
            device_ms = sum(e.self_device_time_total for e in events) / 1e3
            line += (f", {per_step(waits):5.1f} host waits for the GPU, {per_step(launches):7.1f} kernel launches, "
                     f"device {per_step(device_ms):8.2f} ms")
        print(line)
        key = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        tops[name] = [(e.key, per_step(e.count), per_step(key(e)) / 1e3)
                      for e in sorted(events, key=key, reverse=True)[:10] if key(e) > 0]
    for name, top in tops.items():
        print(f"{name} model, the ops with the most {'device' if cuda else 'host'} time (calls and ms per step):")
        print("\n".join(f"  {op[:60]:<60} {calls:7.1f} {ms:8.3f}" for op, calls, ms in top))


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = flag_parser(gpt.TrainConfig, __doc__)
    parser.prog = "recipes.bench.gpt"
    parser.set_defaults(steps=30)  # timed steps of each model (the recipe's 1200 train)
    parser.add_argument("--warmup", type=int, default=100,
                        help="untimed steps of each model first (the products are chosen and the router settles) "
                             "(default: %(default)s)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time each feed-forward block, the MoE layers' gate and experts, and the "
                             "optimizer step (recipes.bench.step_breakdown)")
    parser.add_argument("--profile", action="store_true",
                        help=f"also profile {PROFILED_STEPS} more steps of each model (torch.profiler): launches, "
                             "device and host time, host reads, the costliest ops")
    parser.add_argument("--deepspeed", choices=("auto", "on", "off"), default="auto",
                        help="also the model with DeepSpeed's MoE layer: where importable (auto), required (on), "
                             "or not (off) (default: %(default)s)")
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    warmup, breakdown, profiled, deepspeed_mode = (args.__dict__.pop(flag)
                                                   for flag in ("warmup", "breakdown", "profile", "deepspeed"))
    steps = args.steps
    if steps < 1 or warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0, got {steps} and {warmup}")
    base = gpt.TrainConfig(**vars(args))
    tokens, _ = gpt.split_tokens(gpt.load_text(base.data), base.val_fraction, base.seq_len)
    builders = {"moe": None, "dense": None}
    opened = not _distributed()  # a process group DeepSpeed's layer opens for the run is closed at its end
    try:
        if deepspeed_mode != "off":
            unfit = deepspeed_unfit(base)
            build = None if unfit else _deepspeed_layer()
            if unfit or build is None:
                why = (f"it has no counterpart for {unfit}" if unfit
                       else "deepspeed is not importable in this environment")
                if deepspeed_mode == "on":
                    parser.error(f"--deepspeed on: DeepSpeed's MoE layer cannot run here: {why}")
                if unfit:
                    print(f"DeepSpeed's MoE layer left out: {why}")
            else:
                builders["deepspeed"] = build
        results = _run(base, builders, tokens, warmup, steps, breakdown, profiled)
        records.record_run(record_dir, "bench_gpt", "recipes.bench.gpt", argv, results)
        return results
    finally:
        if opened and _distributed():
            _close_deepspeed()


def _run(base, builders: dict, tokens, warmup: int, steps: int, breakdown: bool, profiled: bool) -> dict:
    """Build and time the models (`builders`: name -> its MoE layers' builder or None); print; each one's tokens/s."""
    logs = tempfile.TemporaryDirectory(prefix="bench_gpt-")  # TensorBoard writes here, as the recipe writes to runs/
    runs = {name: gpt.TrainConfig(**{**vars(base), "dense": name == "dense", "log_dir": logs.name, "run_name": name})
            for name in builders}
    engines = {name: _engine(cfg, builders[name]) for name, cfg in runs.items()}
    # with --cuda-graphs, each model's step replays a graph, captured after the first steps (optim.graphs)
    stepper = (lambda engine, cfg: GraphedStep(engine, lambda x, y: gpt.train_step(engine, cfg, x, y))) \
        if base.cuda_graphs else (lambda engine, cfg: lambda x, y: gpt.train_step(engine, cfg, x, y))
    try:
        steps_of = {name: stepper(engines[name][0], cfg) for name, cfg in runs.items()}
    except ValueError as error:  # a step no graph can hold: the reasons, one line
        raise SystemExit(f"recipes.bench.gpt: error: {error}") from None
    timers = {}
    if breakdown:  # hooks on every model's blocks and optimizer, cleared when the timed steps begin
        timers = {name: StepBreakdown(engine.module, engine.optimizer) for name, (engine, _) in engines.items()}
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{base.batch_size} x {base.seq_len} tokens per step, {base.dtype}")
    times = {name: [] for name in runs}
    faults = {name: [] for name in runs}  # minor page faults of each timed step (fresh memory touched)
    dropped = []  # the MoE layers' dropped fraction of each timed step
    with gpt.compile_setup(base):  # the recipe's Dynamo setup for --compile (nothing without it)
        for step in range(warmup + steps):
            if step == warmup:
                for timer in timers.values():
                    timer.clear()
            for name, cfg in runs.items():
                x, y = gpt.train_batch(tokens, cfg, step, 0, 0)
                faulted, start = _minor_faults(), time.perf_counter()
                steps_of[name](x, y).item()
                if step >= warmup:
                    times[name].append(time.perf_counter() - start)
                    if faulted is not None:
                        faults[name].append(_minor_faults() - faulted)
                    layers = engines[name][0].last_routing_stats
                    if name == "moe" and layers:
                        dropped.append(sum(layer.dropped_fraction for layer in layers) / len(layers))
    results = {}
    for name in runs:
        ms = statistics.median(times[name]) * 1e3
        total, active = engines[name][1]
        results[name] = base.batch_size * base.seq_len / ms * 1e3
        print(f"{name:<9} {total:>10,} parameters {active:>10,} active  {ms:8.1f} ms/step  "
              f"{results[name]:9.0f} tokens/s")
    print(f"MoE / dense tokens/s: {results['moe'] / results['dense']:.3f}")
    if "deepspeed" in results:
        print(f"MoE with DeepSpeed's layer / dense tokens/s: {results['deepspeed'] / results['dense']:.3f}")
    if dropped:
        print(f"MoE choices dropped over capacity in the timed steps: {100 * statistics.mean(dropped):.1f}% "
              f"(after {warmup} untimed steps)")
    print(_spread(times["dense"], times["moe"]))
    if "deepspeed" in times:
        print("DeepSpeed's layer, " + _spread(times["dense"], times["deepspeed"], "DeepSpeed"))
    if all(faults.values()):
        print("minor page faults per step (median): " +
              ", ".join(f"{name} {statistics.median(counts):.0f}" for name, counts in faults.items()))
    for name, timer in timers.items():
        print(f"{name} model, parts of the timed steps:")
        print("\n".join("  " + line for line in timer.lines()))
        timer.remove()
    if profiled:
        with gpt.compile_setup(base):
            _profile(engines, runs, tokens, warmup + steps)
    for engine, _ in engines.values():
        if engine.monitor is not None:
            engine.monitor.close()
    logs.cleanup()
    tally = {}
    for choice in gemm.choices().values():
        tally[choice] = tally.get(choice, 0) + 1
    print(f"CPU products by measured choice (shape classes): {tally or 'none measured'}")
    return results


if __name__ == "__main__":
    main()
