"""The newer routers under expert and data parallelism, against one process (fp32, 1e-5 relative).

1. Layers: expert choice and group-limited top-2 (softmax and sigmoid, with and without a hand-set
   expert bias, one with a gated shared expert) at world 4, ep 1, 2 and 4, in the padded, packed
   and dropless layouts. Each rank feeds its own tokens; a one-process reference holding every
   expert feeds each rank's tokens in turn. Outputs and l_aux match per rank; gradients match after
   summing over the ranks that share a parameter (dense ones over everyone, each expert over its
   expert-data-parallel group, compared with the reference's slice for the local experts).
2. Counts: the step's routed counts behind the expert bias and global_aux_loss, summed over the
   data-parallel group, equal one process fed the whole global batch, micro-batch by micro-batch;
   so do the bias after several steps (exactly) and the rank-averaged l_aux and its gate gradient.
3. Engine: `optim.initialize` at world 4, ep 2, ZeRO stages 0, 2 and 3 leaves the same expert bias
   on every rank after each step, equal to a one-process engine fed the concatenated micro-batches
   (exactly: the bias moves in steps of u, so equal counts give equal bits), with the rank-mean
   loss and the parameters equal too (1e-5).
4. Checkpoints: at stages 2 and 3 (world 4), and in one process, the engine saves, trains on and
   records; a fresh engine loads: its expert bias equals the saved one, and the same steps give the
   same losses and bias bit for bit.

Two runs of 4 ranks (parts 1-2, parts 3-4): starting ranks costs far more than a configuration inside a run.
Each rank uses one intra-op thread: 4 processes on a 2-core machine otherwise spend most of their
time waiting on each other's threads (tens of times slower).
"""

import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe import MoE, update_routing
from optim import initialize
from parallel import expert_groups, reset_groups
from tests.distributed import run_distributed

FP32 = {"rtol": 1e-5, "atol": 1e-5}
S, M, H, E, WORLD = 24, 8, 16, 8, 4
EXPERT_BIAS = torch.tensor([0.3, -0.2, 0.1, 0.0, -0.3, 0.2, -0.1, 0.05])

GROUPS = {"k": 2, "n_group": 4, "topk_group": 2, "capacity_factor": 0.75}  # C = 5: 40 slots for 48 choices
ROUTERS = {
    "expert_choice": {"routing": "expert_choice", "capacity_factor": 2.0},
    "groups_softmax": GROUPS,
    "groups_sigmoid": {**GROUPS, "scoring_func": "sigmoid"},
    "groups_softmax_bias_shared": {**GROUPS, "bias_update_speed": 1e-3, "n_shared_experts": 1,
                                   "shared_expert_gate": True},
    # two groups of four, one kept: at ep 2 each token reaches one device (device-limited routing)
    "halves_sigmoid_bias_scaled": {**GROUPS, "n_group": 2, "topk_group": 1, "scoring_func": "sigmoid",
                                   "bias_update_speed": 1e-3, "routed_scaling_factor": 2.5},
}


def _expert():
    return nn.Sequential(nn.Linear(M, H), nn.GELU(), nn.Linear(H, M))


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread for the one-process references: on a small, busy machine more only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _layer(ep_size, layout, router, expert_bias=EXPERT_BIAS):
    kwargs = dict(num_experts=E, ep_size=ep_size, min_capacity=0, expert_init="per_expert_seed", seed=3, **router)
    if layout == "dropless":
        kwargs.update(dropless=True)
    else:
        kwargs.update(expert_layout=layout)
    torch.manual_seed(0)
    layer = MoE(M, _expert(), **kwargs)
    if layer.expert_bias is not None:
        with torch.no_grad():
            layer.expert_bias.copy_(expert_bias)
    return layer


def _inputs(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(S, M, generator=g), torch.randn(S, M, generator=g)


def _check_bias_matters(reference, x):
    """The hand-set bias changes some choice (else the bias cases would prove nothing)."""
    gate = reference.deepspeed_moe.gate
    with_bias = gate(x).expert_idx_SK
    saved = gate.expert_bias.clone()
    with torch.no_grad():
        gate.expert_bias.zero_()
        without = gate(x).expert_idx_SK
        gate.expert_bias.copy_(saved)
    assert not torch.equal(with_bias, without), "the expert bias should change some choice"


def _check_layout(rank, world, ep_size, layout, router):
    reset_groups()
    layer, reference = _layer(ep_size, layout, router), _layer(1, layout, router)
    x, grad = _inputs(rank)
    out, l_aux, _ = layer(x)
    ((out * grad).sum() + l_aux).backward()
    for r in range(world):  # the reference sees every rank's tokens in turn
        xr, gr = _inputs(r)
        out_r, l_aux_r, _ = reference(xr)
        if r == rank:
            torch.testing.assert_close(out, out_r, **FP32)
            torch.testing.assert_close(l_aux, l_aux_r, **FP32)
            dropped = int((layer.deepspeed_moe.routing.expert_idx_SK < 0).sum())
        ((out_r * gr).sum() + l_aux_r).backward()
    if router.get("routing") != "expert_choice":
        assert (layout == "dropless") == (dropped == 0), f"{dropped} choices dropped"
    if reference.expert_bias is not None:
        _check_bias_matters(reference, x)
    experts = dict(layer.deepspeed_moe.experts.named_parameters())
    reference_params = dict(reference.named_parameters())
    dense = [(n, p) for n, p in layer.named_parameters() if not n.startswith("deepspeed_moe.experts.")]
    assert len(dense) == len(reference_params) - len(experts)
    for name, param in dense:  # the gate, and a shared expert and its gate: replicated over everyone
        grad_sum = param.grad.clone()
        dist.all_reduce(grad_sum)
        torch.testing.assert_close(grad_sum, reference_params[name].grad, **FP32, msg=lambda m: f"{name}: {m}")
    groups = expert_groups(ep_size) if ep_size > 1 else None
    L = E // ep_size
    first = (groups.ep_rank if groups else 0) * L
    for name, param in experts.items():
        grad_sum = param.grad.clone()
        dist.all_reduce(grad_sum, group=groups.edp_group if groups else None)
        ref_param = reference_params[f"deepspeed_moe.experts.{name}"]
        torch.testing.assert_close(param.detach(), ref_param.detach()[first : first + L], **FP32)
        torch.testing.assert_close(grad_sum, ref_param.grad[first : first + L], **FP32, msg=lambda m: f"{name}: {m}")


def _check_layers(rank, world, configs):
    for ep_size, layout, name in configs:
        try:
            _check_layout(rank, world, ep_size, layout, ROUTERS[name])
        except AssertionError as error:
            raise AssertionError(f"part 1, world {world}, ep {ep_size}, {name}, {layout}: {error}") from error


# 2. The step's counts: each rank routes its quarter of a global batch of WORLD * S tokens.

STEPS, MICRO = 3, 2
NO_SAMPLING = {"use_rts": False, "top2_2nd_expert_sampling": False, "capacity_factor": 1.0}
COUNTERS = {
    "global_bias_softmax": {"k": 2, "bias_update_speed": 0.01, "load_balancing_type": "global_aux_loss"},
    "global_bias_sigmoid_groups": {"k": 2, "n_group": 4, "topk_group": 2, "scoring_func": "sigmoid",
                                   "bias_update_speed": 0.01, "load_balancing_type": "global_aux_loss"},
    "aux_bias_sigmoid": {"k": 2, "scoring_func": "sigmoid", "bias_update_speed": 0.01},  # counts summed at update
    "global_top1": {**NO_SAMPLING, "k": 1, "load_balancing_type": "global_aux_loss"},
    "global_top2": {**NO_SAMPLING, "k": 2, "load_balancing_type": "global_aux_loss"},
}


def _tokens(step, micro, rank):
    return torch.randn(S, M, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _global_tokens(step, micro):
    return torch.cat([_tokens(step, micro, r) for r in range(WORLD)])


def _count_steps(layer, tokens, world=1):
    """Train-mode forwards of l_aux alone, MICRO per step, then update_routing; what the gate saw, per micro-batch.

    Returns [step][micro] = {counts, l_aux, grad} (rank values summed or averaged over the world), and
    [step][MICRO] = {bias}: the expert bias after that step's update.
    """
    gate = layer.deepspeed_moe.gate
    record = []
    for step in range(STEPS):
        record.append([])
        for micro in range(MICRO):
            layer.zero_grad()
            _, l_aux, _ = layer(tokens(step, micro))
            l_aux.backward()
            counts = gate.global_counts.clone() if gate.global_counts is not None else gate.step_counts.clone()
            mean_l_aux, grad = l_aux.detach().clone(), gate.wg.weight.grad.clone()
            if world > 1:
                if gate.global_counts is None:  # step_counts are this rank's; update_routing sums them
                    dist.all_reduce(counts)
                for value in (mean_l_aux, grad):
                    dist.all_reduce(value)
                    value /= world
            record[-1].append({"counts": counts, "l_aux": mean_l_aux, "grad": grad})
        before = [b.clone() for b in (gate.global_counts, gate.step_counts) if b is not None]
        layer.eval()  # an evaluation pass between steps leaves the step's counts alone
        layer(tokens(step, 0))
        layer.train()
        after = [b for b in (gate.global_counts, gate.step_counts) if b is not None]
        assert all(torch.equal(b, a) for b, a in zip(before, after)), "an eval forward changed the step's counts"
        update_routing(layer)
        for buffer in (gate.global_counts, gate.step_counts):
            assert buffer is None or not buffer.any(), "update_routing starts the counts again from zero"
        record[-1].append({"bias": None if layer.expert_bias is None else layer.expert_bias.clone()})
    return record


def _count_reference(name):
    """One process, every expert, the whole global batch at once."""
    with _one_thread():
        layer = _layer(1, "packed", COUNTERS[name], expert_bias=torch.zeros(E))
        return _count_steps(layer, _global_tokens)


def _check_counts(rank, world, ep_size, layout, name, expected):
    reset_groups()
    layer = _layer(ep_size, layout, COUNTERS[name], expert_bias=torch.zeros(E))
    record = _count_steps(layer, lambda step, micro: _tokens(step, micro, rank), world)
    for step in range(STEPS):
        for micro in range(MICRO):
            got, want = record[step][micro], expected[step][micro]
            where = f"step {step} micro {micro}"
            assert torch.equal(got["counts"], want["counts"]), f"{where}: counts {got['counts']} != {want['counts']}"
            if COUNTERS[name].get("load_balancing_type") == "global_aux_loss":  # rank mean = global loss
                torch.testing.assert_close(got["l_aux"], want["l_aux"], **FP32, msg=lambda m: f"{where} l_aux: {m}")
                torch.testing.assert_close(got["grad"], want["grad"], **FP32, msg=lambda m: f"{where} gate grad: {m}")
        bias, want_bias = record[step][MICRO]["bias"], expected[step][MICRO]["bias"]
        if want_bias is not None:
            assert torch.equal(bias, want_bias), f"step {step}: expert_bias {bias} != {want_bias}"
    if expected[-1][MICRO]["bias"] is not None:
        assert expected[-1][MICRO]["bias"].any(), "the bias should have moved"


def _check_layers_and_counts(rank, world, layer_configs, count_configs, expected):
    torch.set_num_threads(1)  # see _one_thread
    _check_layers(rank, world, layer_configs)
    for ep_size, layout, name in count_configs:
        try:
            _check_counts(rank, world, ep_size, layout, name, expected[name])
        except AssertionError as error:
            raise AssertionError(f"part 2, world {world}, ep {ep_size}, {name}, {layout}: {error}") from error


@pytest.mark.slow
def test_routers_and_step_counts_equal_one_process_at_every_ep_size():
    """Parts 1 and 2 in one spawn."""
    layer_configs = [(ep, layout, name) for ep in (1, 2, 4) for name in ROUTERS
                     for layout in ("padded", "packed") + (() if name == "expert_choice" else ("dropless",))]
    layouts = ("padded", "packed", "dropless")  # counts are taken before any drop: one layout per (router, ep)
    count_configs = [(ep, layouts[(i + j) % 3], name)
                     for i, name in enumerate(COUNTERS) for j, ep in enumerate((1, 2, 4))]
    expected = {name: _count_reference(name) for name in COUNTERS}
    run_distributed(_check_layers_and_counts, WORLD, layer_configs, count_configs, expected)


# 3. The engine: a model with a bias-enabled MoE layer, trained at world 4 and in one process.

CLASSES, MICRO_BATCH, ACCUMULATION, ENGINE_STEPS, MORE_STEPS = 5, 6, 2, 3, 2
ENGINE_ROUTER = {"k": 2, "dropless": True, "scoring_func": "sigmoid", "bias_update_speed": 0.01,
                 "load_balancing_type": "global_aux_loss", "n_shared_experts": 1}


class _Net(nn.Module):
    """Linear -> ReLU -> MoE (sigmoid top-2, expert bias, global_aux_loss, a shared expert) -> Linear."""

    def __init__(self, ep_size):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(M, M)
        self.moe = MoE(M, _expert(), num_experts=E, ep_size=ep_size, min_capacity=0, expert_init="per_expert_seed",
                       seed=7, **ENGINE_ROUTER)
        self.out = nn.Linear(M, CLASSES)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h), l_aux


def _batch(step, micro, rank):
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
    return torch.randn(MICRO_BATCH, M, generator=g), torch.randint(0, CLASSES, (MICRO_BATCH,), generator=g)


def _rank_batch(rank, step, micro):
    return _batch(step, micro, rank)


def _global_batch(step, micro):
    """What one process sees: the WORLD ranks' micro-batches concatenated (dropless: no capacity to differ)."""
    xs, ys = zip(*(_batch(step, micro, r) for r in range(WORLD)))
    return torch.cat(xs), torch.cat(ys)


def _engine(ep_size, stage, micro_batch):
    reset_groups()
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": ACCUMULATION,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}}
    engine, *_ = initialize(_Net(ep_size), config=config)
    return engine


def _train(engine, batch, first_step, steps):
    """Train steps from first_step on; each micro-batch's loss, and the expert bias after each step."""
    losses, biases = [], []
    for step in range(first_step, first_step + steps):
        for micro in range(ACCUMULATION):
            x, y = batch(step, micro)
            logits, l_aux = engine(x)
            # global_aux_loss: the ranks' mean l_aux is the global batch's, as the mean cross-entropy is
            loss = F.cross_entropy(logits, y) + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        biases.append(engine.module.moe.expert_bias.clone())
    return torch.stack(losses), torch.stack(biases)


def _engine_reference():
    """One process, every expert, the global micro-batches: losses, biases per step, final state."""
    with _one_thread():
        engine = _engine(1, 0, WORLD * MICRO_BATCH)
        losses, biases = _train(engine, _global_batch, 0, ENGINE_STEPS + MORE_STEPS)
        assert biases[-1].any() and not torch.equal(biases[0], biases[-1]), "the bias should move"
        return {"losses": losses, "biases": biases, "state": engine.consolidated_state_dict()}


def _check_rank_mean(losses, expected, world, what):
    mean = losses.clone()
    dist.all_reduce(mean)
    torch.testing.assert_close(mean / world, expected, **FP32, msg=lambda m: f"{what}: {m}")


def _check_same_everywhere(bias, expected, what):
    gathered = [torch.empty_like(bias) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, bias)
    for r, other in enumerate(gathered):
        assert torch.equal(other, expected), f"{what}: rank {r} has expert_bias {other}, expected {expected}"


def _check_engine(rank, world, stage, expected, folder):
    engine = _engine(2, stage, MICRO_BATCH)
    batch = functools.partial(_rank_batch, rank)
    losses, biases = _train(engine, batch, 0, ENGINE_STEPS)
    _check_rank_mean(losses, expected["losses"][: ENGINE_STEPS * ACCUMULATION], world, "losses")
    for step, bias in enumerate(biases):
        _check_same_everywhere(bias, expected["biases"][step], f"after step {step}")
    if folder is None:
        return
    # 4. Resume at world 4: save, go on; a fresh engine loads and goes on the same way.
    engine.save_checkpoint(folder, tag=f"stage{stage}")
    saved = engine.module.moe.expert_bias.clone()
    straight, straight_biases = _train(engine, batch, ENGINE_STEPS, MORE_STEPS)
    _check_rank_mean(straight, expected["losses"][ENGINE_STEPS * ACCUMULATION :], world, "losses after saving")
    _check_same_everywhere(straight_biases[-1], expected["biases"][-1], "after all steps")
    state = engine.consolidated_state_dict()
    if rank == 0:
        for name, value in expected["state"].items():
            torch.testing.assert_close(state[name], value, **FP32, msg=lambda m: f"{name}: {m}")
    fresh = _engine(2, stage, MICRO_BATCH)
    assert not fresh.module.moe.expert_bias.any()
    fresh.load_checkpoint(folder, tag=f"stage{stage}")
    assert torch.equal(fresh.module.moe.expert_bias, saved), "load_checkpoint restores the expert bias"
    resumed, resumed_biases = _train(fresh, batch, ENGINE_STEPS, MORE_STEPS)
    assert torch.equal(resumed, straight), f"losses after resuming {resumed} != {straight}"
    assert torch.equal(resumed_biases, straight_biases), "the bias after resuming differs"
    resumed_state = fresh.consolidated_state_dict()
    if rank == 0:
        for name, value in state.items():
            assert torch.equal(resumed_state[name], value), f"{name} differs after resuming"


def _check_engines(rank, world, stages, expected, folder):
    torch.set_num_threads(1)  # see _one_thread
    for stage in stages:
        try:
            _check_engine(rank, world, stage, expected, os.path.join(folder, f"stage{stage}") if stage else None)
        except AssertionError as error:
            raise AssertionError(f"part 3, world {world}, ep 2, stage {stage}: {error}") from error


@pytest.mark.slow
def test_engine_keeps_one_expert_bias_equal_to_one_process_and_resumes_it(tmp_path):
    """Parts 3 and 4 (world 4) in one spawn: stages 0, 2 and 3; stages 2 and 3 also save and resume."""
    run_distributed(_check_engines, WORLD, (0, 2, 3), _engine_reference(), str(tmp_path), timeout_s=300)


def test_expert_bias_is_saved_and_resumed_in_one_process(tmp_path):
    """Part 4 in one process: 3 steps, save, 2 more; a fresh engine loads and repeats them bitwise."""
    with _one_thread():
        engine = _engine(1, 0, WORLD * MICRO_BATCH)
        _train(engine, _global_batch, 0, ENGINE_STEPS)
        engine.save_checkpoint(str(tmp_path), tag="step3")
        saved = engine.module.moe.expert_bias.clone()
        assert saved.any(), "the bias should have moved before saving"
        straight, straight_biases = _train(engine, _global_batch, ENGINE_STEPS, MORE_STEPS)
        fresh = _engine(1, 0, WORLD * MICRO_BATCH)
        assert not fresh.module.moe.expert_bias.any()
        fresh.load_checkpoint(str(tmp_path))
        assert torch.equal(fresh.module.moe.expert_bias, saved), "load_checkpoint restores the expert bias"
        resumed, resumed_biases = _train(fresh, _global_batch, ENGINE_STEPS, MORE_STEPS)
    assert torch.equal(resumed, straight), f"losses after resuming {resumed} != {straight}"
    assert torch.equal(resumed_biases, straight_biases), f"bias after resuming {resumed_biases} != {straight_biases}"
