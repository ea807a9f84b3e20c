"""Gradient buckets where ranks and backwards differ: several param groups on one process group, a
layer one rank does not use, gradient accumulation, a second backward in one micro-batch, an engine
rebuilt over the same model; ZeRO-2's reduces and stages 0/1's all-reduces. Each case equals one
process running the same micro-batches (fp32, 1e-5)."""

import pytest
import torch
from torch import nn

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-6}
WIDTH, STEPS = 8, 3
SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}  # its update shows a wrong gradient scale


class Stack(nn.Module):
    """Four Linear layers; `skip` names one a rank leaves out of its forward (its parameters get no gradient)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def forward(self, x, skip=-1):
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.square().mean()


def _groups(model):
    """Weights and biases in two param groups (decay and no decay), as most recipes split them."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.0}, {"params": biases, "weight_decay": 0.0}]


def _batch(step, rank):
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _skip(rank):
    return 1 if rank == 1 else -1  # rank 1 never uses layer 1


def _reference(world, backwards=1, accumulation=1, skip=True):
    model = Stack()
    optimizer = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for micro in range(accumulation):
            for rank in range(world):
                for _ in range(backwards):
                    loss = model(_batch(step * accumulation + micro, rank), _skip(rank) if skip else -1)
                    (loss / (world * accumulation)).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _engine(bucket_size, overlap, stage=2, accumulation=1):
    reset_groups()
    model = Stack()
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": accumulation, "optimizer": SGD,
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket_size, "overlap_comm": overlap}}
    return initialize(model, model_parameters=_groups(model), config=config)[0]


def _check_groups_and_unused(rank, world, expected, stage, accumulation):
    for bucket_size, overlap in [(WIDTH, True), (WIDTH, False), (WIDTH * WIDTH + WIDTH, True), (10**9, False)]:
        engine = _engine(bucket_size, overlap, stage, accumulation)
        assert (engine.zero.buckets is not None) == (stage <= 2), "stages 0-2 reduce in buckets on 2 ranks"
        for step in range(STEPS * accumulation):
            engine.backward(engine(_batch(step, rank), _skip(rank)))
            engine.step()
        state = engine.consolidated_state_dict()
        if rank == 0:
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, **FP32,
                                           msg=lambda m: f"stage {stage} bucket {bucket_size} overlap {overlap} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stage,accumulation", [(2, 1), (0, 2), (1, 2), (1, 1)])
def test_two_param_groups_and_a_layer_unused_on_one_rank_equal_one_process(stage, accumulation):
    run_distributed(_check_groups_and_unused, 2, _reference(2, accumulation=accumulation), stage, accumulation,
                    timeout_s=120)


def _check_second_backward(rank, world, expected, stage):
    for bucket_size in (10**9, WIDTH):
        engine = _engine(bucket_size, True, stage, accumulation=2)
        for step in range(STEPS * 2):
            loss = engine(_batch(step, rank))  # every parameter used on every rank (see the error below)
            loss.backward(retain_graph=True)
            loss.backward()  # at the window's end every bucket went out in the first: a new round, added in
            engine.step()
        state = engine.consolidated_state_dict()
        if rank == 0:
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, **FP32, msg=lambda m: f"stage {stage} {name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_two_backwards_per_micro_batch_with_accumulation_on_two_ranks(stage):
    run_distributed(_check_second_backward, 2, _reference(2, backwards=2, accumulation=2, skip=False), stage,
                    timeout_s=120)


def _reference_dropping_first(world, accumulation):
    """Each window's first micro-batch's gradients zeroed (set to None) before the next micro-batch."""
    model = Stack()
    optimizer = torch.optim.SGD(_groups(model), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for micro in range(accumulation):
            for rank in range(world):
                loss = model(_batch(step * accumulation + micro, rank), _skip(rank))
                (loss / (world * accumulation)).backward()
            if micro == 0:
                model.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _check_zero_grad_mid_window(rank, world, expected, stage):
    for bucket_size, overlap in [(WIDTH, True), (10**9, False)]:
        engine = _engine(bucket_size, overlap, stage, accumulation=3)
        for step in range(STEPS * 3):
            engine.backward(engine(_batch(step, rank), _skip(rank)))
            if step % 3 == 0:
                engine.module.zero_grad()  # set_to_none: this window's sums so far are dropped
            engine.step()
        state = engine.consolidated_state_dict()
        if rank == 0:
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, **FP32,
                                           msg=lambda m: f"stage {stage} bucket {bucket_size} {name}: {m}")


@pytest.mark.parametrize("stage", [0, 1])
def test_module_zero_grad_during_a_window_drops_the_local_sums(stage):
    run_distributed(_check_zero_grad_mid_window, 2, _reference_dropping_first(2, 3), stage, timeout_s=120)


def test_a_second_backward_in_one_micro_batch_adds_up():
    expected = _reference(1, backwards=2)
    for bucket_size in (10**9, WIDTH):  # one bucket; a bucket per bias or weight
        engine = _engine(bucket_size, False)
        for step in range(STEPS):
            loss = engine(_batch(step, 0), _skip(0))
            loss.backward(retain_graph=True)
            loss.backward()  # every bucket went out in the first: a new round, added into the shards
            engine.step()
        for name, value in expected.items():
            torch.testing.assert_close(engine.module.state_dict()[name], value, **FP32)

    waiting = _engine(WIDTH, False)
    loss = waiting(_batch(0, 0), skip=1)  # layer 1's buckets wait for gradients that never come
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second gradient in one micro-batch after its gradient bucket"):
        loss.backward()


def test_a_rebuilt_engine_gets_its_gradients():
    model = Stack()
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": SGD}
    for stage in (2, 2, 0, 1, 2):  # each engine over the same model, the previous one dropped
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        engine = initialize(model, config={**config, "zero_optimization": {"stage": stage, "reduce_bucket_size": 20}})[0]
        engine.backward(engine(_batch(0, 0)))
        engine.step()
        moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
        assert len(moved) == 8, f"stage {stage}: only {moved} moved"
