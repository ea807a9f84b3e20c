"""CIFAR-10 with MoE layers: the DeepSpeed CIFAR-10 MoE tutorial's model and flags on this framework.

    python -m recipes.cifar --moe --num-experts 4 --top-k 1 --epochs 2 --data-dir ~/data/cifar-10-batches-py
    python -m recipes.cifar --moe --num-experts 2 2 --mlp-type residual --noisy-gate-policy RSample
    python -m recipes.cifar --moe --checkpoint-dir ckpt/cifar --epochs 4 --resume   # continue a run
    torchrun --standalone --nproc_per_node 2 -m recipes.cifar --moe --num-experts 4 --ep-world-size 2 --stage 2

The model is the tutorial's small CNN (two conv + pool layers, Linear 400-120, Linear 120-84); with
--moe, one MoE layer per --num-experts entry follows, each made of experts copied from a
Linear(84, 84), then Linear(84, 10). Without --moe the last layer is Linear(84, 10). The
load-balancing loss is added with --aux-coef (the tutorial leaves it out: use 0 to match).

Data: CIFAR-10's python batches (`data_batch_1..5`, `test_batch`) from --data-dir, read with an
unpickler that admits numpy arrays only. Without them the recipe says so and uses a synthetic
CIFAR-shaped set: 32x32 colour images of ten classes, each class a fixed random colour pattern
under noise and a random shift. Each epoch reports the mean train loss, the test accuracy, the
training speed (images/s) and the accuracy per class; TensorBoard logs go to --log-dir/--run-name
(the engine's scalars and MoE routing statistics, plus test loss and accuracy and images/s).
"""

import os
import pickle
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from moe import MoE, split_params_into_different_moe_groups_for_optimizer
from optim import CheckpointError, ConfigTypeError, initialize
from recipes.common import runner
from recipes.common.cli import (built, engine_config, fail, keep_last_field, noisy_gate_policy, noisy_gate_policy_field,
                                require_at_least, resume_field, start_over_field)
from recipes.common.training import Progress, SetupError, all_sum, prune_checkpoints, resumed_line

CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
MEAN, STD = torch.tensor([0.4914, 0.4822, 0.4465]), torch.tensor([0.2470, 0.2435, 0.2616])


@dataclass(kw_only=True)
class CifarConfig:
    epochs: int = 2
    batch_size: int = field(default=16, metadata={"help": "images per micro-batch and process"})
    log_interval: int = field(default=200, metadata={"help": "steps between progress lines"})
    dtype: str = field(default="fp32", metadata={"choices": ["bf16", "fp16", "fp32"]})
    stage: int = field(default=0, metadata={"choices": [0, 1, 2, 3]})
    moe: bool = field(default=False, metadata={"help": "use MoE layers after fc2"})
    ep_world_size: int = 1
    num_experts: list = field(default_factory=lambda: [1], metadata={
        "nargs": "+", "type": int, "help": "experts per MoE layer, one layer per entry"})
    mlp_type: str = field(default="standard", metadata={"choices": ["standard", "residual"]})
    top_k: int = 1
    min_capacity: int = 0
    noisy_gate_policy: str = noisy_gate_policy_field()
    moe_param_group: bool = field(default=False, metadata={
        "help": "hand the optimizer separate MoE param groups (the engine splits experts out either way)"})
    capacity_factor: float = 1.0
    aux_coef: float = 0.01
    lr: float = 1e-3
    data_dir: str = field(default="", metadata={"help": "folder with CIFAR-10's python batches"})
    train_size: int = field(default=0, metadata={"help": "use only this many training images (0: all)"})
    test_size: int = field(default=0, metadata={"help": "use only this many test images (0: all)"})
    config: str = field(default="", metadata={"help": "a JSON engine config; flags written out override it"})
    checkpoint_dir: str = ""
    resume: str = resume_field()
    start_over: bool = start_over_field()
    keep_last: int = keep_last_field()
    log_dir: str = "runs"
    run_name: str = ""
    seed: int = 0


def engine_fragments(cfg: CifarConfig) -> dict[str, dict]:
    """The tutorial's engine config, entry by entry, keyed by the flag that sets it."""
    return {
        "batch_size": {"train_micro_batch_size_per_gpu": cfg.batch_size, "gradient_accumulation_steps": 1},
        "optimizer": {"optimizer": {"type": "Adam", "params": {"betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_num_steps": 1000}}},
        "lr": {"optimizer": {"params": {"lr": cfg.lr}}, "scheduler": {"params": {"warmup_max_lr": cfg.lr}}},
        "dtype": {"bf16": {"enabled": cfg.dtype == "bf16"},
                  "fp16": {"enabled": cfg.dtype == "fp16", "initial_scale_power": 15}},
        "stage": {"zero_optimization": {"stage": cfg.stage}, "gradient_clipping": 1.0, "steps_per_print": 10**9},
        "run_name": {"tensorboard": {"enabled": True, "output_path": cfg.log_dir, "job_name": cfg.run_name}},
    }


# Data.

class _ArraysOnly(pickle.Unpickler):
    """CIFAR's batches are pickled dicts of numpy arrays and bytes: admit those and nothing else."""

    ALLOWED = frozenset({("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("_codecs", "encode")})  # bytes in protocol-2 pickles

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"CIFAR batch refers to {module}.{name}, which a data file never needs")
        return super().find_class(module, name)


def _read_batch(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        with open(path, "rb") as handle:
            batch = _ArraysOnly(handle, encoding="bytes").load()
        images = torch.from_numpy(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        labels = torch.tensor(batch[b"labels"], dtype=torch.long)
    except (pickle.UnpicklingError, EOFError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{path} is not a CIFAR-10 python batch ({error})") from None
    if len(labels) != len(images) or (labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < 10):
        raise ValueError(f"{path} is not a CIFAR-10 python batch ({len(images)} images, {len(labels)} labels in 0-9)")
    return images, labels


BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)


def missing_batches(data_dir: str) -> list[str]:
    return [name for name in BATCHES if not os.path.isfile(os.path.join(data_dir, name))]


def load_cifar(data_dir: str):
    """(train images uint8 [N, 3, 32, 32], labels, test images, labels), or None when the files are absent."""
    if not data_dir or missing_batches(data_dir):
        return None
    parts = [_read_batch(os.path.join(data_dir, n)) for n in BATCHES]
    train_x, train_y = torch.cat([p[0] for p in parts[:5]]), torch.cat([p[1] for p in parts[:5]])
    return train_x, train_y, parts[5][0], parts[5][1]


def synthetic_cifar(train: int = 10000, test: int = 2000, seed: int = 0):
    """Ten classes of 32x32 RGB images: a fixed low-resolution colour pattern per class, shifted, under noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=32, mode="bilinear", align_corners=False)
    shifts = [(dy, dx) for dy in range(-3, 4) for dx in range(-3, 4)]
    variants = torch.stack([torch.roll(p, s, dims=(1, 2)) for p in patterns for s in shifts])  # [10 * 49, 3, 32, 32]

    def draw(n):
        labels = torch.randint(10, (n,), generator=g)
        which = labels * len(shifts) + torch.randint(len(shifts), (n,), generator=g)
        images = (variants[which] * 0.3 + 0.7 * torch.rand(n, 3, 32, 32, generator=g)) * 255
        return images.round().to(torch.uint8), labels

    return (*draw(train), *draw(test))


def normalise(images: torch.Tensor) -> torch.Tensor:
    return (images.float() / 255 - MEAN[:, None, None]) / STD[:, None, None]


# Model.

class Net(nn.Module):
    """The tutorial's CNN; with MoE layers built from its last linear layer when cfg.moe."""

    def __init__(self, cfg: CifarConfig):
        super().__init__()
        self.conv1, self.pool, self.conv2 = nn.Conv2d(3, 6, 5), nn.MaxPool2d(2, 2), nn.Conv2d(6, 16, 5)
        self.fc1, self.fc2 = nn.Linear(16 * 5 * 5, 120), nn.Linear(120, 84)
        if cfg.moe:
            fc3 = nn.Linear(84, 84)
            self.moe_layer_list = nn.ModuleList(
                MoE(hidden_size=84, expert=fc3, num_experts=n, ep_size=cfg.ep_world_size,
                    use_residual=cfg.mlp_type == "residual", k=cfg.top_k, min_capacity=cfg.min_capacity,
                    capacity_factor=cfg.capacity_factor,
                    noisy_gate_policy=noisy_gate_policy(cfg.noisy_gate_policy),
                    expert_init="per_expert_seed", seed=cfg.seed)
                for n in cfg.num_experts)
            self.fc4 = nn.Linear(84, 10)
        else:
            self.fc3 = nn.Linear(84, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = F.relu(self.fc2(F.relu(self.fc1(x.flatten(1)))))
        l_aux = x.new_zeros((), dtype=torch.float32)
        if hasattr(self, "moe_layer_list"):
            for layer in self.moe_layer_list:
                x, layer_aux, _ = layer(x)
                l_aux = l_aux + layer_aux
            return self.fc4(x), l_aux
        return self.fc3(x), l_aux


# Training.

def shard(n: int, batch: int, rank: int, world: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's image indices for an epoch: equal whole batches on every rank (the rest is left out)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    per_rank = n // (batch * world) * batch
    return order[rank * per_rank:(rank + 1) * per_rank]


@torch.no_grad()
def test(engine, images, labels, cfg: CifarConfig, rank: int, world: int) -> tuple[float, float, list[float]]:
    """Test loss, accuracy and per-class accuracy over every test image (the last batch padded, pads not counted)."""
    engine.eval()
    step = cfg.batch_size * world
    padded = -(-len(images) // step) * step
    index = torch.arange(padded) % len(images)
    counted = torch.arange(padded) < len(images)
    # loss sum, count, then correct and seen per class: summed on the device, read once at the end
    totals = torch.zeros(2 + 20, dtype=torch.float64, device=engine.device)
    for start in range(rank * cfg.batch_size, padded, step):
        rows = index[start:start + cfg.batch_size]
        keep = counted[start:start + cfg.batch_size].to(engine.device)
        logits = engine(normalise(images[rows]).to(engine.device))[0].float()
        y = labels[rows].to(engine.device)
        losses = F.cross_entropy(logits, y, reduction="none")
        totals[0] += torch.where(keep, losses, 0.0).sum()
        totals[1] += keep.sum()
        hit = ((logits.argmax(1) == y) & keep).double()
        totals[2:12].scatter_add_(0, y, hit)
        totals[12:22].scatter_add_(0, y, keep.double())
    engine.train()
    totals = torch.tensor(all_sum(*totals, device=engine.device))
    per_class = (totals[2:12] / totals[12:22].clamp(min=1)).tolist()
    return float(totals[0] / totals[1]), float(totals[2:12].sum() / totals[1]), per_class


def train_step(engine, cfg: CifarConfig, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One micro-batch: batch to the model's device, forward, loss, backward, engine step; returns the loss."""
    images, labels = images.to(engine.device, non_blocking=True), labels.to(engine.device, non_blocking=True)
    logits, l_aux = engine(images)
    loss = F.cross_entropy(logits.float(), labels)
    engine.backward(loss + cfg.aux_coef * l_aux)
    engine.step()
    return loss.detach()


def train(cfg: CifarConfig, given: set[str], rank: int, world: int) -> dict:
    torch.manual_seed(cfg.seed)
    try:
        data = load_cifar(cfg.data_dir)
    except (OSError, ValueError) as error:
        raise SetupError(f"cannot read CIFAR-10 from --data-dir {cfg.data_dir}: {error}") from None
    say = print if rank == 0 else (lambda *a, **k: None)
    source = cfg.data_dir
    if data is None:
        source, synthetic = "synthetic", "a SYNTHETIC CIFAR-shaped set (10 classes of coloured patterns under noise)"
        if cfg.data_dir:
            say(f"CIFAR-10 python batches not found in --data-dir {cfg.data_dir} (missing: "
                f"{', '.join(missing_batches(cfg.data_dir))}): using {synthetic} instead", flush=True)
        else:
            say(f"no --data-dir given: using {synthetic}; to train on CIFAR-10, pass --data-dir with the folder of "
                f"its python batches (cifar-10-batches-py: {', '.join(BATCHES)})", flush=True)
        data = synthetic_cifar(seed=cfg.seed)
    train_x, train_y, test_x, test_y = data
    if cfg.train_size:
        train_x, train_y = train_x[:cfg.train_size], train_y[:cfg.train_size]
    if cfg.test_size:
        test_x, test_y = test_x[:cfg.test_size], test_y[:cfg.test_size]
    try:  # bad model or engine settings stop with one line
        model = built(lambda: Net(cfg), CifarConfig)
        params = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "parameters"}) if cfg.moe_param_group else None
        engine, *_ = initialize(model, model_parameters=params,
                                config=engine_config(engine_fragments(cfg), given, cfg.config))
    except (OSError, ConfigTypeError, ValueError) as error:
        raise SetupError(str(error)) from None
    first_epoch, path = 0, None
    if cfg.resume:
        try:
            path, client = engine.load_checkpoint(cfg.checkpoint_dir)
        except (CheckpointError, OSError) as error:  # refused on every rank: another model's, damaged, gone
            raise SetupError(str(error)) from None
        first_epoch = client["epoch"]
    steps_per_epoch = len(train_x) // (cfg.batch_size * world)
    progress = Progress(cfg.epochs * steps_per_epoch, engine.global_steps, cfg.batch_size * world, "img", rank == 0)
    if path:
        progress.message(resumed_line(path, "after epoch", first_epoch, "--epochs", cfg.epochs))
    progress.message(f"{len(train_x):,} training and {len(test_x):,} test images; {world} process(es), "
                     f"ep {cfg.ep_world_size}, ZeRO stage {engine.stage}, {cfg.dtype}, {steps_per_epoch} steps per epoch")
    history = []
    for epoch in range(first_epoch + 1, cfg.epochs + 1):
        losses, start = [], time.perf_counter()
        for i, rows in enumerate(shard(len(train_x), cfg.batch_size, rank, world, epoch, cfg.seed).split(cfg.batch_size)):
            loss = train_step(engine, cfg, normalise(train_x[rows]), train_y[rows])
            losses.append(loss.item())
            last = i + 1 == steps_per_epoch
            if (i + 1) % cfg.log_interval == 0 or last:
                rate = progress.rate(engine.global_steps)
                recent = losses[-cfg.log_interval:]
                progress.line(engine.global_steps, rate, epoch=epoch, loss=sum(recent) / len(recent))
                if engine.monitor is not None:  # each image is one token for the MoE layers
                    engine.monitor.scalars(engine.global_steps, {"Train/images_per_s": rate, "Train/tokens_per_s": rate})
        images_per_s = len(losses) * cfg.batch_size * world / (time.perf_counter() - start)  # training steps only
        train_loss = all_sum(sum(losses), len(losses), device=engine.device)
        train_loss = train_loss[0] / max(train_loss[1], 1)
        test_loss, accuracy, per_class = test(engine, test_x, test_y, cfg, rank, world)
        history.append({"epoch": epoch, "step": engine.global_steps, "train_loss": train_loss,
                        "test_loss": test_loss, "accuracy": accuracy, "per_class": per_class,
                        "images_per_s": images_per_s})
        progress.message(f"epoch {epoch}: train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
                         f"test accuracy {100 * accuracy:.1f}%  {images_per_s:,.0f} img/s")
        progress.message("  " + "  ".join(f"{name} {100 * a:.0f}%" for name, a in zip(CLASSES, per_class)))
        if engine.monitor is not None:
            engine.monitor.scalars(engine.global_steps, {
                "Train/epoch_loss": train_loss, "Val/loss": test_loss, "Val/accuracy": accuracy,
                **{f"Val/accuracy_{name}": a for name, a in zip(CLASSES, per_class)}})
        if cfg.checkpoint_dir:
            engine.save_checkpoint(cfg.checkpoint_dir, client_state={"epoch": epoch, "recipe": asdict(cfg)})
            if rank == 0:
                prune_checkpoints(cfg.checkpoint_dir, cfg.keep_last)
    if engine.monitor is not None:
        engine.monitor.close()
        progress.message(f"TensorBoard logs: {engine.monitor.log_dir}   (view: tensorboard --logdir {cfg.log_dir})")
    return {"history": history, "global_steps": engine.global_steps, "data": source}


def check(parser, cfg: CifarConfig, world: int) -> None:
    """The CIFAR recipe's own flag checks (the runner checks the shared ones); one line on error."""
    require_at_least(parser, cfg, ("epochs", "batch_size", "log_interval"))
    if cfg.moe:
        for n in cfg.num_experts:
            if n < 1 or n % cfg.ep_world_size:
                fail(parser, f"--num-experts {n} must be a positive multiple of --ep-world-size ({cfg.ep_world_size})")
            if not 1 <= cfg.top_k <= n:
                fail(parser, f"--top-k ({cfg.top_k}) must be between 1 and --num-experts ({n})")
        if cfg.batch_size < cfg.min_capacity:  # a micro-batch's images are the tokens a MoE layer routes
            fail(parser, f"--batch-size ({cfg.batch_size}) must be at least --min-capacity ({cfg.min_capacity}): "
                         "a MoE layer's tokens are a micro-batch's images")
    elif cfg.ep_world_size > 1:
        fail(parser, f"--ep-world-size {cfg.ep_world_size} needs --moe (there are no experts to spread)")


RECIPE = runner.Recipe(prog="recipes.cifar", config_class=CifarConfig, description=__doc__, check=check,
                       run_label=lambda cfg: f"cifar-{'moe' if cfg.moe else 'dense'}", train=train)


def main(argv: list[str] | None = None) -> dict:
    return runner.main(RECIPE, argv)


if __name__ == "__main__":
    main()
