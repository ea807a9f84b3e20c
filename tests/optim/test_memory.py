"""Memory of a step, two kinds of test.

Accounting: `memory_breakdown()` (the bytes of the tensors the engine holds, by its own bookkeeping)
against the ZeRO paper's formula, per rank, on 4 gloo processes with ep 2. Measured: the storages a
stage-2 step really allocates, followed by `optim.memory.LiveBytes`, against a bound (below).

For psi parameters, world W and K bytes of optimizer state per parameter (Adam: 8 in fp32; 12 with
fp32 master weights beside fp16/bf16 parameters): stage 0 holds P + G + K per parameter, stage 1
shards K, stage 2 also G, stage 3 also P. Dense parameters shard over W ranks, expert parameters
over the W / e ranks of their expert-data-parallel group. Padding and Adam's step counters stay
inside the 5% allowed. bf16 with fp32 master weights keeps fp32 gradients (accumulated in fp32).
Keeping master weights, gradients and Adam's states in bf16 cuts model states by half at stages 0
and 3 (18 -> 8 and 16 -> 8 bytes per parameter); at stages 1 and 2 the accounting itself gives less,
which is checked per part.
"""


import io

import pytest
import torch

from optim import initialize
from optim.memory import LiveBytes
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, loss_of

WORLD, EP = 4, 2


def _expected(stage, psi, shards, p_bytes, g_bytes, k_bytes):
    p = p_bytes * psi / (shards if stage >= 3 else 1)
    g = g_bytes * psi / (shards if stage >= 2 else 1)
    k = k_bytes * psi / (shards if stage >= 1 else 1)
    return {"parameters": p, "gradients": g, "optimizer_states": k}


def _one_step(rank, stage, **extra):
    reset_groups()
    model = Net(ep_size=EP, hidden=64, dense_width=64)
    dense = sum(p.numel() for n, p in model.named_parameters() if "experts" not in n)
    expert = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    engine, *_ = initialize(model, config=config(stage, accumulation=1, **extra))
    x, y = batch(0, 0, rank)
    engine.backward(loss_of(engine(x), y))
    engine.step()
    return engine.memory_breakdown(), dense, expert


def _close(actual, expected, what):
    assert abs(actual - expected) <= 0.05 * expected, \
        f"{what}: {actual} bytes accounted, the ZeRO formula says {expected:.0f}"


def _check(rank, world):
    reset_groups()
    edp = expert_groups(EP).edp_size
    for stage in (0, 1, 2, 3):
        report, dense, expert = _one_step(rank, stage)
        for kind, psi, shards in (("dense", dense, world), ("expert", expert, edp)):
            expected = _expected(stage, psi, shards, 4, 4, 8)
            for key, value in expected.items():
                _close(report[kind][key], value, f"stage {stage} {kind} {key} (fp32, Adam)")
        assert report["total"] == sum(report[k] for k in ("parameters", "gradients", "optimizer_states"))
        mixed, _, _ = _one_step(rank, stage, bf16={"enabled": True})
        low, _, _ = _one_step(rank, stage, bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                                 "bf16_optimizer_states": True})
        for kind, psi, shards in (("dense", dense, world), ("expert", expert, edp)):
            # bf16 parameters, fp32 gradients (accumulated over micro-batches in fp32), fp32 master + Adam;
            # fully_shard keeps no bf16 copy at rest: fp32 shards of 4 + 4 + 8 bytes
            expected = _expected(stage, psi, shards, *((2, 4, 12) if stage < 3 else (4, 4, 8)))
            for key, value in expected.items():
                _close(mixed[kind][key], value, f"stage {stage} {kind} {key} (bf16, fp32 master)")
            low_expected = _expected(stage, psi, shards, 2, 2, 4)
            for key, value in low_expected.items():
                _close(low[kind][key], value, f"stage {stage} {kind} {key} (bf16 master and states)")
        if stage in (0, 3):  # at stages 1-2 the unsharded parameters and gradients dominate: (4 + 4/W) vs (6 + 12/W)
            assert low["total"] <= 0.6 * mixed["total"], (stage, low["total"], mixed["total"])


@pytest.mark.slow
def test_memory_breakdown_accounting_matches_zero_formula():
    run_distributed(_check, WORLD, timeout_s=400)


# Stage 2's gradient memory, measured: storages watched by optim.memory.LiveBytes, not the accounting.
# A stack of Linear layers on 2 ranks, one layer per reduction bucket, a batch of 2 (activations are
# tiny): the gradient shard plus whatever the backward and the engine step allocate, at their peak.

WIDTH, LAYERS = 64, 8
PER_LAYER = WIDTH * WIDTH + WIDTH  # elements of one Linear: one reduction bucket


def _gradient_bytes(rank, stage, bucket_size, overlap=True):
    """(persistent gradient bytes, the most bytes a step's backward and engine step allocated at once)."""
    reset_groups()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    zero = {"stage": stage, "reduce_bucket_size": bucket_size, "overlap_comm": overlap}
    tracker = LiveBytes()
    with tracker:
        engine, *_ = initialize(model, config={**config(stage, accumulation=1, clip=1.0), "zero_optimization": zero})
        x = torch.randn(2, WIDTH, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the second step: optimizer states exist, as in any later step
            loss = engine(x).square().mean()
            tracker.reset_peak()
            before = tracker.live
            engine.backward(loss)
            engine.step()
            step_peak = tracker.peak - before
    held = sum(unit.grad().untyped_storage().nbytes() for unit in engine.units)
    return held, step_peak


def _check_gradient_memory(rank, world):
    gradients = LAYERS * PER_LAYER * 4  # fp32
    bucket = PER_LAYER * 4
    slack = 1024  # activation gradients (2 x 64 floats), the loss, clipping's scalars
    for overlap in (True, False):
        held, step_peak = _gradient_bytes(rank, 2, PER_LAYER, overlap)
        assert held <= gradients / world + 64, (held, gradients / world)  # the shard, padded to a multiple of W
        assert held + step_peak <= gradients / world + 2 * bucket + slack, \
            f"stage 2 gradient memory {held + step_peak} bytes > 1/{world} of {gradients} + two buckets of {bucket}"
    # one bucket of everything (DeepSpeed's default size) holds every gradient at once; stage 1 keeps them all
    _, one_bucket_peak = _gradient_bytes(rank, 2, 500_000_000)
    assert one_bucket_peak >= gradients, (one_bucket_peak, gradients)
    stage1_held, _ = _gradient_bytes(rank, 1, PER_LAYER)
    assert stage1_held >= gradients


def test_stage2_gradient_memory_measured_is_a_shard_plus_two_buckets():
    run_distributed(_check_gradient_memory, 2, timeout_s=120)


def test_live_bytes_measures_new_storages_not_views_of_older_ones():
    older = torch.zeros(1000)
    tracker = LiveBytes()
    with tracker:
        older[10:500].view(10, 49).t()  # views of a storage made before: nothing new
        older.add_(1)  # in place: nothing new
        fresh = older[:250].clone()  # 1000 bytes
        kept = fresh * 3  # 1000 bytes, kept
        fresh.mul(2)  # a temporary: 1000 bytes, freed at once
    assert tracker.live == 2000 and tracker.peak == 3000, (tracker.live, tracker.peak)
    del kept, fresh
    assert tracker.live == 0
    buffer = io.BytesIO()
    torch.save(torch.zeros(250), buffer)
    buffer.seek(0)
    with tracker:
        loaded = torch.load(buffer, weights_only=True)  # torch.load attaches its storage with set_
    assert tracker.live == 1000, tracker.live
    del loaded
