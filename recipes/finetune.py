"""Fine-tune a Hugging Face MoE model on our layer, and save it back as a transformers checkpoint.

    python -m recipes.finetune --hf PATH                                   # CPython's docs, a few steps
    python -m recipes.finetune --hf PATH --data my_corpus.txt --steps 200 --out tuned/
    torchrun --standalone --nproc_per_node 2 -m recipes.finetune --hf PATH --ep-world-size 2 --stage 3 --out tuned/

--hf names a transformers Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, OLMoE or GPT-OSS model: a local folder
(`save_pretrained`'s), or a hub name when this machine reaches the hub. Its sparse MoE blocks become
our layer (`moe.hf.convert`, the same weights and routing, experts spread over --ep-world-size
processes; DeepSeek-V3's expert bias moves after each step by --bias-update-speed); the loss is the
causal-LM cross-entropy plus --aux-coef times our load-balancing l_aux. Any ZeRO stage (--stage 0-3).
Text comes from --data (a text file or a folder of them; default: the English documentation inside
CPython, `pydoc_data.topics`), tokenised by the model folder's tokenizer when it has one, else as
bytes clipped to the model's vocabulary. Each process draws its own random windows.

TensorBoard logs go to --log-dir/--run-name (train loss, learning rate, l_aux, expert load). At the
end, with --out, the engine gathers the trained weights on rank 0 (`engine.consolidated_state_dict()`:
the fp32 master weights and buffers, whatever the stage shards and whichever rank holds an expert);
rank 0 loads them into a one-process converted copy of the model, puts the original blocks back
(`moe.hf.restore`) and writes it (and the tokenizer) with `save_pretrained` to --out, which
`from_pretrained` reads.
"""

import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moe import split_params_into_different_moe_groups_for_optimizer
from moe.hf import DEEPSEEK_V3_BIAS_UPDATE_SPEED, HFMoEBlock, convert, restore
from optim import ConfigTypeError, initialize
from parallel import init_distributed
from recipes.common.cli import (adamw_cosine_fragments, engine_config, fail, flag_parser, given_flags, require_at_least,
                                require_positive)
from recipes.common.runner import one_line_failures
from recipes.common.training import Progress, SetupError
from recipes.gpt import load_text, windows

# files a model folder holds when it carries a tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(kw_only=True)
class FinetuneConfig:
    hf: str = field(default="", metadata={"help": "the model: a save_pretrained folder (or a hub name, with network)"})
    data: str = field(default="", metadata={"help": "text file or folder; empty: CPython's pydoc_data.topics"})
    steps: int = 20
    batch_size: int = field(default=4, metadata={"help": "sequences per micro-batch and process"})
    seq_len: int = 128
    lr: float = 1e-4
    warmup_steps: int = 0
    weight_decay: float = 0.0
    gradient_clipping: float = 1.0
    aux_coef: float = field(default=0.001, metadata={"help": "coefficient of our load-balancing l_aux"})
    ep_world_size: int = 1
    stage: int = field(default=0, metadata={"choices": [0, 1, 2, 3], "help": "ZeRO stage"})
    bias_update_speed: float = field(default=DEEPSEEK_V3_BIAS_UPDATE_SPEED, metadata={
        "help": "DeepSeek-V3: how far the expert bias moves after each step (0: fixed); other models have no bias"})
    dtype: str = field(default="fp32", metadata={"choices": ["fp32", "bf16"]})
    log_interval: int = 5
    log_dir: str = "runs"
    run_name: str = field(default="", metadata={"help": "TensorBoard run folder; empty: finetune-<time>"})
    out: str = field(default="", metadata={"help": "save_pretrained folder for the tuned model (empty: not saved)"})
    seed: int = 0


def engine_fragments(cfg: FinetuneConfig) -> dict[str, dict]:
    """Which engine-config entries each flag sets: the GPT recipe's AdamW and warm-up cosine."""
    return adamw_cosine_fragments(cfg)


class CausalLM(nn.Module):
    """A converted transformers model as the engine runs it: forward(ids) -> (logits, l_aux), l_aux summed over
    its MoE layers (each layer keeps the last forward's)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(input_ids=ids).logits
        l_aux = sum(m.moe.deepspeed_moe.l_aux for m in self.model.modules() if isinstance(m, HFMoEBlock))
        return logits, l_aux


# a hub model's name: "name" or "namespace/name" (what is neither a folder nor this fails before loading)
_HUB_NAME = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?", re.ASCII)


def _model_config(cfg: FinetuneConfig):
    """The model's transformers config (read before the weights)."""
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(cfg.hf)
    except OSError as error:
        raise _not_found(cfg, error) from None


def _not_found(cfg: FinetuneConfig, error: OSError) -> OSError:
    """The error for a model that could not be read: as it is for a local folder; for a hub name, one
    line naming the value."""
    if os.path.isdir(cfg.hf):
        return error
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return OSError(f"--hf {cfg.hf} is no folder here, and the hub did not give it: {first}")


def load_model(cfg: FinetuneConfig, config):
    """The transformers model of `config` (`_model_config`'s) and its tokenizer (None when the folder
    has none)."""
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(cfg.hf, config=config, dtype=torch.float32)
    except OSError as error:
        raise _not_found(cfg, error) from None
    tokenizer = None
    if not os.path.isdir(cfg.hf) or any(os.path.isfile(os.path.join(cfg.hf, name)) for name in _TOKENIZER_FILES):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(cfg.hf)
        except (OSError, ValueError):
            tokenizer = None
    return model, tokenizer


def converted(model: nn.Module, cfg: FinetuneConfig, ep_size: int) -> CausalLM:
    """The model on our layer, as the engine runs it."""
    speed = cfg.bias_update_speed if model.config.model_type == "deepseek_v3" else None
    return CausalLM(convert(model, ep_size=ep_size, bias_update_speed=speed))


def trained_copy(cfg: FinetuneConfig, state: dict[str, torch.Tensor]) -> nn.Module:
    """A one-process copy of the model carrying the engine's trained state, its original blocks back."""
    import transformers

    wrapped = converted(transformers.AutoModelForCausalLM.from_pretrained(cfg.hf, dtype=torch.float32), cfg, 1)
    missing, unexpected = wrapped.load_state_dict(state, strict=False)
    entries = wrapped.state_dict(keep_vars=True)
    loaded = {id(entries[name]) for name in state if name in entries}
    missing = [name for name in missing if id(entries[name]) not in loaded]  # a tied weight is loaded under one name
    if missing or unexpected:
        raise RuntimeError(f"the trained state does not fit a one-process copy of the model: missing {missing}, "
                           f"unexpected {unexpected}")
    return restore(wrapped.model)


def tokens_of(text: bytes, tokenizer, vocab_size: int) -> torch.Tensor:
    """The text's token ids: the tokenizer's, else its bytes clipped to the vocabulary."""
    if tokenizer is not None:
        ids = tokenizer(text.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long).clamp_(max=vocab_size - 1)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long().clamp_(max=vocab_size - 1)


def train_batch(tokens: torch.Tensor, cfg: FinetuneConfig, step: int, rank: int):
    g = torch.Generator().manual_seed((cfg.seed * 1_000_003 + step) * 8191 + rank)
    return windows(tokens, torch.randint(len(tokens) - cfg.seq_len, (cfg.batch_size,), generator=g), cfg.seq_len)


def train(cfg: FinetuneConfig, given: set[str], rank: int, world: int) -> dict:
    torch.manual_seed(cfg.seed)
    try:  # a bad model, data or engine setting stops with one line
        config = _model_config(cfg)  # read once: the bias flag is checked before the weights load
        model_type = getattr(config, "model_type", None)
        if "bias_update_speed" in given and cfg.bias_update_speed and model_type != "deepseek_v3":
            raise ValueError(f"--bias-update-speed {cfg.bias_update_speed} moves an expert bias, which only "
                             f"deepseek_v3 models have; this one is {model_type}: leave the flag out")
        model, tokenizer = load_model(cfg, config)
        vocab = model.config.vocab_size
        tokens = tokens_of(load_text(cfg.data), tokenizer, vocab)
        if len(tokens) <= cfg.seq_len + 1:
            raise ValueError(f"the data ({len(tokens)} tokens) is too small for --seq-len {cfg.seq_len}")
        wrapped = converted(model, cfg, cfg.ep_world_size).train()
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(wrapped.parameters()), "name": "dense"})
        config = engine_config(engine_fragments(cfg), given, "")
        engine, *_ = initialize(wrapped, model_parameters=groups, config=config)
    except (OSError, ConfigTypeError, ValueError, ImportError) as error:
        raise SetupError(str(error)) from None
    progress = Progress(cfg.steps, 0, cfg.batch_size * cfg.seq_len * world, enabled=rank == 0)
    progress.message(f"model: {type(model).__name__} ({model.config.model_type}), vocabulary {vocab}; data: "
                     f"{len(tokens):,} tokens ({'the tokenizer' if tokenizer is not None else 'bytes'}); {world} "
                     f"process(es), ep {cfg.ep_world_size}, ZeRO stage {engine.stage}, {cfg.dtype}")
    losses = []
    for step in range(1, cfg.steps + 1):
        x, y = (t.to(engine.device) for t in train_batch(tokens, cfg, step, rank))
        logits, l_aux = engine(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        engine.backward(loss + cfg.aux_coef * l_aux)
        engine.step()
        losses.append((step, loss.item()))
        if step % cfg.log_interval == 0 or step == cfg.steps:
            progress.line(step, progress.rate(step), loss=losses[-1][1], lr=f"{engine.get_lr()[0]:.2e}")
    if engine.monitor is not None:
        engine.monitor.close()
        progress.message(f"TensorBoard logs: {engine.monitor.log_dir}   (view: tensorboard --logdir {cfg.log_dir})")
    if cfg.out:
        state = engine.consolidated_state_dict()  # every rank takes part; rank 0 gets every weight, whole
    if cfg.out and rank == 0:
        trained_copy(cfg, state).save_pretrained(cfg.out)
        if tokenizer is not None:
            tokenizer.save_pretrained(cfg.out)
        progress.message(f"saved the tuned model to {cfg.out} (transformers.AutoModelForCausalLM.from_pretrained)")
    return {"losses": losses, "log_dir": engine.monitor.log_dir if engine.monitor is not None else None,
            "out": cfg.out}


def check(parser, cfg: FinetuneConfig, world: int) -> None:
    """The flags' checks; one line on error."""
    if not cfg.hf:
        fail(parser, "--hf is needed: a transformers MoE model's folder (save_pretrained's) or hub name")
    if os.path.isfile(cfg.hf):
        fail(parser, f"--hf {cfg.hf} is a file: give the folder save_pretrained wrote, or a hub name")
    if not os.path.isdir(cfg.hf) and not _HUB_NAME.fullmatch(cfg.hf):
        fail(parser, f"--hf {cfg.hf} is no folder here, nor a hub name (name or namespace/name)")
    require_at_least(parser, cfg, ("steps", "batch_size", "seq_len", "log_interval", "ep_world_size"))
    require_at_least(parser, cfg, ("warmup_steps", "bias_update_speed"), 0)
    require_positive(parser, cfg, ("lr",))
    if world % cfg.ep_world_size:
        fail(parser, f"--ep-world-size ({cfg.ep_world_size}) must divide the number of processes ({world})")
    if cfg.data and not os.path.exists(cfg.data):
        fail(parser, f"--data {cfg.data} does not exist (a text file, a folder of them, or empty for CPython's docs)")
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        fail(parser, f"--out {cfg.out} is a file, not a folder")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    parser = flag_parser(FinetuneConfig, __doc__)
    parser.prog = "recipes.finetune"
    cfg = FinetuneConfig(**vars(parser.parse_args(argv)))
    given = given_flags(parser, argv)
    rank, world = init_distributed()
    if not cfg.run_name:
        cfg.run_name = f"finetune-{time.strftime('%Y%m%d-%H%M%S')}"
    check(parser, cfg, world)
    if rank == 0:
        print("config:", asdict(cfg), f"processes={world}", flush=True)
    with one_line_failures(parser):
        result = train(cfg, given, rank, world)
    return result


if __name__ == "__main__":
    main()
