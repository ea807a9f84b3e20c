"""Distributed initialisation from torchrun's environment."""

import datetime
import os

import torch
import torch.distributed as dist

from parallel.accelerator import accelerator_name

__all__ = ["init_distributed", "local_device"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Without those variables this is a one-process run and nothing is initialised. Already
    initialised: nothing changes.

    Args:
        backend: "nccl" or "gloo"; default nccl on CUDA, else gloo (see `accelerator_name`).
        timeout_s: collective timeout, so a hang fails instead of stalling.

    Returns:
        (rank, world_size).

    Raises:
        ValueError: some but not all of torchrun's variables are set, or nccl is asked for on the CPU.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
    if not present:
        return 0, 1
    if len(present) != len(TORCHRUN_VARIABLES):
        missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
        raise ValueError(f"torchrun environment incomplete: {missing} missing; launch with torchrun")
    accelerator = accelerator_name()
    backend = backend or ("nccl" if accelerator == "cuda" else "gloo")
    if backend == "nccl" and accelerator == "cpu":
        raise ValueError("backend 'nccl' needs GPUs, but this process runs on the CPU (DS_ACCELERATOR=cpu, or no "
                         "CUDA device); use backend 'gloo'")
    if backend == "nccl":
        torch.cuda.set_device(local_device())
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def local_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK on CUDA, else the CPU (see `accelerator_name`).

    Without LOCAL_RANK (a launcher other than torchrun), the GPU is RANK modulo the GPUs on the node,
    so ranks never all land on cuda:0.

    Raises:
        ValueError: LOCAL_RANK or RANK is not a non-negative integer, or LOCAL_RANK names no GPU here.
    """
    if accelerator_name() == "cpu":
        return torch.device("cpu")
    name = "LOCAL_RANK" if "LOCAL_RANK" in os.environ else "RANK"
    value = os.environ.get(name, "0")
    if not value.isdigit():
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    count = max(torch.cuda.device_count(), 1)
    if name == "LOCAL_RANK" and int(value) >= count:
        raise ValueError(f"LOCAL_RANK ({value}) must be below the number of GPUs on this node ({count}); "
                         "DS_ACCELERATOR=cpu runs the ranks on the CPU")
    return torch.device("cuda", int(value) % count)
