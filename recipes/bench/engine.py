"""A full training step at each ZeRO stage, ours beside DeepSpeed's engine, and the memory it takes.

    torchrun --standalone --nproc_per_node 2 -m recipes.bench.engine --ep-world-size 2      # the README's figures
    torchrun --standalone --nproc_per_node 4 -m recipes.bench.engine --ep-world-size 2 --stages 0 1 2 3 --dtype bf16
    python -m recipes.bench.engine --deepspeed off                                        # one process, ours only

The model: --blocks blocks of Linear(hidden, hidden), GELU and an MoE layer (--experts experts of
Linear(hidden, ffn), GELU, Linear(ffn, hidden), top-2, capacity factor 1.25), a residual around each
MoE layer; the loss is the mean square of the output plus 0.01 l_aux. Each process feeds --tokens
tokens. Both engines take the same model (DeepSpeed's with its own MoE layer, the same weights),
AdamW (torch's fused kernel for both: DeepSpeed's own Adam needs a compiled extension) and gradient
clipping 1.0, and the same `reduce_bucket_size` and `overlap_comm`. When `deepspeed` is importable (and --deepspeed is not off) its engine runs in the same
processes, and the two alternate step by step so that both see the same machine.

Rank 0 prints, per stage: the median milliseconds of a full step (forward, backward, engine step)
for each engine and their ratio; the most bytes a step allocated at once, measured
(`optim.memory.LiveBytes`: every storage the step creates, until freed) for each engine; and our
model states (`engine.memory_breakdown()`: parameters, gradients, optimizer states) beside the ZeRO
paper's accounting. The first lines name the CPU, the thread count and our layer's expert layout.
"""

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.memory import LiveBytes
from parallel import init_distributed, reset_groups
from recipes.bench.moe import chosen_backends
from recipes.common import records
from recipes.common.cli import fail, flag_parser
from recipes.common.training import cpu_name

BYTES_PGK = {"fp32": (4, 4, 8), "bf16": (2, 4, 12)}  # parameters, gradients, optimizer states (+ fp32 masters)


@dataclass(kw_only=True)
class BenchConfig:
    blocks: int = 4
    hidden: int = 256
    ffn: int = 1024
    experts: int = 8
    tokens: int = field(default=2048, metadata={"help": "tokens per process and step"})
    steps: int = 10
    warmup: int = 3
    ep_world_size: int = 1
    stages: list[int] = field(default_factory=lambda: [0, 1, 2], metadata={"nargs": "+", "type": int})
    dtype: str = field(default="fp32", metadata={"choices": list(BYTES_PGK)})
    deepspeed: str = field(default="auto", metadata={"choices": ["auto", "on", "off"]})
    reduce_bucket_size: int = field(default=500_000_000, metadata={"help": "both engines (DeepSpeed's default)"})
    overlap_comm: bool = field(default=False, metadata={"help": "both engines"})


class Block(nn.Module):
    def __init__(self, cfg: BenchConfig, moe_class):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden, cfg.hidden)
        expert = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        self.moe = moe_class(cfg.hidden, expert, num_experts=cfg.experts, ep_size=cfg.ep_world_size, k=2,
                             capacity_factor=1.25, min_capacity=4)

    def forward(self, x):
        out, l_aux, _ = self.moe(nn.functional.gelu(self.linear(x)))
        return x + out, l_aux


class Net(nn.Module):
    def __init__(self, cfg: BenchConfig, moe_class):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(cfg, moe_class) for _ in range(cfg.blocks))

    def forward(self, x):
        l_aux = 0.0
        for block in self.blocks:
            x, block_aux = block(x)
            l_aux = l_aux + block_aux
        return x.float().square().mean() + 0.01 * l_aux


def engine_config(cfg: BenchConfig, stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": cfg.reduce_bucket_size,
                                  "overlap_comm": cfg.overlap_comm},
            "bf16": {"enabled": cfg.dtype == "bf16"}}


def ours(cfg: BenchConfig, stage: int):
    reset_groups()
    model = Net(cfg, MoE)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    config = {**engine_config(cfg, stage), "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    engine, *_ = initialize(model, model_parameters=groups, config=config)
    return engine


def deepspeed_engine(cfg: BenchConfig, stage: int, like: nn.Module):
    """DeepSpeed's engine over the same model built from its MoE layer, starting from `like`'s weights."""
    import deepspeed  # optional: only for side-by-side figures
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    model = Net(cfg, DeepSpeedMoE)
    copy_weights(like, model)
    groups = split({"params": list(model.parameters()), "name": "dense"})
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    config = {**engine_config(cfg, stage), "zero_allow_untested_optimizer": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def copy_weights(source: nn.Module, target: nn.Module) -> None:
    """Our per-expert-stacked weights into DeepSpeed's per-expert modules (this rank's local experts)."""
    state = source.state_dict()
    with torch.no_grad():
        for name, param in target.named_parameters():
            if name in state and state[name].shape == param.shape:
                param.copy_(state[name])


def step(engine, x) -> None:
    engine.backward(engine(x))
    engine.step()


def time_side_by_side(engines: dict, x: torch.Tensor, cfg: BenchConfig) -> dict[str, float]:
    """Median ms per step of each engine, stepping them in turn so that both see the same machine."""
    times = {name: [] for name in engines}
    for i in range(cfg.warmup + cfg.steps):
        for name, engine in engines.items():
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            step(engine, x)
            if i >= cfg.warmup:
                times[name].append((time.perf_counter() - start) * 1000)
    return {name: statistics.median(values) for name, values in times.items()}


def step_peak(engine, x) -> int:
    """The most bytes one step allocated at once beyond what was alive when it began (measured)."""
    tracker = LiveBytes()
    with tracker:
        step(engine, x)
    return tracker.peak


def accounting(cfg: BenchConfig, stage: int, dense: int, expert: int, world: int) -> float:
    p, g, k = BYTES_PGK[cfg.dtype] if stage < 3 else (4, 4, 8)
    total = 0.0
    for psi, shards in ((dense, world), (expert, world // cfg.ep_world_size)):
        total += psi * (p / (shards if stage >= 3 else 1) + g / (shards if stage >= 2 else 1)
                        + k / (shards if stage >= 1 else 1))
    return total


def main(argv=None) -> list[dict]:
    parser = flag_parser(BenchConfig, __doc__)
    parser.prog = "recipes.bench.engine"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = BenchConfig(**vars(args))
    rank, world = init_distributed()
    if world % cfg.ep_world_size or cfg.experts % cfg.ep_world_size:
        fail(parser, f"--ep-world-size ({cfg.ep_world_size}) must divide the processes ({world}) and --experts "
                     f"({cfg.experts})")
    if any(s not in (0, 1, 2, 3) for s in cfg.stages):
        fail(parser, f"--stages must be among 0 1 2 3, got {cfg.stages}")
    try:
        import deepspeed  # noqa: F401
        have_deepspeed = cfg.deepspeed != "off"
    except ImportError:
        if cfg.deepspeed == "on":
            fail(parser, "--deepspeed on: deepspeed is not importable in this environment")
        have_deepspeed = False
    torch.set_num_threads(max(torch.get_num_threads() // max(world, 1), 1) if world > 1 else torch.get_num_threads())
    x = torch.randn(cfg.tokens, cfg.hidden, generator=torch.Generator().manual_seed(rank))
    rows = []
    for stage in cfg.stages:
        mine = ours(cfg, stage)
        engines = {"ours": mine}
        if have_deepspeed and stage < 3:  # DeepSpeed's stage 3 with MoE layers is not run here
            engines["deepspeed"] = deepspeed_engine(cfg, stage, mine.module)
        if rank == 0 and stage == cfg.stages[0]:
            layout = mine.module.blocks[0].moe.deepspeed_moe._layout(x.device, x.dtype)
            print(f"config: {asdict(cfg)} processes={world} threads/process={torch.get_num_threads()}")
            print(f"CPU: {cpu_name()}; torch {torch.__version__}; our expert layout: {layout}; "
                  f"AdamW fused: {mine.optimizer.defaults.get('fused')}; deepspeed: {have_deepspeed}")
        ms = time_side_by_side(engines, x, cfg)
        peaks = {name: step_peak(engine, x) for name, engine in engines.items()}
        report = mine.memory_breakdown()
        psi_dense = sum(i.param.numel() for u in mine.units for i in u.infos if not i.expert)
        psi_expert = sum(i.param.numel() for u in mine.units for i in u.infos if i.expert)
        row = {"stage": stage, "ms": ms, "peak": peaks, "model_states": report["total"],
               "zero": accounting(cfg, stage, psi_dense, psi_expert, world)}
        rows.append(row)
        if rank == 0:
            theirs = (f"deepspeed {ms['deepspeed']:7.1f} ms  ours/deepspeed speed {ms['deepspeed'] / ms['ours']:.2f}x  "
                      f"step peak {peaks['deepspeed'] / 2**20:6.1f} MiB  " if "deepspeed" in ms else "")
            print(f"stage {stage}: ours {ms['ours']:7.1f} ms  {theirs}| ours step peak {peaks['ours'] / 2**20:6.1f} MiB, "
                  f"model states {report['total'] / 2**20:6.1f} MiB (ZeRO says {row['zero'] / 2**20:6.1f})", flush=True)
        del engines, mine
    if rank == 0:
        print(f"CPU products (shape classes -> backend, measured): {chosen_backends()}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    records.record_run(record_dir, "bench_engine", "recipes.bench.engine", argv, rows)
    return rows


if __name__ == "__main__":
    main()
