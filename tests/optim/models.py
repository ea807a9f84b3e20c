"""A small MoE model and data shared by the engine tests."""

import torch
from torch import nn

from moe import MoE

M, H, E, CLASSES = 8, 16, 4, 5


class Net(nn.Module):
    """Linear -> ReLU -> MoE (top-2, E experts) -> Linear; returns (logits, l_aux)."""

    def __init__(self, ep_size: int = 1, hidden: int = H, experts: int = E, k: int = 2, capacity_factor: float = 1.0,
                 dense_width: int = 0):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(M, M)
        self.moe = MoE(M, nn.Sequential(nn.Linear(M, hidden), nn.GELU(), nn.Linear(hidden, M)), num_experts=experts,
                       ep_size=ep_size, k=k, capacity_factor=capacity_factor, min_capacity=0, use_rts=False,
                       top2_2nd_expert_sampling=False, expert_init="per_expert_seed", seed=7)
        self.out = nn.Linear(M, CLASSES)
        # an optional dense block after the MoE layer, to give dense parameters some weight
        self.block = nn.Sequential(nn.Linear(M, dense_width), nn.ReLU(), nn.Linear(dense_width, M)) if dense_width else None

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        if self.block is not None:
            h = h + self.block(h)
        return self.out(h), l_aux


def batch(step: int, micro: int, rank: int, size: int = 6):
    """The micro-batch that data-parallel rank `rank` sees at (step, micro)."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(size, M, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


def loss_of(output, target):
    logits, l_aux = output
    return nn.functional.cross_entropy(logits.float(), target) + 0.01 * l_aux


def reference_steps(model, optimizer, steps, world, accumulation, clip, first_step=0):
    """One process, every expert: the same micro-batches, gradients averaged over the global batch."""
    for step in range(first_step, first_step + steps):
        for micro in range(accumulation):
            for rank in range(world):
                x, y = batch(step, micro, rank)
                (loss_of(model(x), y) / (world * accumulation)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()


ADAMW = {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.1}}


def config(stage, accumulation=2, clip=0.05, optimizer=ADAMW, **extra):
    return {
        "train_micro_batch_size_per_gpu": 6, "gradient_accumulation_steps": accumulation, "gradient_clipping": clip,
        "optimizer": optimizer,
        "zero_optimization": {"stage": stage}, **extra,
    }


def engine_steps(engine, steps, rank, accumulation, first_step=0):
    for step in range(first_step, first_step + steps):
        for micro in range(accumulation):
            x, y = batch(step, micro, rank)
            engine.backward(loss_of(engine(x), y))
            engine.step()
