"""A short MoE training demo on a CPU: experts learn to specialise on a synthetic mixture task.

    python -m recipes.demo                   # a few seconds on a laptop CPU
    python -m recipes.demo --experts 8 --k 2 --steps 600

The data is built here: tokens come from `--clusters` Gaussian clusters, and each cluster has its
own random target map, so one dense MLP must fit them all while an MoE can give each cluster its
own expert. The model is x + MoE(LayerNorm(x)) followed by a linear read-out, trained with AdamW on
mean-squared error plus the load-balancing loss. It prints the loss, the load-balancing loss and
the tokens each expert received, and at the end the loss of a dense model of the same active size.
"""

import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from recipes.cli import flag_parser


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


class Model(nn.Module):
    """Residual MoE block and a linear read-out; `dense=True` swaps the MoE for one expert-sized MLP."""

    def __init__(self, cfg: DemoConfig, dense: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(cfg.hidden)
        expert = nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), nn.GELU(), nn.Linear(cfg.ffn, cfg.hidden))
        self.ffn = expert if dense else MoE(cfg.hidden, expert, num_experts=cfg.experts, k=cfg.k,
                                            capacity_factor=cfg.capacity_factor, min_capacity=0)
        self.head = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x):
        out = self.ffn(self.norm(x))
        if isinstance(out, tuple):
            out, l_aux, exp_counts = out
        else:
            l_aux, exp_counts = x.new_zeros(()), None
        return self.head(x + out), l_aux, exp_counts


def make_task(cfg: DemoConfig):
    g = torch.Generator().manual_seed(cfg.seed)
    centers = torch.randn(cfg.clusters, cfg.hidden, generator=g) * 3
    maps = torch.randn(cfg.clusters, cfg.hidden, cfg.hidden, generator=g) / cfg.hidden**0.5

    def batch():
        cluster = torch.randint(cfg.clusters, (cfg.batch,), generator=g)
        x = centers[cluster] + torch.randn(cfg.batch, cfg.hidden, generator=g)
        y = torch.tanh(torch.einsum("bi,bij->bj", x, maps[cluster]))
        return x, y

    return batch


def train(cfg: DemoConfig, dense: bool) -> float:
    torch.manual_seed(cfg.seed)
    model = Model(cfg, dense)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    batch = make_task(cfg)
    start, recent = time.perf_counter(), []
    for step in range(1, cfg.steps + 1):
        x, y = batch()
        pred, l_aux, exp_counts = model(x)
        mse = nn.functional.mse_loss(pred, y)
        loss = mse + cfg.aux_coef * l_aux
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        recent = (recent + [mse.item()])[-cfg.log_interval :]
        if not dense and (step % cfg.log_interval == 0 or step == 1):
            tokens_per_s = step * cfg.batch / (time.perf_counter() - start)
            print(f"step {step:5d}  mse {mse.item():.4f}  l_aux {l_aux.item():.3f}  "
                  f"expert tokens {exp_counts.tolist()}  {tokens_per_s:,.0f} tokens/s")
    return sum(recent) / len(recent)


def main(argv=None) -> dict:
    parser = flag_parser(DemoConfig, __doc__)
    cfg = DemoConfig(**vars(parser.parse_args(argv)))
    if cfg.k > cfg.experts:
        parser.error(f"--k ({cfg.k}) must be at most --experts ({cfg.experts})")
    print("config:", asdict(cfg))
    moe_mse = train(cfg, dense=False)
    dense_mse = train(cfg, dense=True)
    print(f"final mse (mean of the last {cfg.log_interval} steps): MoE {moe_mse:.4f}  dense MLP of one expert's size {dense_mse:.4f}")
    return {"moe": moe_mse, "dense": dense_mse}


if __name__ == "__main__":
    main()
