"""fp16: an overflow on one rank skips the step on every rank, and the scale follows DeepSpeed's rules.

Scale 2^4, hysteresis 2, window 2. Iterations: clean, overflow (absorbed by hysteresis: 16),
overflow (halved: 8), clean, clean (two clean since the last overflow: doubled to 16). The overflow
is injected on rank 1 only, as an inf in its loss.
"""

import torch

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, loss_of

FP16 = {"enabled": True, "initial_scale_power": 4, "hysteresis": 2, "loss_scale_window": 2, "min_loss_scale": 1}
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                           "warmup_type": "linear"}}
OVERFLOW_AT = (1, 2)
EXPECTED_SCALE = [16, 16, 8, 8, 16]


def _check(rank, world, stage):
    reset_groups()
    engine, *_ = initialize(Net(ep_size=2), config=config(stage, accumulation=1, fp16=FP16, scheduler=SCHEDULE))
    assert engine.loss_scale == 16
    lrs = []
    for step in range(5):
        before = [p.detach().clone() for p in engine.parameters()]
        x, y = batch(step, 0, rank)
        loss = loss_of(engine(x), y)
        if step in OVERFLOW_AT and rank == 1:
            loss = loss * float("inf")
        engine.backward(loss)
        engine.step()
        after = [p.detach() for p in engine.parameters()]
        skipped = step in OVERFLOW_AT
        assert engine.was_step_skipped() == skipped, (rank, step)
        changed = any(not torch.equal(a, b) for a, b in zip(before, after))
        assert changed != skipped, f"rank {rank} step {step}: parameters changed={changed}, skipped={skipped}"
        assert engine.loss_scale == EXPECTED_SCALE[step], (step, engine.loss_scale)
        lrs.append(engine.get_lr()[0])
    assert engine.global_steps == 5 and engine.skipped_steps == 2
    # the schedule advances only on steps taken: lr(0), lr(0), lr(0), lr(1), lr(2) after each
    assert [round(lr, 6) for lr in lrs] == [0.001, 0.001, 0.001, 0.00325, 0.0055], lrs


def test_overflow_on_one_rank_skips_everywhere():
    run_distributed(_check, 2, 1, timeout_s=300)


def test_overflow_on_one_rank_skips_everywhere_stage3():
    run_distributed(_check, 2, 3, timeout_s=300)
