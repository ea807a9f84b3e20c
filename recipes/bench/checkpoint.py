"""Memory to save and load a checkpoint: the sharded layout beside the previous one (full entries).

    torchrun --standalone --nproc_per_node 8 -m recipes.bench.checkpoint                # the README's figures
    torchrun --standalone --nproc_per_node 8 -m recipes.bench.checkpoint --stage 2 --ep-world-size 2

The model is the GPT recipe's (recipes.gpt_model, an MoE block every second layer) at the widths given,
trained one AdamW step so that every optimizer state exists. All processes then run, one after the
other (each a collective):

- sharded save: `engine.save_checkpoint` (each rank writes the boxes its shard holds);
- full save: the previous version's way, every parameter and optimizer state gathered whole onto its
  owner (rank 0 for dense ones) and written with DCP;
- sharded load: `engine.load_checkpoint` of the sharded checkpoint;
- full load: the previous version's reads, a full tensor for every entry this rank needs, from the
  full checkpoint (its later slicing, which only adds, is left out).

Each runs once unmeasured first (imports and one-time set-up), then measured.
For each, two figures per rank: the process's peak resident memory above what it held when the
operation began (the kernel's high-water mark, reset through /proc/self/clear_refs; glibc's mmap
threshold is pinned and its free memory trimmed first, so that reusing freed memory counts), and the peak of the tensor storages
the operation created (`optim.memory.LiveBytes`; DCP's reads are not tensor operations and do not
show there). Rank 0 prints the largest over ranks and its own, beside the model's full size
(parameters and optimizer states) and one rank's shard of it. Linux only.
"""

import ctypes
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from optim import checkpoint, initialize
from optim.memory import LiveBytes
from parallel import init_distributed, reset_groups
from recipes.common import records
from recipes.common.cli import fail, flag_parser
from recipes.common.training import cpu_name
from recipes.gpt_model import GPT, GPTConfig


@dataclass(kw_only=True)
class BenchConfig:
    n_layer: int = 4
    n_embd: int = 512
    ffn: int = 2048
    num_experts: int = 8
    ep_world_size: int = 1
    stage: int = field(default=3, metadata={"choices": [0, 1, 2, 3]})
    folder: str = field(default="", metadata={"help": "where the checkpoints go (a new temporary folder if empty)"})


_LIBC = ctypes.CDLL("libc.so.6")


def _status(name: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"{name}:\s+(\d+) kB", handle.read()).group(1)) * 1024


def measured(operation) -> tuple[int, int]:
    """(peak resident bytes above the start, peak bytes of tensor storages created) while `operation` runs."""
    if dist.is_initialized():
        dist.barrier()
    _LIBC.malloc_trim(0)  # what earlier work freed leaves the process: reusing it counts as new memory
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets the resident high-water mark to the current size
    start = _status("VmRSS")
    tracker = LiveBytes()
    with tracker:
        operation()
    return _status("VmHWM") - start, tracker.peak


def full_save(engine, folder: str) -> None:
    """The previous version's save: whole entries gathered onto their owners, then written."""
    view = checkpoint._global_view(engine)
    dcp.save(view, storage_writer=dcp.FileSystemWriter(folder), no_dist=not dist.is_initialized())


def full_load(engine, folder: str) -> None:
    """The previous version's reads: a full tensor for every entry this rank's units need."""
    reader = dcp.FileSystemReader(folder)
    stored = reader.read_metadata().state_dict_metadata
    keys = [key for unit in engine.units for info in unit.infos for key in info.keys()]
    wanted = [f"model/{k}" for k in keys] + [s for k in keys for s in stored if s.startswith(f"optim/{k}/")]
    wanted += [k for k in stored if k.startswith("buffer/")]
    targets = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in wanted}
    dcp.load(targets, storage_reader=reader, no_dist=not dist.is_initialized())


def main(argv=None) -> dict:
    parser = flag_parser(BenchConfig, __doc__)
    parser.prog = "recipes.bench.checkpoint"
    records.add_record_flag(parser)
    args = parser.parse_args(argv)
    record_dir = records.take_record_dir(args)
    cfg = BenchConfig(**vars(args))
    if not os.path.exists("/proc/self/clear_refs"):
        fail(parser, "this benchmark reads the kernel's memory high-water mark: Linux only")
    _LIBC.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD fixed: large buffers are mapped alone and returned when freed
    rank, world = init_distributed()
    if world % cfg.ep_world_size or cfg.num_experts % cfg.ep_world_size:
        fail(parser, f"--ep-world-size ({cfg.ep_world_size}) must divide the processes ({world}) and "
                     f"--num-experts ({cfg.num_experts})")
    torch.set_num_threads(1)
    reset_groups()
    model = GPT(GPTConfig(n_layer=cfg.n_layer, n_embd=cfg.n_embd, ffn=cfg.ffn, num_experts=cfg.num_experts,
                          ep_size=cfg.ep_world_size, block_size=64))
    with torch.device("meta"):  # the one-process model, counted without memory
        full_params = sum(p.numel() for p in GPT(GPTConfig(n_layer=cfg.n_layer, n_embd=cfg.n_embd, ffn=cfg.ffn,
                                                           num_experts=cfg.num_experts, block_size=64)).parameters())
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": cfg.stage}}
    engine, *_ = initialize(model, config=config)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
    logits, l_aux, _ = engine(tokens)
    engine.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * l_aux)
    engine.step()
    shard = sum(unit.weights.numel() * (4 + 8) for unit in engine.units)  # fp32 master + AdamW's two states

    own = not cfg.folder
    folder = [tempfile.mkdtemp(prefix="bench_checkpoint_") if rank == 0 and own else cfg.folder]
    if dist.is_initialized():
        dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    full_folder = os.path.join(folder, "full")
    if rank == 0:
        os.makedirs(full_folder, exist_ok=True)
    operations = {
        "sharded save": lambda: engine.save_checkpoint(folder, tag="sharded"),
        "full save": lambda: full_save(engine, full_folder),
        "sharded load": lambda: engine.load_checkpoint(folder, tag="sharded"),
        "full load": lambda: full_load(engine, full_folder),
    }
    for operation in operations.values():  # once unmeasured: first-time imports and set-up are not the checkpoint's
        operation()
    figures = {name: measured(operation) for name, operation in operations.items()}
    gathered = [figures] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, figures)
    if rank == 0:
        mib = 2**20
        print(f"CPU: {cpu_name()}; torch {torch.__version__}; {world} process(es), ZeRO stage {cfg.stage}, "
              f"ep {cfg.ep_world_size}")
        print(f"model: {full_params:,} parameters; with AdamW's states {full_params * 12 / mib:.1f} MiB in full, "
              f"{shard / mib:.1f} MiB on rank 0 ({full_params * 12 / shard:.1f}x)")
        for name in figures:
            rss = [g[name][0] for g in gathered]
            live = [g[name][1] for g in gathered]
            print(f"{name:13s} peak resident +{max(rss) / mib:7.1f} MiB (rank 0 +{rss[0] / mib:7.1f})   "
                  f"tensors +{max(live) / mib:7.1f} MiB (rank 0 +{live[0] / mib:7.1f})", flush=True)
    if dist.is_initialized():
        dist.barrier()
    if rank == 0 and own:
        shutil.rmtree(folder, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    records.record_run(record_dir, "bench_checkpoint", "recipes.bench.checkpoint", argv, figures)
    return figures


if __name__ == "__main__":
    main()
