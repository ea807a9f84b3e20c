"""A short MoE training demo on a CPU: experts learn to specialise on a synthetic mixture task.

    python -m recipes.demo                   # a few seconds on a laptop CPU
    python -m recipes.demo --experts 8 --k 2 --steps 600
    torchrun --nproc_per_node 4 -m recipes.demo --experts 8 --ep-world-size 2   # expert parallelism
    torchrun --nproc_per_node 4 -m recipes.demo --experts 8 --ep-world-size 2 --stage 3 --dtype bf16

The data is built here: tokens come from `--clusters` Gaussian clusters, and each cluster has its
own random target map, so one dense MLP must fit them all while an MoE can give each cluster its
own expert. The model is x + MoE(LayerNorm(x)) followed by a linear read-out, trained with AdamW on
mean-squared error plus the load-balancing loss. It prints the loss, the load-balancing loss and
the tokens each expert received, and at the end the loss of a dense model of the same active size.

Under torchrun every rank draws its own batches; with --ep-world-size e each rank holds
experts / e experts and tokens reach them by all-to-all. Training goes through the engine
(`optim.initialize`): --stage picks the ZeRO stage (0-3) and --dtype fp32, bf16 or fp16; each rank
prints the tokens its experts received.
"""

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from parallel import init_distributed
from recipes.common.cli import flag_parser, require_at_least, require_positive


@dataclass(kw_only=True)
class DemoConfig:
    steps: int = 400
    batch: int = 512
    hidden: int = 64
    ffn: int = 128
    experts: int = 4
    k: int = 1
    clusters: int = 4
    capacity_factor: float = 1.25
    aux_coef: float = 0.01
    lr: float = 3e-3
    log_interval: int = 50
    seed: int = 0
    ep_world_size: int = 1
    stage: int = 0
    dtype: str = "fp32"


class Model(nn.Module):
    """Residual MoE block and a linear read-out; `dense=True` swaps the MoE for one expert-sized MLP."""

    def __init__(self, cfg: DemoConfig, dense: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        expert = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        self.ffn = expert if dense else MoE(cfg.hidden, expert, num_experts=cfg.experts, k=cfg.k,
                                            capacity_factor=cfg.capacity_factor, min_capacity=0,
                                            ep_size=cfg.ep_world_size, expert_init="per_expert_seed", seed=cfg.seed)
        self.head = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        out = self.ffn(self.norm(x))
        if isinstance(out, tuple):
            out, l_aux, exp_counts = out
        else:
            l_aux, exp_counts = x.new_zeros(()), None
        return self.head(x + out), l_aux, exp_counts


def make_task(cfg: DemoConfig, rank: int = 0):
    g = torch.Generator().manual_seed(cfg.seed)
    centers = torch.randn(cfg.clusters, cfg.hidden, generator=g) * 3
    maps = torch.randn(cfg.clusters, cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5
    g.manual_seed(cfg.seed + 1 + rank)  # the task is shared, the batches are each rank's own

    def batch():
        cluster = torch.randint(cfg.clusters, (cfg.batch,), generator=g)
        x = centers[cluster] + torch.randn(cfg.batch, cfg.hidden, generator=g)
        y = torch.tanh(torch.einsum("bi,bij->bj", x, maps[cluster]))
        return x, y

    return batch


def train(cfg: DemoConfig, dense: bool, rank: int = 0, world: int = 1) -> float:
    torch.manual_seed(cfg.seed)
    model = Model(cfg, dense)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = initialize(model, model_parameters=groups, config={
        "train_micro_batch_size_per_gpu": cfg.batch, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr}}, "zero_optimization": {"stage": cfg.stage},
        "bf16": {"enabled": cfg.dtype == "bf16"}, "fp16": {"enabled": cfg.dtype == "fp16"}, "steps_per_print": 10**9,
    })
    batch = make_task(cfg, rank)
    start, recent = time.perf_counter(), []
    for step in range(1, cfg.steps + 1):
        x, y = (t.to(engine.device) for t in batch())
        pred, l_aux, exp_counts = engine(x)
        mse = nn.functional.mse_loss(pred.float(), y)
        engine.backward(mse + cfg.aux_coef * l_aux)
        engine.step()
        recent = (recent + [mse.item()])[-cfg.log_interval :]
        if not dense and rank == 0 and (step % cfg.log_interval == 0 or step == 1):
            tokens_per_s = step * cfg.batch / (time.perf_counter() - start)
            print(f"step {step:5d}  mse {mse.item():.4f}  l_aux {l_aux.item():.3f}  "
                  f"expert tokens {exp_counts.tolist()}  {tokens_per_s:,.0f} tokens/s", flush=True)
    if not dense and world > 1:
        moe_layer = model.ffn
        local = moe_layer.deepspeed_moe.routing.kept_counts()  # this rank's tokens, by global expert
        first = moe_layer.ep_rank * moe_layer.num_local_experts
        line = (f"rank {rank}: holds experts {first}..{first + moe_layer.num_local_experts - 1}; "
                f"its tokens went to experts {local.tolist()} in the last step")
        lines = [None] * world
        dist.all_gather_object(lines, line)  # printed by rank 0 in rank order: ranks' own prints interleave
        if rank == 0:
            print("\n".join(lines), flush=True)
    return sum(recent) / len(recent)


def main(argv=None) -> dict:
    parser = flag_parser(DemoConfig, __doc__)
    cfg = DemoConfig(**vars(parser.parse_args(argv)))
    require_at_least(parser, cfg, ("steps", "batch", "hidden", "ffn", "experts", "k", "clusters", "log_interval",
                                   "ep_world_size"))
    if cfg.k > cfg.experts:
        parser.error(f"--k ({cfg.k}) must be at most --experts ({cfg.experts})")
    require_positive(parser, cfg, ("capacity_factor", "lr"))
    rank, world = init_distributed()
    if world % cfg.ep_world_size or cfg.experts % cfg.ep_world_size:
        parser.error(f"--ep-world-size ({cfg.ep_world_size}) must divide the number of processes ({world}) "
                     f"and --experts ({cfg.experts})")
    if cfg.stage not in (0, 1, 2, 3) or cfg.dtype not in ("fp32", "bf16", "fp16"):
        parser.error(f"--stage must be 0-3 and --dtype fp32, bf16 or fp16, got {cfg.stage} and {cfg.dtype!r}")
    if rank == 0:
        print("config:", asdict(cfg), f"processes={world}", flush=True)
    moe_mse = train(cfg, dense=False, rank=rank, world=world)
    result = {"moe": moe_mse}
    if world == 1:
        result["dense"] = train(cfg, dense=True)
        print(f"final mse (mean of the last {min(cfg.log_interval, cfg.steps)} steps): MoE {moe_mse:.4f}  "
              f"dense MLP of one expert's size {result['dense']:.4f}", flush=True)
    elif rank == 0:
        print(f"final mse on rank 0 (mean of the last {min(cfg.log_interval, cfg.steps)} steps): MoE {moe_mse:.4f}",
              flush=True)
    if dist.is_initialized():
        dist.barrier()  # no rank tears its group down while a peer's last exchange is in flight
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
