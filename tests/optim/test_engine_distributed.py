"""The engine on 4 gloo processes against one process with every expert (fp32: 1e-5 relative).

World 4, ep 1 and 2, ZeRO stages 0-3, gradient accumulation 2, clipping on (the clip threshold is
small enough to bite): after 3 optimizer steps every parameter, gathered by
`consolidated_state_dict`, equals plain torch AdamW on the same micro-batches. Stage 2 also runs
with small reduction buckets (one parameter each; a few parameters, cut across shard boundaries),
reduced during the backward synchronously and overlapped, and stages 0/1 with all-reduce buckets. A bf16 twin stays
within bf16 tolerance of the fp32 run, and `memory_breakdown` follows the ZeRO accounting.
"""

import copy

import pytest
import torch
from torch import nn

from moe import MoE
from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import CLASSES, E, H, M, Net, config, engine_steps, reference_steps

FP32 = {"rtol": 1e-5, "atol": 1e-6}
# bf16 holds about 3 significant digits: parameters near 0.5 are stored to within 2e-3.
BF16 = {"rtol": 1e-2, "atol": 5e-3}
# SGD for the bf16 twin: its update is linear in the gradient, so a wrong gradient shows; Adam's
# normalised update flips sign on near-zero gradients and would hide or exaggerate precision effects.
SGD = {"type": "SGD", "params": {"lr": 1.0, "momentum": 0.9}}
# AdamW's update (and clipping) hide a gradient's scale, so a wrong divisor shows only under SGD without clipping.
SGD_SMALL = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
# Every token goes to every expert with room to spare: top-k choices and capacity drops are
# discontinuous, and a near tie decided differently in bf16 would change a gradient by a whole token.
CONTINUOUS = {"k": 4, "capacity_factor": 2.0}
WORLD, ACCUMULATION, CLIP, STEPS = 4, 2, 0.05, 3


def _reference_state(sgd=False):
    reference = Net(ep_size=1)
    if sgd:
        optimizer = torch.optim.SGD(reference.parameters(), lr=SGD_SMALL["params"]["lr"], momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
    reference_steps(reference, optimizer, STEPS, WORLD, ACCUMULATION, 0 if sgd else CLIP)
    return reference.state_dict()


def _train(rank, ep_size, stage, clip=CLIP, net=None, **extra):
    reset_groups()
    engine, *_ = initialize(Net(ep_size=ep_size, **(net or {})), config=config(stage, ACCUMULATION, clip, **extra))
    engine_steps(engine, STEPS, rank, ACCUMULATION)
    return engine, engine.consolidated_state_dict()


# stage 2's reduction buckets: (bucket size in elements, overlap_comm)
BUCKETS = [(1, False), (1, True), (40, True), (150, False)]


def _check_equivalence(rank, world, ep_size):
    expected = {False: _reference_state(), True: _reference_state(sgd=True)} if rank == 0 else None
    buckets = [{"zero_optimization": {"stage": 2, "reduce_bucket_size": size, "overlap_comm": overlap}}
               for size, overlap in BUCKETS]
    # stages 0/1 all-reduce in buckets in the window's last backward (accumulation 2 here)
    all_reduce = [{"zero_optimization": {"stage": stage, "reduce_bucket_size": size, "overlap_comm": overlap}}
                  for stage, (size, overlap) in [(0, BUCKETS[1]), (1, BUCKETS[3])]]
    all_reduce_sgd = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 40, "overlap_comm": True}}
    layouts = [(stage, {}) for stage in (0, 1, 2, 3)] + [(2, extra) for extra in buckets] + [
        (extra["zero_optimization"]["stage"], extra) for extra in all_reduce] + [
        (stage, {**extra, "optimizer": SGD_SMALL, "clip": 0}) for stage, extra in [(0, {}), (2, {}), (3, {})]
        + [(2, extra) for extra in buckets[::2]] + [(1, all_reduce_sgd)]]
    for stage, extra in layouts:
        sgd = "clip" in extra
        engine, state = _train(rank, ep_size, stage, **extra)
        state_expected = expected[sgd] if rank == 0 else None
        assert engine.global_steps == STEPS
        if rank == 0:
            assert state.keys() == state_expected.keys(), (stage, sorted(state), sorted(state_expected))
            for name, value in state_expected.items():
                torch.testing.assert_close(state[name], value, **FP32, msg=lambda m: f"stage {stage} {extra} {name}: {m}")
                if "weight" in name:
                    assert not torch.equal(value, Net(1).state_dict()[name]), f"{name} never moved"


@pytest.mark.slow
@pytest.mark.parametrize("ep_size", [1, 2])
def test_every_stage_matches_one_process(ep_size):
    run_distributed(_check_equivalence, WORLD, ep_size, timeout_s=400)


def _check_one_rank_per_expert(rank, world):
    """ep = world: every expert-data-parallel group is one rank, where no reduction runs but the gradient
    must still be divided by the world size (SGD, so a wrong scale shows)."""
    expected = _reference_state(sgd=True) if rank == 0 else None
    for stage in (0, 2, 3):
        _, state = _train(rank, WORLD, stage, clip=0, optimizer=SGD_SMALL)
        if rank == 0:
            for name, value in expected.items():
                torch.testing.assert_close(state[name], value, **FP32, msg=lambda m: f"stage {stage} {name}: {m}")


@pytest.mark.slow
def test_one_rank_per_expert_group_matches_one_process():
    run_distributed(_check_one_rank_per_expert, WORLD, timeout_s=300)


class _CopyInitNet(nn.Module):
    """Net's shape with expert_init="copy" (every expert a copy of the template) and no seed of its own."""

    def __init__(self, ep_size):
        super().__init__()
        self.inp = nn.Linear(M, M)
        self.moe = MoE(M, nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M)), num_experts=E, ep_size=ep_size,
                       k=2, capacity_factor=1.0, min_capacity=0, use_rts=False, top2_2nd_expert_sampling=False)
        self.out = nn.Linear(M, CLASSES)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h), l_aux


def _check_unseeded_copy_init(rank, world):
    """Each rank builds its model from its own RNG state, as an unseeded script does: at ep 1, 2 and 4 the
    engine starts from rank 0's model (every expert a copy of rank 0's template) and takes the same step as
    one process running rank 0's model."""
    if rank == 0:
        torch.manual_seed(1000)
        reference = _CopyInitNet(1)
        start = copy.deepcopy(reference.state_dict())
        optimizer = torch.optim.SGD(reference.parameters(), lr=SGD_SMALL["params"]["lr"], momentum=0.9)
        reference_steps(reference, optimizer, 1, WORLD, ACCUMULATION, 0)
        after = reference.state_dict()
    for ep_size in (1, 2, 4):
        reset_groups()
        torch.manual_seed(1000 + rank)  # a different template on every rank
        engine, *_ = initialize(_CopyInitNet(ep_size), config=config(1, ACCUMULATION, 0, optimizer=SGD_SMALL))
        begun = engine.consolidated_state_dict()
        engine_steps(engine, 1, rank, ACCUMULATION)
        stepped = engine.consolidated_state_dict()
        if rank == 0:
            for name, value in start.items():
                torch.testing.assert_close(begun[name], value, rtol=0, atol=0, msg=lambda m: f"ep {ep_size} start {name}: {m}")
                torch.testing.assert_close(stepped[name], after[name], **FP32, msg=lambda m: f"ep {ep_size} step {name}: {m}")


@pytest.mark.slow
def test_unseeded_copy_init_starts_and_steps_as_one_process_at_every_ep_size():
    run_distributed(_check_unseeded_copy_init, WORLD, timeout_s=300)


def _check_loaded_experts_are_kept(rank, world):
    """Experts written into before initialize (a loaded state dict) are not replaced by rank 0's template."""
    reset_groups()
    torch.manual_seed(1000 + rank)
    model = _CopyInitNet(2)
    experts = model.moe.deepspeed_moe.experts
    with torch.no_grad():
        experts.weight1.copy_(torch.full_like(experts.weight1, float(rank + 1)))
    initialize(model, config=config(1, ACCUMULATION, 0, optimizer=SGD_SMALL))
    assert bool((experts.weight1 == rank + 1).all()), "this rank's loaded experts were overwritten"


def test_experts_loaded_before_initialize_are_kept():
    run_distributed(_check_loaded_experts_are_kept, 2, timeout_s=120)


def _check_bf16(rank, world, stage):
    _, fp32 = _train(rank, 2, stage, clip=0, net=CONTINUOUS, optimizer=SGD)
    _, bf16 = _train(rank, 2, stage, clip=0, net=CONTINUOUS, optimizer=SGD, bf16={"enabled": True})
    _, low = _train(rank, 2, stage, clip=0, net=CONTINUOUS, optimizer=SGD, bf16={"enabled": True, "bf16_master_weights_and_grads": True,
                                                         "bf16_optimizer_states": True})
    if rank == 0:
        initial = Net(1, **CONTINUOUS).state_dict()
        for name, value in fp32.items():
            assert (value - initial[name]).abs().max() > 0.01, f"{name} moved too little to compare"
            torch.testing.assert_close(bf16[name].float(), value, **BF16, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(low[name].float(), value, **BF16, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_stays_near_fp32(stage):
    run_distributed(_check_bf16, WORLD, stage, timeout_s=400)
