"""Train a small byte-level GPT with MoE feed-forward blocks, or sample from a checkpoint.

    python -m recipes.gpt                                    # MoE GPT on CPython's docs, a few minutes on a CPU
    python -m recipes.gpt --dense                            # its dense twin: same active parameters per token
    python -m recipes.gpt --num-experts 16 --top-k 1 --dropless --steps 3000 --data my_corpus/
    python -m recipes.gpt --checkpoint-dir ckpt/gpt --checkpoint-interval 200       # then add --resume
    python -m recipes.gpt sample --checkpoint-dir ckpt/gpt --prompt "The with statement"
    torchrun --standalone --nproc_per_node 4 -m recipes.gpt --ep-world-size 2 --stage 2   # expert parallelism

Data: --data names a text file or a folder of them (bytes are the tokens, vocabulary 256); the
default is the English documentation that ships inside CPython (`pydoc_data.topics`, ~466 KB).
The last --val-fraction of the bytes is held out. Each process draws its own random windows,
seeded by (seed, step, micro-batch, rank), so a resumed run sees the batches it would have seen.

Every --log-interval steps a progress line shows step, loss, tokens/s and ETA; every
--eval-interval steps the validation loss is printed beside the unigram baseline (the held-out
cross-entropy of the training bytes' frequencies). TensorBoard logs go to --log-dir/--run-name:
train and validation loss, learning rate, loss scale, l_aux, z-loss, dropped fraction, expert
load per layer (histogram and an experts x layers heatmap), step time and tokens/s.
"""

import contextlib
import math
import os
import sys
from dataclasses import asdict, dataclass, field, fields

import torch
import torch.nn.functional as F

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import CheckpointError, ConfigTypeError, initialize, read_client_state
from optim.graphs import GraphedStep
from recipes.common import runner
from recipes.common.cli import (adamw_cosine_fragments, built, engine_config, fail, flag_names, flag_parser,
                                keep_last_field, noisy_gate_policy, noisy_gate_policy_field, require_at_least,
                                require_positive, resume_field, saved_recipe, start_over_field)
from recipes.common.training import Progress, SetupError, all_sum, prune_checkpoints, resumed_line
from recipes.gpt_model import GPT, GPTConfig


@dataclass(kw_only=True)
class TrainConfig:
    data: str = field(default="", metadata={"help": "text file or folder; empty: CPython's pydoc_data.topics"})
    val_fraction: float = 0.1
    steps: int = 1200
    batch_size: int = field(default=32, metadata={"help": "sequences per micro-batch and process"})
    gradient_accumulation_steps: int = 1
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn: int = field(default=512, metadata={"help": "dense feed-forward width; experts get ffn / top-k"})
    dropout: float = 0.0
    dense: bool = field(default=False, metadata={"help": "the dense twin: no MoE blocks"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model (Inductor); the first steps compile"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "capture the whole training step as a CUDA graph and replay it (optim.graphs; CUDA, padded layout "
                "with dropping or grouped without expert parallelism, ZeRO 0-2, no gradient accumulation)"})
    moe_every: int = field(default=2, metadata={"help": "MoE feed-forward in every n-th block"})
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = field(default=0, metadata={"help": "expert hidden width (0: ffn / top-k)"})
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    min_capacity: int = 4
    dropless: bool = False
    expert_layout: str = field(default="auto", metadata={
        "choices": ["auto", "packed", "grouped", "padded"],
        "help": "expert layout (auto: packed on CPU; on GPU padded, or grouped when dropless)"})
    noisy_gate_policy: str = noisy_gate_policy_field()
    scoring_func: str = field(default="softmax", metadata={"choices": ["softmax", "sigmoid"]})
    norm_topk_prob: str = field(default="auto", metadata={
        "choices": ["auto", "true", "false"], "help": "renormalise the kept weights (auto: the policy's default)"})
    routed_scaling_factor: float = 1.0
    bias_update_speed: float = field(default=0.0, metadata={
        "help": "auxiliary-loss-free balancing: the expert bias's step u (0: off); pair with --load-balancing-type none"})
    load_balancing_type: str = field(default="aux_loss", metadata={
        "choices": ["aux_loss", "seq_aux_loss", "global_aux_loss", "none"]})
    n_group: int = field(default=0, metadata={"help": "group-limited routing: expert groups (0: off)"})
    topk_group: int = field(default=0, metadata={"help": "group-limited routing: groups kept per token"})
    routing: str = field(default="token_choice", metadata={
        "choices": ["token_choice", "expert_choice"],
        "help": "expert_choice: each expert takes its top C tokens (leaks across positions: for study)"})
    n_shared_experts: int = field(default=0, metadata={"help": "a dense shared expert n experts wide (0: none)"})
    shared_expert_gate: bool = field(default=False, metadata={"help": "sigmoid gate on the shared expert (Qwen)"})
    expert_init: str = field(default="per_expert_seed", metadata={
        "choices": ["per_expert_seed", "copy"], "help": "independent experts, or copies of one template (DeepSpeed)"})
    exchange: str = field(default="per_choice", metadata={
        "choices": ["per_choice", "per_rank"],
        "help": "expert parallelism: a token's row crosses once per choice, or once per destination rank"})
    aux_coef: float = 0.01
    z_loss_coef: float = 0.001
    ep_world_size: int = 1
    stage: int = field(default=0, metadata={"choices": [0, 1, 2, 3]})
    dtype: str = field(default="fp32", metadata={"choices": ["fp32", "bf16", "fp16"]})
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    gradient_clipping: float = 1.0
    eval_interval: int = 200
    eval_batches: int = 16
    log_interval: int = 20
    log_dir: str = "runs"
    run_name: str = field(default="", metadata={"help": "TensorBoard run folder; empty: gpt-<moe|dense>-<time>"})
    checkpoint_dir: str = ""
    checkpoint_interval: int = field(default=0, metadata={"help": "save every n steps (and at the end)"})
    resume: str = resume_field()
    start_over: bool = start_over_field()
    keep_last: int = keep_last_field()
    config: str = field(default="", metadata={"help": "a JSON engine config; flags written out override it"})
    seed: int = 0


MODEL_FIELDS = {f.name for f in fields(GPTConfig)} - {"vocab_size", "block_size", "moe_every", "ep_size"}


def model_config(cfg: TrainConfig) -> GPTConfig:
    return GPTConfig(block_size=cfg.seq_len, moe_every=0 if cfg.dense else cfg.moe_every, ep_size=cfg.ep_world_size,
                     noisy_gate_policy=noisy_gate_policy(cfg.noisy_gate_policy),
                     **{name: getattr(cfg, name) for name in MODEL_FIELDS if name != "noisy_gate_policy"})


def engine_fragments(cfg: TrainConfig) -> dict[str, dict]:
    """Which engine-config entries each flag sets."""
    return {**adamw_cosine_fragments(cfg),
            "gradient_accumulation_steps": {"gradient_accumulation_steps": cfg.gradient_accumulation_steps},
            "min_lr_ratio": {"scheduler": {"params": {"cos_min_ratio": cfg.min_lr_ratio}}}}


# Data.

def load_text(path: str) -> bytes:
    """The bytes of a text file, of every text file under a folder (sorted), or of CPython's docs."""
    if not path:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics)).encode()
    if os.path.isdir(path):
        chunks = []
        for root, dirs, files in os.walk(path):
            dirs.sort()
            for name in sorted(files):
                with open(os.path.join(root, name), "rb") as handle:
                    data = handle.read()
                if data and b"\0" not in data[:4096]:  # skip binary files
                    chunks.append(data)
        if not chunks:
            raise ValueError(f"--data {path} holds no text file (empty, or only binary files)")
        return b"\n".join(chunks)
    with open(path, "rb") as handle:
        data = handle.read()
    if not data:
        raise ValueError(f"--data {path} is empty")
    if b"\0" in data[:4096]:
        raise ValueError(f"--data {path} is a binary file, not text")
    return data


def split_tokens(data: bytes, val_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_val = int(len(tokens) * val_fraction)
    train, val = tokens[:len(tokens) - n_val], tokens[len(tokens) - n_val:]
    if len(train) <= seq_len + 1 or len(val) <= seq_len + 1:
        raise ValueError(f"the data ({len(tokens)} bytes) is too small for --seq-len {seq_len} with "
                         f"--val-fraction {val_fraction}: both splits need more than {seq_len + 1} bytes")
    return train, val


def unigram_baseline(train: torch.Tensor, val: torch.Tensor) -> float:
    """Held-out cross-entropy (nats/byte) of the training bytes' frequencies, add-one smoothed."""
    counts = torch.bincount(train, minlength=256).double() + 1
    log_p = (counts / counts.sum()).log()
    return float(-log_p[val].mean())


def windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = starts[:, None] + torch.arange(seq_len + 1)
    chunk = tokens[index]
    return chunk[:, :-1], chunk[:, 1:]


def train_batch(tokens: torch.Tensor, cfg: TrainConfig, step: int, micro: int, rank: int):
    seed = ((cfg.seed * 1_000_003 + step) * 1009 + micro) * 8191 + rank
    g = torch.Generator().manual_seed(seed)
    return windows(tokens, torch.randint(len(tokens) - cfg.seq_len, (cfg.batch_size,), generator=g), cfg.seq_len)


@torch.no_grad()
def evaluate(engine, val: torch.Tensor, cfg: TrainConfig, rank: int, world: int) -> float:
    """Mean loss over fixed windows spread over the held-out bytes (each process takes its share)."""
    per_rank = math.ceil(cfg.eval_batches / world)
    starts = torch.linspace(0, len(val) - cfg.seq_len - 1, per_rank * world * cfg.batch_size).long()
    engine.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=engine.device), 0  # summed on the device
    for j in range(per_rank):
        batch = (j * world + rank) * cfg.batch_size
        x, y = (t.to(engine.device) for t in windows(val, starts[batch:batch + cfg.batch_size], cfg.seq_len))
        logits = engine(x)[0]
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        count += y.numel()
    engine.train()
    total, count = all_sum(total, count, device=engine.device)
    return total / count


def train_step(engine, cfg: TrainConfig, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One micro-batch: batch to the model's device, forward, loss, backward, engine step; returns the loss."""
    x, y = x.to(engine.device, non_blocking=True), y.to(engine.device, non_blocking=True)
    logits, l_aux, z_loss = engine(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    engine.backward(loss + cfg.aux_coef * l_aux + cfg.z_loss_coef * z_loss)
    engine.step()
    return loss.detach()


# Training.

def train(cfg: TrainConfig, given: set[str], rank: int, world: int) -> dict:
    torch.manual_seed(cfg.seed)
    try:  # bad data, model or engine settings stop with one line
        data = load_text(cfg.data)
        train_tokens, val_tokens = split_tokens(data, cfg.val_fraction, cfg.seq_len)
        model = built(lambda: GPT(model_config(cfg)), TrainConfig)
        total_params, active_params = model.parameter_counts()  # before stage 3 shards the parameters
        if cfg.compile:  # in place, before the engine wraps it: parameter names, so checkpoints, stay the same
            model.compile()
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"})
        engine, *_ = initialize(model, model_parameters=groups, config=engine_config(engine_fragments(cfg), given,
                                                                                     cfg.config))
        step_fn = (lambda x, y: train_step(engine, cfg, x, y))
        if cfg.cuda_graphs:
            step_fn = GraphedStep(engine, step_fn, report_every=cfg.log_interval)
    except (OSError, ConfigTypeError, ValueError) as error:
        raise SetupError(str(error)) from None
    unigram = unigram_baseline(train_tokens, val_tokens)
    first_step, path = 0, None
    if cfg.resume:
        try:
            path, _ = engine.load_checkpoint(cfg.checkpoint_dir)
        except (CheckpointError, OSError) as error:  # refused on every rank: another model's, damaged, gone
            raise SetupError(str(error)) from None
        first_step = engine.global_steps
    tokens_per_step = cfg.batch_size * cfg.seq_len * engine.accumulation * world
    progress = Progress(cfg.steps, first_step, tokens_per_step, enabled=rank == 0)
    if path:
        progress.message(resumed_line(path, "at step", first_step, "--steps", cfg.steps))
    progress.message(f"data: {len(data):,} bytes ({len(train_tokens):,} train, {len(val_tokens):,} validation); "
                     f"unigram baseline {unigram:.4f} nats/byte")
    progress.message(f"model: {'dense' if cfg.dense else 'MoE'}, {total_params:,} parameters, {active_params:,} active "
                     f"per token; {world} process(es), ep {cfg.ep_world_size}, ZeRO stage {engine.stage}, {cfg.dtype}")
    history = {"train": [], "val": [], "tokens_per_s": [], "max_vio": [], "dropped_fraction": []}
    losses, routing = [], None  # the losses are read on the host at each progress line, not at each step
    for step in range(first_step + 1, cfg.steps + 1):
        for micro in range(engine.accumulation):
            loss = step_fn(*train_batch(train_tokens, cfg, step, micro, rank))
        losses.append((step, loss.clone() if cfg.cuda_graphs else loss))  # a graph's loss is overwritten
        if engine.last_routing_stats and engine.last_routing_stats is not routing:  # a new step's, over all ranks
            routing = layers = engine.last_routing_stats  # (with --cuda-graphs, read at each progress line)
            history["max_vio"].append((step, sum(s.max_vio for s in layers) / len(layers)))
            history["dropped_fraction"].append((step, sum(s.dropped_fraction for s in layers) / len(layers)))
        if step % cfg.log_interval == 0 or step == cfg.steps or step % cfg.eval_interval == 0:
            history["train"] += zip([s for s, _ in losses], torch.stack([value for _, value in losses]).tolist())
            losses = []
        if step % cfg.log_interval == 0 or step == cfg.steps:
            rate = progress.rate(step)
            history["tokens_per_s"].append(rate)
            progress.line(step, rate, loss=history["train"][-1][1], lr=f"{engine.get_lr()[0]:.2e}")
            if engine.monitor is not None:
                engine.monitor.scalars(step, {"Train/tokens_per_s": rate})
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            val_loss = evaluate(engine, val_tokens, cfg, rank, world)
            history["val"].append((step, val_loss))
            progress.message(f"step {step}: validation loss {val_loss:.4f} nats/byte (unigram {unigram:.4f})")
            if engine.monitor is not None:
                engine.monitor.scalars(step, {"Val/loss": val_loss, "Val/unigram_baseline": unigram})
        if cfg.checkpoint_dir and ((cfg.checkpoint_interval and step % cfg.checkpoint_interval == 0)
                                   or step == cfg.steps):
            engine.save_checkpoint(cfg.checkpoint_dir, client_state={"recipe": asdict(cfg)})
            if rank == 0:
                prune_checkpoints(cfg.checkpoint_dir, cfg.keep_last)
    if engine.monitor is not None:
        engine.monitor.close()
        progress.message(f"TensorBoard logs: {engine.monitor.log_dir}   (view: tensorboard --logdir {cfg.log_dir})")
    return {"history": history, "unigram": unigram, "total_params": total_params, "active_params": active_params,
            "val_loss": history["val"][-1][1] if history["val"] else None,
            "tokens_per_s": sum(history["tokens_per_s"]) / max(len(history["tokens_per_s"]), 1)}


def check(parser, cfg: TrainConfig, world: int) -> None:
    """The GPT recipe's own flag checks (the runner checks the shared ones); one line on error."""
    require_at_least(parser, cfg, ("steps", "batch_size", "gradient_accumulation_steps", "seq_len", "eval_interval",
                                   "eval_batches", "log_interval", "n_layer"))
    if not 0 <= cfg.dropout < 1:
        fail(parser, f"--dropout must be at least 0 and below 1, got {cfg.dropout}")
    if not cfg.dense and cfg.num_experts < 1:
        fail(parser, f"--num-experts must be at least 1, got {cfg.num_experts}")
    if not cfg.dense and cfg.num_experts % cfg.ep_world_size:
        fail(parser, f"--num-experts ({cfg.num_experts}) must be divisible by --ep-world-size ({cfg.ep_world_size})")
    if not cfg.dense and not 1 <= cfg.top_k <= cfg.num_experts:
        fail(parser, f"--top-k ({cfg.top_k}) must be between 1 and --num-experts ({cfg.num_experts})")
    check_routing(parser, cfg, "--batch-size", cfg.batch_size)
    if not cfg.dense and not 1 <= cfg.moe_every <= cfg.n_layer:
        fail(parser, f"--moe-every ({cfg.moe_every}) must be between 1 and --n-layer ({cfg.n_layer}), or the "
                     "model has no MoE block (the dense twin is --dense)")
    if cfg.data and not os.path.exists(cfg.data):
        fail(parser, f"--data {cfg.data} does not exist (a text file, a folder of them, or empty for CPython's docs)")
    if cfg.dense and cfg.ep_world_size > 1:
        fail(parser, f"--dense has no experts to spread: use --ep-world-size 1, got {cfg.ep_world_size}")
    require_at_least(parser, cfg, ("checkpoint_interval", "warmup_steps"), 0)
    require_positive(parser, cfg, ("lr",))
    if not 0 < cfg.val_fraction < 1:
        fail(parser, f"--val-fraction must be between 0 and 1, got {cfg.val_fraction}")
    try:
        model_config(cfg)
    except ValueError as error:
        fail(parser, flag_names(str(error), TrainConfig))


def check_routing(parser, cfg, batch_flag: str, batch: int) -> None:
    """The routing flags' checks that recipes.estimate shares: --n-group and --topk-group go together, and
    a micro-batch's tokens in a process (what a MoE layer routes) reach --min-capacity when dropping."""
    if cfg.dense:
        return
    if (cfg.n_group == 0) != (cfg.topk_group == 0):
        fail(parser, f"group-limited routing needs both --n-group and --topk-group (0: off), got --n-group "
                     f"{cfg.n_group} and --topk-group {cfg.topk_group}")
    tokens = batch * cfg.seq_len
    if not cfg.dropless and cfg.routing == "token_choice" and tokens < cfg.min_capacity:
        fail(parser, f"{batch_flag} x --seq-len ({batch} x {cfg.seq_len} = {tokens} tokens a micro-batch) must be at "
                     f"least --min-capacity ({cfg.min_capacity}) when dropping tokens; lower --min-capacity or pass "
                     "--dropless")


def compile_setup(cfg: TrainConfig):
    """A context with Dynamo set up for --compile (nothing without it): the packed and grouped
    layouts' one host read (rows per expert) becomes symbolic sizes, so they compile whole instead of
    breaking the graph and recompiling as the counts change."""
    return torch._dynamo.config.patch(capture_scalar_outputs=True) if cfg.compile else contextlib.nullcontext()


def compiled_train(cfg: TrainConfig, given: set[str], rank: int, world: int) -> dict:
    """`train`, with Dynamo set up for --compile."""
    with compile_setup(cfg):
        return train(cfg, given, rank, world)


RECIPE = runner.Recipe(prog="recipes.gpt", config_class=TrainConfig, description=__doc__, check=check,
                       run_label=lambda cfg: f"gpt-{'dense' if cfg.dense else 'moe'}", train=compiled_train,
                       usage="%(prog)s [flags]          train (the flags below)\n"
                             "       %(prog)s sample [flags]   text from a checkpoint (%(prog)s sample --help)")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sample"]:
        return sample(argv[1:])
    return runner.main(RECIPE, argv)


# Sampling.

@dataclass(kw_only=True)
class SampleConfig:
    checkpoint_dir: str = field(default="", metadata={"help": "the folder a training run saved its checkpoints into"})
    prompt: str = "The "
    new_tokens: int = 300
    temperature: float = field(default=0.8, metadata={"help": "softmax temperature (0: the most likely byte)"})
    top_k: int = field(default=40, metadata={"help": "sample from the k most likely bytes (0: from all 256)"})
    seed: int = 0


def saved_config(parser, folder: str) -> TrainConfig:
    """The training config saved with the latest checkpoint in `folder`; one line naming the folder if there is none."""
    run = "the folder a training run `python -m recipes.gpt --checkpoint-dir DIR` saved its checkpoints into"
    if not folder:
        fail(parser, f"--checkpoint-dir is needed: {run}")
    if not os.path.isfile(os.path.join(folder, "latest")):
        if not os.path.exists(folder):
            what = "does not exist"
        elif not os.path.isdir(folder):
            what = "is a file, not a folder"
        else:
            what = "holds no checkpoint (no `latest` file)"
        fail(parser, f"--checkpoint-dir {folder} {what}: pass {run}")
    try:
        return TrainConfig(**saved_recipe(read_client_state(folder)))
    except (OSError, RuntimeError, KeyError, TypeError) as error:
        detail = str(error).split("; pass tag=")[0]  # the engine's hint names its Python API, not a flag of sample
        fail(parser, f"cannot read a recipes.gpt checkpoint from --checkpoint-dir {folder}: {detail}")


def sample(argv: list[str]) -> dict:
    parser = flag_parser(SampleConfig, "Generate text from a checkpoint of recipes.gpt.")
    parser.prog = "recipes.gpt sample"
    cfg = SampleConfig(**vars(parser.parse_args(argv)))
    require_at_least(parser, cfg, ("new_tokens", "top_k"), 0)
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        fail(parser, f"--temperature must be a finite number >= 0, got {cfg.temperature}")
    if not cfg.prompt:
        fail(parser, "--prompt must hold at least one character (the model continues it)")
    saved = saved_config(parser, cfg.checkpoint_dir)
    saved.ep_world_size = 1  # checkpoints load at any expert-parallel size
    model = GPT(model_config(saved))
    engine, *_ = initialize(model, config={"train_micro_batch_size_per_gpu": 1,
                                           "optimizer": {"type": "AdamW", "params": {"lr": 0.0}}})
    try:
        engine.load_checkpoint(cfg.checkpoint_dir, load_optimizer_states=False)
    except (CheckpointError, OSError) as error:
        fail(parser, f"cannot read a recipes.gpt checkpoint from --checkpoint-dir {cfg.checkpoint_dir}: {error}")
    model.eval()
    prompt = torch.tensor([list(cfg.prompt.encode())], dtype=torch.long, device=engine.device)
    generator = torch.Generator(device=engine.device).manual_seed(cfg.seed)
    out = model.generate(prompt, cfg.new_tokens, cfg.temperature, cfg.top_k, generator)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(text)
    return {"text": text}


if __name__ == "__main__":
    main()
