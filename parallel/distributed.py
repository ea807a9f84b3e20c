"""Distributed initialisation: torchrun's environment, or DeepSpeed's init_method, rank and world_size."""

import _thread
import atexit
import datetime
import gc
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from parallel.accelerator import accelerator_name
from parallel.groups import reset_groups

__all__ = ["init_distributed", "local_device"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True, distributed_port: int = 29500,
                     verbose: bool = True, timeout: datetime.timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1, world_size: int = -1, *,
                     backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the process group (DeepSpeed's `deepspeed.init_distributed`, with its arguments).

    The group is the one torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or the one
    `init_method` names (a "tcp://host:port" or "file://path" URL) with `rank` and `world_size`.
    Without either this is a one-process run and nothing is initialised. Already initialised:
    nothing changes. A group made here is destroyed at the process's normal exit, so a script that
    never calls `destroy_process_group` (DeepSpeed's never do) ends cleanly.

    Args:
        dist_backend: "nccl" or "gloo"; default nccl on CUDA, else gloo (see `accelerator_name`).
            `backend` is its other name.
        auto_mpi_discovery, distributed_port, verbose, config: DeepSpeed's; accepted without effect
            (there is no MPI discovery here: launch with torchrun, or pass init_method).
        timeout: the collective timeout, a timedelta (else `timeout_s` seconds), so a hang fails
            instead of stalling.
        init_method: a torch.distributed init URL; needs rank and world_size.
        dist_init_required: False only checks that a group exists; None or True joins one.
        rank, world_size: this process's rank and the number of processes (-1: from the environment).

    Returns:
        (rank, world_size).

    Raises:
        ValueError: some but not all of torchrun's variables are set, init_method without rank and
            world_size, both backend names, or nccl asked for on the CPU.
        RuntimeError: dist_init_required=False and no process group exists.
    """
    if backend is not None and dist_backend is not None and backend != dist_backend:
        raise ValueError(f"dist_backend ({dist_backend!r}) and backend ({backend!r}) name the same thing; pass one")
    backend = dist_backend or backend
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if dist_init_required is False:
        raise RuntimeError("dist_init_required=False, but torch.distributed is not initialised: initialise it first, "
                           "or leave dist_init_required at None")
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}; timeout_s takes seconds")
    explicit = {}
    if init_method is not None and not init_method.startswith("env://"):
        if isinstance(rank, bool) or not isinstance(rank, int) or isinstance(world_size, bool) \
                or not isinstance(world_size, int) or world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"init_method {init_method!r} needs rank and world_size with 0 <= rank < world_size, "
                             f"got rank={rank!r}, world_size={world_size!r}")
        explicit = {"init_method": init_method, "rank": rank, "world_size": world_size}
    else:
        present = [name for name in TORCHRUN_VARIABLES if name in os.environ]
        if not present:
            return 0, 1
        if len(present) != len(TORCHRUN_VARIABLES):
            missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
            raise ValueError(f"torchrun environment incomplete: {missing} missing; launch with torchrun")
        explicit = {key: value for key, value in (("rank", rank), ("world_size", world_size)) if value != -1}
    accelerator = accelerator_name()
    backend = backend or ("nccl" if accelerator == "cuda" else "gloo")
    if backend == "nccl" and accelerator == "cpu":
        raise ValueError("backend 'nccl' needs GPUs, but this process runs on the CPU (DS_ACCELERATOR=cpu, or no "
                         "CUDA device); use backend 'gloo'")
    if backend == "nccl":
        torch.cuda.set_device(local_device())
    timeout = timeout or datetime.timedelta(seconds=timeout_s)
    if not explicit.get("init_method") and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        explicit = {**_attempt_store(timeout), **explicit}
    dist.init_process_group(backend, timeout=timeout, **explicit)
    atexit.unregister(_leave_at_exit)  # once, however often a group is made
    atexit.register(_leave_at_exit)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        _watch_agent()
    return dist.get_rank(), dist.get_world_size()


def _leave_at_exit() -> None:
    """Destroy the process groups at a normal exit, as DeepSpeed scripts never do themselves.

    Groups left to the interpreter's finalisation can abort the process: a gloo worker thread that
    drops its last collective's tensors then needs the GIL, which a finalising interpreter no longer
    hands out, and the thread exits inside a C++ destructor (std::terminate, SIGABRT, a failed
    torchrun). A group's worker threads are joined when its last reference goes: torch's registry
    lets go in `destroy_process_group`, this package's cache in `reset_groups`, and the collection
    frees what only reference cycles (a model and its engine) still hold. Groups a script keeps in
    its own globals live on to finalisation, their workers long idle by then.

    After an uncaught exception (Python has set `sys.last_value`) the groups are left alone: a
    collective still pending on a peer could hold the failing process until the timeout, where an
    exit fails fast. A failure that leaves by `sys.exit` looks like a normal exit, so the destroy runs
    in a daemon thread the exit waits on for at most `_EXIT_DESTROY_S` seconds.
    """
    if getattr(sys, "last_value", None) is not None:
        return
    if dist.is_initialized():
        destroy = threading.Thread(target=dist.destroy_process_group, name="destroy-process-groups", daemon=True)
        destroy.start()
        destroy.join(_EXIT_DESTROY_S)
        if destroy.is_alive():  # a collective still pending: exit as a group left alone would
            return
    reset_groups()
    gc.collect()


_EXIT_DESTROY_S = 10.0  # the longest a normal exit waits for the process groups' destroy


def _attempt_store(timeout: datetime.timedelta) -> dict:
    """The store, rank and world size for a group inside torchrun's shared store, its keys under this
    attempt's restart count.

    torchrun hands its workers the store its rendezvous used and keeps it across restarts; the keys a
    group writes there (each rank's address) would outlive a killed attempt, and a restarted rank would
    read the dead rank's address and fail to connect. A prefix per attempt keeps each attempt's keys
    apart. Every worker of one agent restarts with the same count; the agents of several nodes do not
    (only the failing one counts a failure), so with several nodes and restarts this fails, asking for
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, under which each attempt gets a store of its own.

    Raises:
        ValueError: several nodes with --max-restarts on torchrun's shared store.
    """
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        raise ValueError("torchrun with several nodes and --max-restarts shares its rendezvous store with the "
                         "workers, and its agents count restarts apart, so a restarted group could not form: launch "
                         "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment")
    shared = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"moe_attempt_{attempt}", shared),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def _watch_agent() -> None:
    """Never outlive the torchrun agent that started this process: torchrun detaches its workers from
    its own process group, so a killed agent leaves them running (holding a run's folder, or blocked in
    a collective). A daemon thread interrupts the main thread once the parent is gone, and ends the
    process if that has not ended it within 10 s."""
    agent = os.getppid()
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # under nohup: interrupt_main would do nothing

    def watch():
        while os.getppid() == agent:
            time.sleep(1.0)
        _thread.interrupt_main()  # KeyboardInterrupt in the main thread: its finally blocks run
        time.sleep(10.0)
        os._exit(1)

    threading.Thread(target=watch, name="watch-torchrun-agent", daemon=True).start()


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
