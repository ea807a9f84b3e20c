"""How much memory one GPT training step takes per GPU, found by running the step in a simulated world.

    python -m recipes.estimate --n-layer 24 --n-embd 2048 --n-head 16 --ffn 8192 --num-experts 64 --top-k 2 \\
        --seq-len 2048 --micro-batch 4 --world-size 64 --ep-world-size 8 --stage 3 --dtype bf16

The GPT recipe's model is built on the meta device and trained for two steps through the real engine
(ZeRO stage, precision, expert parallelism) under the "fake" process group at --world-size, as rank
--rank (see recipes.common.simulated): no GPU and no memory are needed, and it runs in seconds to a minute
on a CPU. Per rank it prints:
- parameters, gradients and optimizer states (master weights included) held between steps, from
  `engine.memory_breakdown()`, beside the ZeRO accounting for the same model;
- activations: the bytes allocated by the second step's forward and still held when its backward
  starts (what autograd saves, plus the gathered parameters stage 3 keeps for the backward);
- the peak: model states plus the most bytes the step's own allocations held at once (activations,
  gradients in flight, all-to-all buffers, gathered parameters, optimizer temporaries).
Counted by watching every tensor storage created during the step until it is freed, as a caching
allocator would hold it; allocator fragmentation, CUDA context (~0.5-1 GB) and NCCL buffers are not in it.
Attention is counted as FlashAttention runs it on a GPU (no [T, T] scores kept); on meta, torch's
attention would otherwise take its math path and keep them.
"""

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from unittest import mock

import torch

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.memory import LiveBytes
from recipes import gpt
from recipes.common.cli import engine_config, fail, flag_names, flag_parser, require_at_least
from recipes.common.simulated import META, simulated_world
from recipes.gpt_model import GPT

GB = 1e9
# the GPT recipe's model flags beyond the sizes below, taken over with their defaults, choices and help
ROUTER_FLAGS = ("dense", "min_capacity", "n_shared_experts", "shared_expert_gate", "scoring_func", "norm_topk_prob",
                "routed_scaling_factor", "bias_update_speed", "load_balancing_type", "n_group", "topk_group",
                "routing", "exchange")


def _gpt_flag(name: str):
    """A field as the GPT recipe's flag of this name: the same default, choices and help."""
    recipe_field = next(f for f in dataclasses.fields(gpt.TrainConfig) if f.name == name)
    return field(default=recipe_field.default, metadata=recipe_field.metadata)


@dataclass(kw_only=True)
class EstimateConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    ffn: int = field(default=512, metadata={"help": "dense feed-forward width; experts get ffn / top-k"})
    moe_every: int = field(default=2, metadata={"help": "MoE feed-forward in every n-th block"})
    num_experts: int = 8
    top_k: int = 2
    expert_ffn: int = field(default=0, metadata={"help": "expert hidden width (0: ffn / top-k)"})
    capacity_factor: float = 1.25
    dropless: bool = False
    expert_layout: str = field(default="auto", metadata={"choices": ["auto", "packed", "grouped", "padded"]})
    seq_len: int = 128
    micro_batch: int = field(default=32, metadata={"help": "sequences per micro-batch and GPU"})
    world_size: int = field(default=8, metadata={"help": "GPUs in the simulated run"})
    ep_world_size: int = 1
    stage: int = field(default=0, metadata={"choices": [0, 1, 2, 3]})
    dtype: str = field(default="bf16", metadata={"choices": ["fp32", "bf16", "fp16"]})
    dense: bool = _gpt_flag("dense")
    min_capacity: int = _gpt_flag("min_capacity")
    n_shared_experts: int = _gpt_flag("n_shared_experts")
    shared_expert_gate: bool = _gpt_flag("shared_expert_gate")
    scoring_func: str = _gpt_flag("scoring_func")
    norm_topk_prob: str = _gpt_flag("norm_topk_prob")
    routed_scaling_factor: float = _gpt_flag("routed_scaling_factor")
    bias_update_speed: float = _gpt_flag("bias_update_speed")
    load_balancing_type: str = _gpt_flag("load_balancing_type")
    n_group: int = _gpt_flag("n_group")
    topk_group: int = _gpt_flag("topk_group")
    routing: str = _gpt_flag("routing")
    exchange: str = _gpt_flag("exchange")
    rank: int = field(default=0, metadata={"help": "the rank whose memory is measured"})
    gpu_memory_gb: float = field(default=80.0, metadata={"help": "memory per GPU, for the verdict"})


def _flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """SDPA as FlashAttention computes it (output and log-sum-exp saved, no scores), for the memory count."""
    if attn_mask is not None:
        raise ValueError("the estimate counts attention as FlashAttention, which takes no attention mask")
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]


def zero_accounting(stage: int, dtype: str, dense: int, expert: int, world: int, ep: int) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer states by the ZeRO paper's accounting for this engine.

    Bytes per parameter (P, G, K): fp32 4, 4, 8 (Adam); bf16 2, 4 (fp32 accumulation), 12 (fp32 master
    + Adam); fp16 2, 2, 12; at stage 3 fully_shard keeps fp32 shards, 4, 4, 8. Dense parameters shard
    over the world, expert parameters (this rank's experts) over the W / ep ranks holding the same ones.
    """
    bytes_pgk = {"fp32": (4, 4, 8), "bf16": (2, 4, 12), "fp16": (2, 2, 12)}[dtype] if stage < 3 else (4, 4, 8)
    parts = {"parameters": 0.0, "gradients": 0.0, "optimizer_states": 0.0}
    for psi, shards in ((dense, world), (expert, world // ep)):
        for key, per, sharded in zip(parts, bytes_pgk, (stage >= 3, stage >= 2, stage >= 1)):
            parts[key] += psi * per / (shards if sharded else 1)
    return parts


def _train_config(cfg: EstimateConfig) -> gpt.TrainConfig:
    return gpt.TrainConfig(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, ffn=cfg.ffn, moe_every=cfg.moe_every,
        num_experts=cfg.num_experts, top_k=cfg.top_k, expert_ffn=cfg.expert_ffn, capacity_factor=cfg.capacity_factor,
        dropless=cfg.dropless, expert_layout=cfg.expert_layout, seq_len=cfg.seq_len, batch_size=cfg.micro_batch,
        ep_world_size=cfg.ep_world_size, stage=cfg.stage, dtype=cfg.dtype, steps=2, run_name="estimate",
        **{name: getattr(cfg, name) for name in ROUTER_FLAGS},
    )


def estimate(cfg: EstimateConfig) -> dict:
    """Run two simulated steps and measure this rank's memory (bytes); see the module docstring."""
    train_cfg = _train_config(cfg)
    rows = round(cfg.micro_batch * cfg.seq_len * gpt.model_config(train_cfg).routed_experts_per_token())
    with contextlib.ExitStack() as stack:
        stack.enter_context(simulated_world(cfg.world_size, cfg.rank, rows_per_rank=rows))
        stack.enter_context(mock.patch("torch.nn.functional.scaled_dot_product_attention", _flash_attention))
        with META:
            model = GPT(gpt.model_config(train_cfg))
        dense = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True))
        expert = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "dense"})
        fragments = gpt.engine_fragments(train_cfg)
        fragments.pop("run_name")  # no TensorBoard files from an estimate
        engine, *_ = initialize(model, model_parameters=groups, config=engine_config(fragments, set(), ""))
        tokens = torch.randint(256, (cfg.micro_batch, cfg.seq_len + 1))
        gpt.train_step(engine, train_cfg, tokens[:, :-1], tokens[:, 1:])  # the optimizer states now exist
        tracker, at_backward = LiveBytes(), []
        backward = engine.backward
        engine.backward = lambda loss: (at_backward.append(tracker.live), backward(loss))[1]
        with tracker:
            gpt.train_step(engine, train_cfg, tokens[:, :-1], tokens[:, 1:])
        states = engine.memory_breakdown()
    model_states = {key: states[key] for key in ("parameters", "gradients", "optimizer_states")}
    return {"model_states": model_states, "activations": at_backward[0], "step_peak": tracker.peak,
            "peak": sum(model_states.values()) + tracker.peak, "dense_params": dense, "expert_params": expert,
            "zero": zero_accounting(cfg.stage, cfg.dtype, dense, expert, cfg.world_size, cfg.ep_world_size)}


def _size(nbytes: float) -> str:
    return f"{nbytes / GB:>9.2f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:>9.1f} MB"


def _table(cfg: EstimateConfig, result: dict) -> str:
    zero = result["zero"]
    lines = [f"{'':<34}{'engine holds':>12}{'ZeRO formula':>15}"]  # the engine's tensors, by its accounting
    for key, label in (("parameters", "parameters"), ("gradients", "gradients"),
                       ("optimizer_states", "optimizer states (+ fp32 master)")):
        lines.append(f"{label:<34}{_size(result['model_states'][key])}   {_size(zero[key])}")
    lines.append(f"{'activations (at backward)':<34}{_size(result['activations'])}")
    lines.append(f"{'step allocations, peak':<34}{_size(result['step_peak'])}")
    peak = result["peak"]
    verdict = "fits" if peak <= cfg.gpu_memory_gb * GB else "does NOT fit"
    lines.append(f"{'peak per GPU':<34}{_size(peak)}   {verdict} in {cfg.gpu_memory_gb:g} GB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = flag_parser(EstimateConfig, __doc__)
    parser.prog = "recipes.estimate"
    cfg = EstimateConfig(**vars(parser.parse_args(sys.argv[1:] if argv is None else argv)))
    require_at_least(parser, cfg, ("world_size", "ep_world_size", "micro_batch", "seq_len", "n_layer", "num_experts"))
    if not cfg.gpu_memory_gb > 0:
        fail(parser, f"--gpu-memory-gb must be > 0, got {cfg.gpu_memory_gb}")
    if cfg.world_size % cfg.ep_world_size:
        fail(parser, f"--ep-world-size ({cfg.ep_world_size}) must divide --world-size ({cfg.world_size})")
    gpt.check_routing(parser, cfg, "--micro-batch", cfg.micro_batch)
    if cfg.dense and cfg.ep_world_size > 1:
        fail(parser, f"--dense has no experts to spread: use --ep-world-size 1, got {cfg.ep_world_size}")
    if not 0 <= cfg.rank < cfg.world_size:
        fail(parser, f"--rank must be between 0 and {cfg.world_size - 1}, got {cfg.rank}")
    try:
        gpt.model_config(_train_config(cfg))
    except ValueError as error:
        fail(parser, flag_names(str(error), EstimateConfig))
    start = time.perf_counter()
    try:
        result = estimate(cfg)
    except (ValueError, RuntimeError) as error:
        fail(parser, flag_names(str(error), EstimateConfig))
    kind = f"{cfg.num_experts} experts top-{cfg.top_k}" if cfg.moe_every and not cfg.dense else "dense"
    print(f"GPT {cfg.n_layer} blocks x {cfg.n_embd}, {kind}: "
          f"{result['dense_params'] / 1e6:,.1f} M dense and {result['expert_params'] / 1e6:,.1f} M expert parameters "
          f"on rank {cfg.rank}; world {cfg.world_size}, ep {cfg.ep_world_size}, ZeRO stage {cfg.stage}, {cfg.dtype}, "
          f"micro-batch {cfg.micro_batch} x {cfg.seq_len} tokens")
    print(_table(cfg, result))
    print(f"(simulated in {time.perf_counter() - start:.1f} s; fragmentation, CUDA context and NCCL buffers not included)")
    return {"config": dataclasses.asdict(cfg), **result}


if __name__ == "__main__":
    main()
