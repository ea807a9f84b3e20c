"""`memory_breakdown()` against the ZeRO paper's accounting, per rank, on 4 gloo processes with ep 2.

For psi parameters, world W and K bytes of optimizer state per parameter (Adam: 8 in fp32; 12 with
fp32 master weights beside fp16/bf16 parameters): stage 0 holds P + G + K per parameter, stage 1
shards K, stage 2 also G, stage 3 also P. Dense parameters shard over W ranks, expert parameters
over the W / e ranks of their expert-data-parallel group. Padding and Adam's step counters stay
inside the 5% allowed. bf16 with fp32 master weights keeps fp32 gradients (accumulated in fp32).
Keeping master weights, gradients and Adam's states in bf16 cuts model states by half at stages 0
and 3 (18 -> 8 and 16 -> 8 bytes per parameter); at stages 1 and 2 the accounting itself gives less,
which is checked per part.
"""


from optim import initialize
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
    assert abs(actual - expected) <= 0.05 * expected, f"{what}: {actual} bytes, ZeRO accounting says {expected:.0f}"


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


def test_memory_breakdown_follows_zero_accounting():
    run_distributed(_check, WORLD, timeout_s=400)
