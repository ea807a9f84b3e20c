"""A training script written the way DeepSpeed's examples are, with only the imports renamed.

It uses every DeepSpeed name the project offers a script: `add_config_arguments` and a
`--deepspeed_config` JSON file read by `initialize(args=...)`, `init_distributed`, `get_accelerator()`,
`MoE` and its param groups, and the engine's queries. It writes what they answered, a JSON file per rank, for the test
(tests/recipes/test_deepspeed_style.py) to check. Run with `python -m tests.recipes.deepspeed_style
--deepspeed --deepspeed_config CONFIG.json --ep-world-size E --out DIR`, alone or under torchrun.
"""

import argparse
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import moe
import optim
import parallel
from moe import split_params_into_different_moe_groups_for_optimizer
from parallel import get_accelerator


class Classifier(nn.Module):
    """Two dense layers around one MoE layer of Linear experts, DeepSpeed's CIFAR example's pattern."""

    def __init__(self, args):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.moe = moe.MoE(hidden_size=16, expert=nn.Linear(16, 16), num_experts=args.num_experts,
                           ep_size=args.ep_world_size, k=args.top_k, min_capacity=0,
                           noisy_gate_policy=args.noisy_gate_policy)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        x, _, _ = self.moe(F.relu(self.fc1(x)))
        return self.fc2(x)


def main():
    parser = argparse.ArgumentParser(description="a DeepSpeed-style script")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--ep-world-size", type=int, default=1)
    parser.add_argument("--num-experts", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=1)
    parser.add_argument("--noisy-gate-policy", type=str, default=None)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", required=True)
    parser = optim.add_config_arguments(parser)
    args = parser.parse_args()

    parallel.init_distributed()
    get_accelerator().manual_seed(0)  # the same data on every rank; the model is built unseeded below
    x = torch.randn(512, 12)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    torch.manual_seed(int(os.environ.get("RANK", 0)) + 100)  # each rank its own template, as an unseeded script
    net = Classifier(args)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(net.parameters()), "name": "parameters"})
    engine, optimizer, loader, scheduler = optim.initialize(
        args=args, model=net, model_parameters=groups, training_data=torch.utils.data.TensorDataset(x, y))
    device = get_accelerator().device_name(engine.local_rank)
    target_dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.half if engine.fp16_enabled() else None
    losses, norms, boundaries = [], [], []
    for step, (inputs, labels) in zip(range(args.steps * engine.gradient_accumulation_steps()), loader):
        inputs, labels = inputs.to(device), labels.to(device)
        if target_dtype is not None:
            inputs = inputs.to(target_dtype)
        boundaries.append(engine.is_gradient_accumulation_boundary())
        loss = F.cross_entropy(engine(inputs).float(), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if boundaries[-1]:
            norms.append(engine.get_global_grad_norm())
    engine.save_16bit_model(args.out, f"model_rank{engine.global_rank}.bin" if engine.global_rank else "model.bin")
    report = {
        "local_rank": engine.local_rank, "global_rank": engine.global_rank, "world_size": engine.world_size,
        "device": device, "backend": get_accelerator().communication_backend_name(),
        "bf16": engine.bfloat16_enabled(), "fp16": engine.fp16_enabled(),
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "accumulation": engine.gradient_accumulation_steps(), "boundaries": boundaries,
        "losses": losses, "norms": norms, "module_is_net": engine.module is net, "optimizer_is": optimizer is engine.optimizer,
        "scheduler_is": scheduler is engine.lr_scheduler, "lr": engine.get_lr(),
        "batch": len(next(iter(loader))[0]),
    }
    with open(os.path.join(args.out, f"report_rank{engine.global_rank}.json"), "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    main()
