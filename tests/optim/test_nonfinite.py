"""Non-finite gradients without a loss scaler (fp32 here; bf16 takes the same path): `nonfinite: stop`
(the default) raises on every rank, naming the step, the ranks and the last checkpoint, before any
weight changes; `skip` skips the step as fp16's scaler does; `off` does not look. The inf is put into
one rank's loss, as a diverging run would produce it."""

import pytest
import torch

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, loss_of


def _engine(nonfinite=None, ep_size=1, stage=1):
    reset_groups()
    extra = {} if nonfinite is None else {"nonfinite": nonfinite}
    return initialize(Net(ep_size=ep_size), config=config(stage, accumulation=1, clip=0.0, **extra))[0]


def _step(engine, step, rank, poisoned):
    x, y = batch(step, 0, rank)
    loss = loss_of(engine(x), y)
    engine.backward(loss * float("inf") if poisoned else loss)
    engine.step()


def _weights(engine):
    return [p.detach().clone() for p in engine.parameters()]


def test_stop_is_the_default_and_changes_nothing(tmp_path):
    engine = _engine()
    _step(engine, 0, 0, False)
    engine.save_checkpoint(str(tmp_path), tag="good")
    before = _weights(engine)
    with pytest.raises(FloatingPointError, match=r"step 2: the loss was inf or nan on rank\(s\) \[0\] .*"
                                                 r"last checkpoint: .*good"):
        _step(engine, 1, 0, True)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    _step(engine, 2, 0, False)  # the run may go on (a caller that lowers the lr, say): nothing stale is left
    assert all(torch.isfinite(p).all() for p in engine.parameters())


def test_skip_skips_the_step_and_goes_on():
    engine = _engine("skip")
    _step(engine, 0, 0, False)
    before = _weights(engine)
    with pytest.warns(UserWarning, match="step 2 skipped: gradients hold inf or nan"):
        _step(engine, 1, 0, True)
    assert engine.was_step_skipped() and engine.skipped_steps == 1 and engine.global_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    _step(engine, 2, 0, False)
    assert not engine.was_step_skipped() and all(torch.isfinite(p).all() for p in engine.parameters())


def test_off_does_not_look():
    engine = _engine("off")
    _step(engine, 0, 0, True)
    assert not engine.was_step_skipped()
    assert not all(torch.isfinite(p).all() for p in engine.parameters())


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="nonfinite must be stop, skip or off, got 'ignore'"):
        _engine("ignore")


def _one_rank_diverges(rank, world):
    engine = _engine(ep_size=2, stage=2)
    _step(engine, 0, rank, False)
    before = _weights(engine)
    with pytest.raises(FloatingPointError, match=r"on rank\(s\) \[1\] .*last checkpoint: none"):
        _step(engine, 1, rank, rank == 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine))), f"rank {rank} changed its weights"


def test_one_rank_diverging_stops_every_rank():
    run_distributed(_one_rank_diverges, 2, timeout_s=120)
