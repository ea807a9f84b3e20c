"""A DeepSpeed-MoE training script of the common style, where only the import block names the framework.

It does what DeepSpeed scripts do and this project must take as they are: the model (with its MoE
layer, `ep_size` from `--ep-world-size`) is built before `init_distributed`; the script builds its
own AdamW over the MoE param groups and passes it to `initialize`; its JSON config carries comment
keys (`_comment`, `_precision_comment`, `_zero_comment`); it asks `comm` (DeepSpeed's
`deepspeed.comm`, here `parallel.comm`) for its rank. `--framework deepspeed` runs the same lines on
DeepSpeed (where it is installed), so the printed losses can be set side by side.

Run: `python -m tests.recipes.deepspeed_client_style --deepspeed_config CONFIG.json --out DIR`, or under
`torchrun --standalone --nproc_per_node 2 -m tests.recipes.deepspeed_client_style ... --ep-world-size 2`.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


def _framework(name):
    """(initialize, init_distributed, add_config_arguments, MoE, split_params, comm): the renamed imports."""
    if name == "deepspeed":
        import deepspeed
        import deepspeed.comm as comm
        from deepspeed.moe.layer import MoE
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split
        return deepspeed.initialize, deepspeed.init_distributed, deepspeed.add_config_arguments, MoE, split, comm
    import optim
    import parallel
    import parallel.comm as comm
    from moe import MoE
    from moe import split_params_into_different_moe_groups_for_optimizer as split
    return optim.initialize, parallel.init_distributed, optim.add_config_arguments, MoE, split, comm


class Net(nn.Module):
    def __init__(self, MoE, ep_size):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.moe = MoE(hidden_size=16, expert=nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)),
                       num_experts=4, ep_size=ep_size, k=2, capacity_factor=2.0, min_capacity=8,
                       top2_2nd_expert_sampling=False)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        h, l_aux, _ = self.moe(F.relu(self.fc1(x)))
        return self.fc2(h), l_aux


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--framework", choices=("ours", "deepspeed"), default="ours")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--ep-world-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=None)
    known, _ = parser.parse_known_args()
    initialize, init_distributed, add_config_arguments, MoE, split, comm = _framework(known.framework)
    args = add_config_arguments(parser).parse_args()

    torch.manual_seed(0)
    net = Net(MoE, args.ep_world_size)  # before any process group, as DeepSpeed scripts build it
    optimizer = torch.optim.AdamW(split({"params": list(net.parameters()), "name": "parameters"}), lr=0.01,
                                  weight_decay=0.01)
    init_distributed(dist_backend="gloo")
    engine, optimizer, _, _ = initialize(args=args, model=net, optimizer=optimizer)
    rank, world = comm.get_rank(), comm.get_world_size()

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.steps * engine.train_batch_size(), 12, generator=generator)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(args.steps):
        total = torch.zeros(())
        for m in range(accumulation):  # micro-batch m of rank r: the same samples at any world size
            start = step * engine.train_batch_size() + (m * world + rank) * micro
            logits, l_aux = engine(x[start:start + micro])
            loss = F.cross_entropy(logits, y[start:start + micro]) + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        comm.all_reduce(total)
        losses.append(float(total) / (world * accumulation))
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    if args.out is not None and rank == 0:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "losses.json"), "w") as handle:
            json.dump({"world": world, "losses": losses, "optimizer": type(optimizer.optimizer).__name__}, handle)


if __name__ == "__main__":
    main()
