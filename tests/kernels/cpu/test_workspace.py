"""The CPU workspace never hands out memory that a live tensor still uses; the allocator it tunes."""

import ctypes.util
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels.cpu import workspace

ROOT = Path(__file__).resolve().parents[3]


def _ptr(t):
    return t.untyped_storage().data_ptr()


def test_storage_is_reused_only_after_every_reference_is_gone():
    workspace.clear()
    first = workspace.empty((8192, 1100), torch.float32)  # over 32 MiB: pooled whether or not glibc was tuned
    first.fill_(1.0)
    view = first[3:]
    del first
    second = workspace.empty((8192, 1100), torch.float32)
    assert _ptr(second) != _ptr(view), "a view keeps the storage in use"
    assert bool((view == 1.0).all())
    address = _ptr(view)
    del view
    third = workspace.empty((8192, 1080), torch.float32)
    assert _ptr(third) == address, "a released storage of the same size class is reused"
    assert third.shape == (8192, 1080) and third.is_contiguous()


def test_small_and_non_float_requests_work():
    small = workspace.empty((4, 4), torch.float32)
    assert small.shape == (4, 4)
    big = workspace.empty((4096, 4096), torch.bfloat16)
    assert big.dtype == torch.bfloat16 and big.numel() == 4096 * 4096
    assert workspace.held_bytes() >= 32 * 1024 * 1024
    workspace.clear()
    assert workspace.held_bytes() == 0


def test_requests_below_32_mib_go_to_glibc_once_it_keeps_freed_chunks():
    """With glibc tuned (kept chunks up to 32 MiB), mid-sized requests skip the pool, which would cost more per call."""
    workspace.clear()
    mid = workspace.empty((1024, 1024), torch.float32)  # 4 MiB
    assert mid.shape == (1024, 1024)
    if workspace._tune_malloc():
        assert workspace.held_bytes() == 0, "a 4 MiB request was pooled although glibc keeps such chunks"
    else:
        assert workspace.held_bytes() >= 4 * 1024 * 1024


def test_the_allocator_reuses_small_requests_and_not_the_largest():
    """Below 1 MiB torch.empty is served from the allocator's free lists; at 32 MiB and beyond a fresh
    request is page-faulted in, so ops that allocate their own output keep to the smaller sizes."""
    assert workspace.allocator_reuses(1 << 10)
    assert not workspace.allocator_reuses(64 << 20)


class _FakeMallctl:
    """jemalloc's mallctl as far as `_tune_jemalloc` uses it: `arenas.narenas` and the decays."""

    def __init__(self, arenas: int, made: int, decay: int = 10000):
        self.arenas, self.made, self.decay, self.written = arenas, made, decay, {}

    def __call__(self, name, oldp, oldlenp, newp, newlen):
        name = name.decode()
        if name.startswith("arena.") and int(name.split(".")[1]) >= self.made:
            return errno.EFAULT  # an arena index not made yet
        if newp is not None:
            self.written[name] = newp._obj.value
        elif name == "arenas.narenas":
            oldp._obj.value = self.arenas
        else:
            oldp._obj.value = self.written.get(name, self.decay)
        return 0


def test_jemalloc_keeps_freed_pages_in_every_arena_made_and_to_come(monkeypatch):
    """Under a preloaded jemalloc the layer turns its decay off (its default faults freed pages in
    again every step): the default of new arenas, and each arena made so far."""
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    mallctl = _FakeMallctl(arenas=4, made=2)
    assert workspace._tune_jemalloc(mallctl)
    assert mallctl.written == {f"{where}.{kind}_decay_ms": -1 for where in ("arenas", "arena.0", "arena.1")
                               for kind in ("dirty", "muzzy")}


@pytest.mark.parametrize("conf, decay, kept", [("dirty_decay_ms:5000", 5000, False), ("dirty_decay_ms:-1", -1, True)])
def test_jemalloc_is_left_as_malloc_conf_sets_its_decay(conf, decay, kept, monkeypatch):
    """A decay named in MALLOC_CONF is the user's: nothing is written, and the answer says whether
    freed pages stay (the workspace then sends mid-sized requests to the pool or to torch.empty)."""
    monkeypatch.setenv("MALLOC_CONF", conf)
    mallctl = _FakeMallctl(arenas=4, made=4, decay=decay)
    assert workspace._tune_jemalloc(mallctl) is kept
    assert mallctl.written == {}


_JEMALLOC = ctypes.util.find_library("jemalloc")


@pytest.mark.skipif(_JEMALLOC is None, reason="jemalloc is not installed")
def test_a_layer_built_under_a_preloaded_jemalloc_turns_its_decay_off():
    """The real library, preloaded into a fresh process: after a layer is built, the decay of every
    arena in use reads -1."""
    script = textwrap.dedent("""
        import ctypes
        from torch import nn
        from moe import MoE
        MoE(8, nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=4, k=2)
        mallctl = ctypes.CDLL(None).mallctl
        mallctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        for kind in ("dirty", "muzzy"):
            for where in ("arenas", "arena.0"):
                name = f"{where}.{kind}_decay_ms".encode()
                value, size = ctypes.c_ssize_t(0), ctypes.c_size_t(ctypes.sizeof(ctypes.c_ssize_t))
                assert mallctl(name, ctypes.byref(value), ctypes.byref(size), None, 0) == 0, name
                print(name.decode(), value.value)
    """)
    env = {key: value for key, value in os.environ.items() if key not in ("MALLOC_CONF", "MOE_CPU_WORKSPACE")}
    env["LD_PRELOAD"] = _JEMALLOC
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["arenas.dirty_decay_ms", "-1", "arena.0.dirty_decay_ms", "-1",
                                   "arenas.muzzy_decay_ms", "-1", "arena.0.muzzy_decay_ms", "-1"]
