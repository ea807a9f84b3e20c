"""Model-state memory and step time of the engine at every ZeRO stage, beside the ZeRO accounting.

    torchrun --standalone --nproc_per_node 4 -m recipes.bench_engine --ep-world-size 2
    python -m recipes.bench_engine                       # one process: every stage holds everything

For each stage and precision (fp32; bf16 with fp32 master weights; bf16 master weights, gradients
and Adam states) rank 0 prints its measured bytes of parameters, gradients and optimizer states
(`engine.memory_breakdown()`), the ZeRO paper's figure for the same model (psi dense and psi_e local
expert parameters, W ranks, ep e), and the mean milliseconds of a training step (forward, backward,
optimizer step) on a small transformer-style MoE block, AdamW.
"""

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe import MoE
from optim import initialize
from parallel import init_distributed, reset_groups
from recipes.cli import flag_parser


@dataclass(kw_only=True)
class BenchConfig:
    hidden: int = 256
    ffn: int = 1024
    experts: int = 8
    tokens: int = 1024
    steps: int = 5
    warmup: int = 2
    ep_world_size: int = 1


class Block(nn.Module):
    def __init__(self, cfg: BenchConfig):
        super().__init__()
        torch.manual_seed(0)
        self.attn_like = nn.Linear(cfg.hidden, cfg.hidden)
        self.dense_ffn = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        expert = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        self.moe = MoE(cfg.hidden, expert, num_experts=cfg.experts, ep_size=cfg.ep_world_size, k=2,
                       capacity_factor=1.25, expert_init="per_expert_seed")

    def forward(self, x):
        x = x + self.dense_ffn(torch.relu(self.attn_like(x)))
        out, l_aux, _ = self.moe(x)
        return (x + out).float().square().mean() + 0.01 * l_aux


PRECISIONS = {
    "fp32": ({}, (4, 4, 8)),
    "bf16": ({"bf16": {"enabled": True}}, (2, 4, 12)),  # gradients accumulate in fp32
    "bf16 low": ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
                 (2, 2, 4)),
}


def accounting(stage: int, psi: int, shards: int, bytes_pgk: tuple[int, int, int]) -> float:
    p, g, k = bytes_pgk
    return psi * (p / (shards if stage >= 3 else 1) + g / (shards if stage >= 2 else 1) + k / (shards if stage >= 1 else 1))


def measure(cfg: BenchConfig, stage: int, extra: dict, rank: int) -> tuple[dict, float, int, int]:
    reset_groups()
    model = Block(cfg)
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    engine, *_ = initialize(model, config={"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**9,
                                           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                                           "zero_optimization": {"stage": stage}, **extra})
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=g)
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            start = time.perf_counter()
        engine.backward(engine(x))
        engine.step()
    ms = (time.perf_counter() - start) * 1000 / cfg.steps
    return engine.memory_breakdown(), ms, dense, expert


def main(argv=None) -> list[dict]:
    cfg = BenchConfig(**vars(flag_parser(BenchConfig, __doc__).parse_args(argv)))
    rank, world = init_distributed()
    if rank == 0:
        print("config:", asdict(cfg), f"processes={world}")
        print(f"{'stage':>5} {'precision':>9} {'params':>12} {'grads':>12} {'optimizer':>12} {'total':>12} "
              f"{'ZeRO says':>12} {'ms/step':>8}")
    rows = []
    for stage in (0, 1, 2, 3):
        for name, (extra, bytes_pgk) in PRECISIONS.items():
            report, ms, dense, expert = measure(cfg, stage, extra, rank)
            expected = accounting(stage, dense, world, bytes_pgk) + \
                accounting(stage, expert, world // cfg.ep_world_size, bytes_pgk)
            rows.append({"stage": stage, "precision": name, **{k: report[k] for k in
                        ("parameters", "gradients", "optimizer_states", "total")}, "zero": expected, "ms": ms})
            if rank == 0:
                print(f"{stage:>5} {name:>9} {report['parameters']:>12,} {report['gradients']:>12,} "
                      f"{report['optimizer_states']:>12,} {report['total']:>12,} {expected:>12,.0f} {ms:>8.1f}",
                      flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
