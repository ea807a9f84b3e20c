"""Non-finite gradients without a loss scaler (fp32 here; bf16 takes the same path): `nonfinite: stop`
(the default) raises on every rank, naming the step, the ranks and the last checkpoint, before any
weight changes; `skip` skips the step as fp16's scaler does; `off` does not look. The inf is put into
one rank's loss, as a diverging run would produce it. With gradient clipping the check reads the norm that
clipping takes (finite exactly when every gradient is), so each case runs with and without it."""

import pytest
import torch

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, loss_of


CLIPS = (0.0, 1.0)


def _engine(nonfinite=None, ep_size=1, stage=1, clip=0.0):
    reset_groups()
    extra = {} if nonfinite is None else {"nonfinite": nonfinite}
    return initialize(Net(ep_size=ep_size), config=config(stage, accumulation=1, clip=clip, **extra))[0]


def _step(engine, step, rank, poisoned):
    x, y = batch(step, 0, rank)
    loss = loss_of(engine(x), y)
    engine.backward(loss * float("inf") if poisoned else loss)
    engine.step()


def _weights(engine):
    return [p.detach().clone() for p in engine.parameters()]


@pytest.mark.parametrize("clip", CLIPS)
def test_stop_is_the_default_and_changes_nothing(tmp_path, clip):
    engine = _engine(clip=clip)
    _step(engine, 0, 0, False)
    engine.save_checkpoint(str(tmp_path), tag="good")
    before = _weights(engine)
    with pytest.raises(FloatingPointError, match=r"step 2: the loss was inf or nan on rank\(s\) \[0\] .*"
                                                 r"last checkpoint: .*good"):
        _step(engine, 1, 0, True)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    _step(engine, 2, 0, False)  # the run may go on (a caller that lowers the lr, say): nothing stale is left
    assert all(torch.isfinite(p).all() for p in engine.parameters())


@pytest.mark.parametrize("clip", CLIPS)
def test_skip_skips_the_step_and_goes_on(clip):
    engine = _engine("skip", clip=clip)
    _step(engine, 0, 0, False)
    before = _weights(engine)
    with pytest.warns(UserWarning, match="step 2 skipped: gradients hold inf or nan"):
        _step(engine, 1, 0, True)
    assert engine.was_step_skipped() and engine.skipped_steps == 1 and engine.global_steps == 2
    assert engine.get_global_grad_norm() is None  # none for a skipped step
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine)))
    _step(engine, 2, 0, False)
    assert not engine.was_step_skipped() and all(torch.isfinite(p).all() for p in engine.parameters())


@pytest.mark.parametrize("clip", CLIPS)
def test_off_does_not_look(clip):
    engine = _engine("off", clip=clip)
    _step(engine, 0, 0, True)
    assert not engine.was_step_skipped()
    assert not all(torch.isfinite(p).all() for p in engine.parameters())


def test_huge_finite_gradients_whose_norm_overflows_are_not_taken_for_non_finite():
    """An fp32 norm of finite gradients can overflow to inf; the check then looks at every element, finds
    none that is inf or nan, and the step is taken, as without clipping."""
    engine = _engine(clip=1.0)
    x, y = batch(0, 0, 0)
    engine.backward(loss_of(engine(x), y) * 1e30)
    grads = [p.grad for p in engine.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    assert not torch.isfinite(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
    before = _weights(engine)
    engine.step()
    assert not engine.was_step_skipped() and engine.skipped_steps == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _weights(engine)))


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="nonfinite must be stop, skip or off, got 'ignore'"):
        _engine("ignore")


def _one_rank_diverges(rank, world, clip):
    engine = _engine(ep_size=2, stage=2, clip=clip)
    _step(engine, 0, rank, False)
    before = _weights(engine)
    with pytest.raises(FloatingPointError, match=r"on rank\(s\) \[1\] .*last checkpoint: none"):
        _step(engine, 1, rank, rank == 1)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(engine))), f"rank {rank} changed its weights"


@pytest.mark.parametrize("clip", CLIPS)
def test_one_rank_diverging_stops_every_rank(clip):
    run_distributed(_one_rank_diverges, 2, clip, timeout_s=120)
