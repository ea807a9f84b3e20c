"""Benchmark one MoE layer: forward+backward time, tokens/s, peak memory, and the experts' matmuls alone.

    python -m recipes.bench.moe --tokens 8192 --hidden 512 --ffn 2048 --experts 16 --k 2 \
        --capacity-factor 1.25 --dtype fp32

Prints, for this project's layer (and DeepSpeed's MoE layer side by side when `deepspeed` is
importable and --deepspeed is not "off"): ms per step (median), tokens/s, peak memory of a step (GPU:
allocated bytes; CPU: the most bytes held at once by the storages the step creates or takes from the
CPU workspace, see `peak_memory`),
and the time of the experts' matrix products alone on the rows each layer actually multiplies
(routed tokens for ours, the full capacity buffer for DeepSpeed), issued as each layer issues them
(see `expert_matmuls`), and that time as a share of the layer's step.

By default the input needs no gradient, as for a model's first layer: both layers' backward then
skip the input gradient of the experts' first product (autograd does for DeepSpeed's nn.Linear; ours
asks `ctx.needs_input_grad`), five products per expert instead of six. --input-grad times the layer
as it runs after other layers, with all six.
"""

import math
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels import grouped_mm, grouped_mm_t
from kernels.cpu import gemm, threads
from moe import MoE
from moe.layer import EXPERT_LAYOUTS
from optim.memory import LiveBytes
from recipes.common import records
from recipes.common.cli import device_or_accelerator, fail, flag_parser, require_at_least
from recipes.common.training import cpu_name

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU}


@dataclass(kw_only=True)
class BenchConfig:
    tokens: int = 8192
    hidden: int = 512
    ffn: int = 2048
    experts: int = 16
    k: int = 2
    capacity_factor: float = 1.25
    dtype: str = "fp32"
    activation: str = "gelu"
    steps: int = 7
    warmup: int = 5
    seed: int = 0
    deepspeed: str = "auto"
    input_grad: bool = field(default=False, metadata={
        "help": "the input needs a gradient, as for a layer after others in a model (six products per expert "
                "in the backward, not five)"})
    device: str = field(default="", metadata={
        "help": "empty: the process's accelerator (DS_ACCELERATOR, else cuda where there is one, else cpu)"})
    expert_layout: str = field(default="auto", metadata={
        "choices": list(EXPERT_LAYOUTS), "help": "our layer's expert layout (auto: packed on the CPU; on a GPU "
                                                 "grouped in bf16 where torch's grouped GEMM runs, else padded "
                                                 "when dropping; see moe.layer.MOELayer)"})


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def layer_step(layer: nn.Module, x: torch.Tensor):
    """One forward+backward of the layer (output and l_aux), gradients (the input's too) set to None first."""
    grad_out = torch.randn_like(x)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        out, l_aux, _ = layer(x)
        torch.autograd.backward([out, l_aux], [grad_out, torch.ones_like(l_aux)])

    return step


def peak_memory(step, device) -> int:
    """Peak memory of one step: allocated bytes on a GPU; elsewhere the most bytes held at once by the
    storages the step creates (`optim.memory.LiveBytes`), measured apart from the timed steps.

    Resident-memory growth cannot be used on the CPU: once the workspace has tuned glibc to keep freed
    chunks (kernels.cpu.workspace), a step served from memory an earlier step freed grows nothing.
    Workspace storages the step takes count as live from then on, as they stay held between steps.
    Allocations on the concurrent plan's workers other than the calling thread are not seen (dispatch
    modes are thread-local; the calling thread is a worker too where the workers are torch's OpenMP
    team): the workers write into buffers made on the calling thread, but a oneDNN product there makes
    its own output before copying it in (one expert's rows per worker at a time).
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        return torch.cuda.max_memory_allocated()
    with LiveBytes() as tracker:
        step()
    return tracker.peak


def time_interleaved(steps: dict, cfg: BenchConfig, device) -> dict:
    """Median ms of each step function, timed in rounds (one call of each per round) to share drift."""
    times = {name: [] for name in steps}
    for index in range(cfg.warmup + cfg.steps):
        for name, step in steps.items():
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if index >= cfg.warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def expert_matmuls(counts: list[int], cfg: BenchConfig, device, ours: bool, layout: str = "packed"):
    """The experts' products of one forward+backward, alone, as each layer issues them (forward products
    with their biases, as both layers' products add them); the input gradient of the first product
    only with --input-grad, as both layers' backward computes it only then.

    Ours: per expert through `kernels.cpu.gemm` into preallocated outputs, with the backends the layer's
    products were measured to use (or one grouped GEMM per product, or experts side by side on worker
    threads with the backends measured there, when the layer chose that plan), without the layer's
    activations and sums around them.
    With the padded layout: batched products on the [E, C, M] capacity
    buffer, as `moe.experts` issues them; with the grouped layout, one grouped GEMM per product.
    DeepSpeed's: torch's default products (F.linear forward, mm backward) per expert on the full
    capacity buffer, as autograd runs nn.Linear.
    """
    dtype = DTYPES[cfg.dtype]
    M, H = cfg.hidden, cfg.ffn
    N = sum(counts)
    x, gy, gx, y = (torch.randn(N, M, device=device, dtype=dtype) for _ in range(4))
    h, gh, a, ga = (torch.randn(N, H, device=device, dtype=dtype) for _ in range(4))
    w1, gw1 = (torch.randn(len(counts), H, M, device=device, dtype=dtype) for _ in range(2))
    w2, gw2 = (torch.randn(len(counts), M, H, device=device, dtype=dtype) for _ in range(2))
    b1, b2 = torch.randn(len(counts), H, device=device, dtype=dtype), torch.randn(len(counts), M, device=device, dtype=dtype)
    experts = _whole(counts)

    def expert_products(e, rows):
        gemm.linear(x[rows], w1[e], b1[e], out=h[rows])  # forward: x W1^T + b1, a W2^T + b2
        gemm.linear(a[rows], w2[e], b2[e], out=y[rows])
        gemm.linear(gy[rows], w2[e].t(), out=ga[rows])  # backward: input and weight gradients
        if cfg.input_grad:
            gemm.linear(gh[rows], w1[e].t(), out=gx[rows])
        gemm.linear_tn(gy[rows], a[rows], out=gw2[e])
        gemm.linear_tn(gh[rows], x[rows], out=gw1[e])

    def run_ours():
        for e, rows in experts:
            if rows.stop > rows.start:
                expert_products(e, rows)

    def run_concurrent():  # experts side by side on single-threaded workers, products measured there
        threads.run_each(lambda item: expert_products(*item),
                         sorted(((e, rows) for e, rows in experts if rows.stop > rows.start),
                                key=lambda item: item[1].start - item[1].stop))

    def run_grouped():
        grouped_mm(x, w1.transpose(1, 2), counts)
        grouped_mm(a, w2.transpose(1, 2), counts)
        grouped_mm(gy, w2, counts)
        if cfg.input_grad:
            grouped_mm(gh, w1, counts)
        grouped_mm_t(gy, a, counts)
        grouped_mm_t(gh, x, counts)

    def run_padded():
        L, C = len(counts), counts[0]
        x3, h3, a3, gy3, gh3 = (t.view(L, C, -1) for t in (x, h, a, gy, gh))
        torch.baddbmm(b1.unsqueeze(1), x3, w1.transpose(1, 2), out=h3)
        torch.baddbmm(b2.unsqueeze(1), a3, w2.transpose(1, 2), out=y.view(L, C, -1))
        torch.bmm(gy3, w2, out=ga.view(L, C, -1))
        if cfg.input_grad:
            torch.bmm(gh3, w1, out=gx.view(L, C, -1))
        torch.bmm(gy3.transpose(1, 2), a3, out=gw2)
        torch.bmm(gh3.transpose(1, 2), x3, out=gw1)

    def run_deepspeed():
        for e, rows in experts:
            nn.functional.linear(x[rows], w1[e], b1[e])
            nn.functional.linear(h[rows], w2[e], b2[e])
        for e, rows in experts:
            torch.mm(gy[rows], w2[e])
            torch.mm(gy[rows].t(), h[rows])
            if cfg.input_grad:
                torch.mm(gh[rows], w1[e])
            torch.mm(gh[rows].t(), x[rows])

    if not ours:
        return run_deepspeed
    if layout == "padded":
        return run_padded
    if layout == "grouped":
        return run_grouped
    plans = {choice for key, choice in gemm.choices().items() if key.startswith("mlp")}  # the layer's plan
    return run_grouped if "grouped" in plans else run_concurrent if "concurrent" in plans else run_ours


def chosen_backends() -> str:
    """What the measured choices of `kernels.cpu.gemm` came to: how many shape classes took each option."""
    tally: dict[str, int] = {}
    for key, choice in gemm.choices().items():
        name = f"{key.split('|')[0]}:{choice}"
        tally[name] = tally.get(name, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(tally.items())) or "none measured"


def _whole(counts: list[int]) -> list[tuple[int, slice]]:
    """(expert, row slice) for every expert, empty ones included (DeepSpeed multiplies them all)."""
    bounds, start = [], 0
    for e, count in enumerate(counts):
        bounds.append((e, slice(start, start + count)))
        start += count
    return bounds


def make_expert(cfg: BenchConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(cfg.hidden, cfg.ffn), ACTIVATIONS[cfg.activation](), nn.Linear(cfg.ffn, cfg.hidden))


def deepspeed_layer(cfg: BenchConfig, expert: nn.Module):
    """DeepSpeed's MoE layer on the same config, or None when deepspeed is not importable."""
    try:
        import deepspeed  # optional: only for side-by-side figures
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
    except ImportError:
        return None
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1"),
                       ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo")
    layer = DeepSpeedMoE(cfg.hidden, expert, num_experts=cfg.experts, k=cfg.k, capacity_factor=cfg.capacity_factor,
                         min_capacity=4)
    layer.set_deepspeed_parallelism()
    return layer


def _report(name: str, ms: float, peak: int, matmul_ms: float, rows: int, cfg: BenchConfig) -> None:
    print(
        f"{name:<10} {ms:9.1f} ms/step {cfg.tokens / ms * 1e3:10.0f} tokens/s  peak {peak / 2**20:8.1f} MiB"
        f"  expert matmuls alone {matmul_ms:8.1f} ms on {rows} rows = {100 * matmul_ms / ms:5.1f}% of the step"
    )


def main(argv=None) -> dict:
    parser = flag_parser(BenchConfig, __doc__)
    parser.prog = "recipes.bench.moe"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = BenchConfig(**vars(args))
    if cfg.dtype not in DTYPES or cfg.activation not in ACTIVATIONS or cfg.deepspeed not in ("auto", "on", "off"):
        parser.error(f"--dtype must be in {list(DTYPES)}, --activation in {list(ACTIVATIONS)}, --deepspeed auto|on|off")
    require_at_least(parser, cfg, ("tokens", "hidden", "ffn", "experts", "steps"))
    require_at_least(parser, cfg, ("warmup",), 0)
    if cfg.tokens < 4:
        fail(parser, f"--tokens ({cfg.tokens}) must be at least 4, the layers' min_capacity")
    if not 1 <= cfg.k <= cfg.experts:
        fail(parser, f"--k ({cfg.k}) must be between 1 and --experts ({cfg.experts})")
    if not (math.isfinite(cfg.capacity_factor) and cfg.capacity_factor > 0):
        fail(parser, f"--capacity-factor must be a positive finite number, got {cfg.capacity_factor}")
    cfg.device = device_or_accelerator(parser, cfg.device)
    print(cfg, f"threads={torch.get_num_threads()} CPU: {cpu_name()} torch {torch.__version__}")
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    torch.manual_seed(cfg.seed)
    expert = make_expert(cfg)
    x = torch.randn(cfg.tokens, cfg.hidden, device=device, dtype=dtype).requires_grad_(cfg.input_grad)
    ours = MoE(cfg.hidden, expert, num_experts=cfg.experts, k=cfg.k, capacity_factor=cfg.capacity_factor,
               expert_layout=cfg.expert_layout).to(device, dtype)
    ours.deepspeed_moe.gate.float()
    layers = {"ours": ours}
    if cfg.deepspeed != "off":
        theirs = deepspeed_layer(cfg, expert)
        if theirs is None and cfg.deepspeed == "on":
            raise SystemExit("--deepspeed on: deepspeed is not importable in this environment")
        if theirs is not None:
            theirs = theirs.to(device, dtype)
            theirs.deepspeed_moe.gate.float()
            theirs.deepspeed_moe.gate.wg.weight.data.copy_(ours.deepspeed_moe.gate.wg.weight.data)
            layers["deepspeed"] = theirs
    steps = {name: layer_step(layer, x) for name, layer in layers.items()}
    steps["ours"]()
    capacity = max(math.ceil(cfg.tokens / cfg.experts * cfg.capacity_factor * cfg.k), 4)
    layout = ours.deepspeed_moe._layout(device, dtype)
    # the rows each layer multiplies: the routed tokens (ours, packed or grouped), or the whole capacity
    # buffer (DeepSpeed, and ours padded)
    routing = ours.deepspeed_moe.routing
    rows = {"ours": [int(routing.capacity)] * cfg.experts if layout == "padded" else routing.kept_counts().tolist(),
            "deepspeed": [capacity] * cfg.experts}
    for name in layers:
        steps[f"{name} matmuls"] = expert_matmuls(rows[name], cfg, device, ours=name == "ours", layout=layout)
    ms = time_interleaved(steps, cfg, device)
    print(f"our expert layout: {layout}; CPU products (shape classes -> backend, measured): {chosen_backends()}")
    results = {}
    for name, layer in layers.items():
        peak = peak_memory(steps[name], device)
        _report(name, ms[name], peak, ms[f"{name} matmuls"], sum(rows[name]), cfg)
        results[name] = {"ms": ms[name], "peak_bytes": peak, "matmul_ms": ms[f"{name} matmuls"]}
    if "deepspeed" in results:
        print(f"speed-up over deepspeed: {results['deepspeed']['ms'] / results['ours']['ms']:.2f}x")
    records.record_run(record_dir, "bench_moe", "recipes.bench.moe", argv, results)
    return results


if __name__ == "__main__":
    main()
