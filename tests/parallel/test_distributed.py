"""`parallel.init_distributed` with DeepSpeed's arguments (`deepspeed.init_distributed`), in one process."""

import datetime
import socket

import pytest
import torch.distributed as dist

import parallel


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_method_rank_world_size_and_timeout_as_deepspeed_takes_them(no_torchrun):
    got = parallel.init_distributed(dist_backend="gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=30), auto_mpi_discovery=False,
                                    distributed_port=1234, verbose=False)
    assert got == (0, 1) and dist.is_initialized() and dist.get_backend() == "gloo"
    assert parallel.init_distributed(dist_init_required=False) == (0, 1)  # a group exists: nothing to do


def test_without_torchrun_or_init_method_nothing_is_initialised(no_torchrun):
    assert parallel.init_distributed() == (0, 1) and not dist.is_initialized()


@pytest.mark.parametrize("kwargs, error, match", [
    ({"init_method": "tcp://127.0.0.1:1"}, ValueError,
     r"init_method 'tcp://127.0.0.1:1' needs rank and world_size with 0 <= rank < world_size, got rank=-1, world_size=-1"),
    ({"init_method": "tcp://127.0.0.1:1", "rank": 2, "world_size": 2}, ValueError, r"got rank=2, world_size=2"),
    ({"dist_init_required": False}, RuntimeError, r"dist_init_required=False, but torch.distributed is not initialised"),
    ({"timeout": 30}, TypeError, r"timeout must be a datetime.timedelta, got int; timeout_s takes seconds"),
    ({"dist_backend": "gloo", "backend": "nccl"}, ValueError, r"dist_backend \('gloo'\) and backend \('nccl'\)"),
])
def test_bad_arguments_fail_before_joining(no_torchrun, kwargs, error, match):
    with pytest.raises(error, match=match):
        parallel.init_distributed(**kwargs)
    assert not dist.is_initialized()
