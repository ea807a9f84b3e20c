"""Benchmark the dispatch ops against their torch paths, their references and a plain copy.

    python -m recipes.bench.kernels --tokens 16384 --k 2 --hidden 4096 --dtype bf16     # on a GPU
    python -m recipes.bench.kernels --tokens 4096 --hidden 1024 --dtype fp32           # on a CPU

For permute and unpermute_combine (forward), prints ms, achieved bandwidth (bytes read + written
over time) and its fraction of a device-to-device copy of the same bytes, for: the Triton kernel
(CUDA only; on a CPU the interpreter's timings mean nothing), the torch path, and the reference.
Then it times one MoE layer forward+backward with kernels and on the torch path (CUDA only).
"""

import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from kernels import buffer_rows, expert_positions, permute, permute_reference, unpermute_combine, unpermute_combine_reference
from moe import MoE
from recipes.common import records
from recipes.common.cli import device_or_accelerator, flag_parser

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True)
class KernelBenchConfig:
    tokens: int = 16384
    k: int = 2
    hidden: int = 4096
    experts: int = 8
    capacity_factor: float = 1.25
    dtype: str = field(default="", metadata={"help": "empty: bf16 on a GPU, fp32 on the CPU"})
    steps: int = 20
    warmup: int = 5
    device: str = field(default="", metadata={
        "help": "empty: the process's accelerator (DS_ACCELERATOR, else cuda where there is one, else cpu)"})


def _time(fn, cfg: KernelBenchConfig, device) -> float:
    """Median ms over cfg.steps calls after cfg.warmup."""
    times = []
    for step in range(cfg.warmup + cfg.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= cfg.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _with_backend(backend: str, fn):
    def run():
        previous = os.environ.get("MOE_KERNELS")
        os.environ["MOE_KERNELS"] = backend
        try:
            return fn()
        finally:
            if previous is None:
                os.environ.pop("MOE_KERNELS")
            else:
                os.environ["MOE_KERNELS"] = previous
    return run


def _report(name: str, ms: float, nbytes: int, copy_gbs: float) -> dict:
    gbs = nbytes / ms / 1e6
    print(f"{name:<32} {ms:9.3f} ms {gbs:9.1f} GB/s  {100 * gbs / copy_gbs:6.1f}% of copy")
    return {"ms": ms, "bytes": nbytes, "gbs": gbs}


def main(argv=None) -> dict:
    """Prints the figures; returns them per row name ("copy", "permute (torch)", ...): ms, bytes and GB/s."""
    parser = flag_parser(KernelBenchConfig, __doc__)
    parser.prog = "recipes.bench.kernels"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = KernelBenchConfig(**vars(args))
    cfg.device = device_or_accelerator(parser, cfg.device)
    cfg.dtype = cfg.dtype or ("bf16" if torch.device(cfg.device).type == "cuda" else "fp32")
    if cfg.dtype not in DTYPES:
        parser.error(f"--dtype must be in {list(DTYPES)}, got {cfg.dtype!r}")
    print("config:", asdict(cfg))
    device, dtype = torch.device(cfg.device), DTYPES[cfg.dtype]
    S, K, M, E = cfg.tokens, cfg.k, cfg.hidden, cfg.experts
    torch.manual_seed(0)
    capacity = -(-int(S * K * cfg.capacity_factor) // E)
    expert_SK = torch.argsort(torch.rand(S, E, device=device), 1)[:, :K]  # K distinct experts per token
    _, position_P = expert_positions(expert_SK.reshape(-1), E)
    slot_SK = torch.where(position_P < capacity, position_P, -1).view(S, K)
    row_SK = buffer_rows(torch.where(slot_SK >= 0, expert_SK, -1), slot_SK, capacity=capacity)
    N = E * capacity
    x = torch.randn(S, M, device=device, dtype=dtype)
    buffer = torch.randn(N, M, device=device, dtype=dtype)
    weight = torch.rand(S, K, device=device)
    element = x.element_size()
    kept = int((row_SK >= 0).sum())
    permute_bytes = (kept + N) * M * element  # read each routed row, write every buffer row
    combine_bytes = (kept + S) * M * element  # read each routed row, write every token
    src = torch.ones(permute_bytes // 2, dtype=torch.uint8, device=device)
    dst = torch.ones_like(src)  # both touched first, so the copy measures memory, not page faults
    copy_ms = _time(lambda: dst.copy_(src), cfg, device)
    copy_gbs = 2 * src.numel() / copy_ms / 1e6
    print(f"{'copy':<32} {copy_ms:9.3f} ms {copy_gbs:9.1f} GB/s")
    results = {"copy": {"ms": copy_ms, "bytes": 2 * src.numel(), "gbs": copy_gbs}}
    backends = (["triton"] if device.type == "cuda" else []) + ["torch"]
    for backend in backends:
        run = _with_backend(backend, lambda: permute(x, row_SK, N))
        name = f"permute ({backend})"
        results[name] = _report(name, _time(run, cfg, device), permute_bytes, copy_gbs)
    results["permute (reference)"] = _report("permute (reference)", _time(lambda: permute_reference(x, row_SK, N),
                                                                           cfg, device), permute_bytes, copy_gbs)
    for backend in backends:
        run = _with_backend(backend, lambda: unpermute_combine(buffer, row_SK, weight))
        name = f"unpermute_combine ({backend})"
        results[name] = _report(name, _time(run, cfg, device), combine_bytes, copy_gbs)
    reference = lambda: unpermute_combine_reference(buffer, row_SK, weight)  # noqa: E731
    results["unpermute_combine (reference)"] = _report("unpermute_combine (reference)", _time(reference, cfg, device),
                                                       combine_bytes, copy_gbs)
    if device.type == "cuda":
        expert = nn.Sequential(nn.Linear(M, 4 * M), nn.GELU(), nn.Linear(4 * M, M))
        layer = MoE(M, expert, num_experts=E, k=K, capacity_factor=cfg.capacity_factor).to(device, dtype)
        grad = torch.randn_like(x)

        def step():
            out, l_aux, _ = layer(x)
            torch.autograd.backward([out, l_aux], [grad, torch.ones_like(l_aux)])

        for backend in backends:
            name = f"MoE layer fwd+bwd ({backend})"
            results[name] = {"ms": _time(_with_backend(backend, step), cfg, device)}
            print(f"{name:<32} {results[name]['ms']:9.3f} ms")
    records.record_run(record_dir, "bench_kernels", "recipes.bench.kernels", argv, results)
    return results


if __name__ == "__main__":
    main()
