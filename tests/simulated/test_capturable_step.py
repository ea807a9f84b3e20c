"""A whole capturable training step (optim.capturable) on the CUDA code path: what a CUDA graph needs.

On meta tensors in the simulated world (tests/simulated/world.py): the GPT recipe's step (forward,
backward, the engine's reduction, clipping, the optimizer, the loss scaler, the routers and the
TensorBoard statistics) at world 8 (ep 1, 2, 8) over ZeRO stages 0-2 and fp32, bf16 and fp16 reads
nothing on the host, for the layouts a graph can hold; the statistics and skip counters are read
when the report asks, once for all queued steps. `graph_problems` names every layout and setting a
graph cannot hold.

On the CPU with the Triton kernels (the branches a GPU takes, interpreted): two steps with different
routings allocate the same tensors, op by op (shapes, dtypes), and make no host sync.
"""

from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.graphs import GraphedStep, graph_problems
from recipes import gpt
from recipes.common.cli import engine_config
from recipes.gpt_model import GPT
from tests.simulated.sync_counter import count_syncs
from tests.simulated.world import META, simulated_world


def _config(ep=1, stage=0, dtype="fp32", layout="padded", **kwargs):
    return gpt.TrainConfig(n_layer=2, n_head=2, n_embd=32, ffn=64, seq_len=16, batch_size=2, num_experts=8, top_k=2,
                           ep_world_size=ep, stage=stage, dtype=dtype, steps=10, expert_layout=layout, **kwargs)


def _engine(cfg, device=META):
    with torch.device(device):
        model = GPT(gpt.model_config(cfg))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = initialize(model, model_parameters=groups, config=engine_config(gpt.engine_fragments(cfg), set(), ""))
    return engine


def _batch(cfg, generator=None):
    tokens = torch.randint(256, (cfg.batch_size, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.slow
@pytest.mark.parametrize("ep, layout", [(1, "padded"), (2, "padded"), (8, "padded"), (1, "grouped")])
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_a_whole_capturable_step_reads_nothing_on_the_host(monkeypatch, ep, layout, stage, dtype):
    cfg = _config(ep, stage, dtype, layout)
    with simulated_world(monkeypatch, 8, rank=3) as log:
        engine = _engine(cfg)
        with mock.patch.object(engine, "device", torch.device("cuda")):  # what graph_problems sees on a GPU
            assert graph_problems(engine) == []
        engine.set_capturable(report_every=100)
        assert engine._report.stats is not None  # the recipe turns TensorBoard on
        batches = [[t.to(META) for t in _batch(cfg)] for _ in range(4)]  # as a graph's own input tensors
        # the first step is eager, as GraphedStep's warm-up steps are: one-time trials and caches run there
        gpt.train_step(engine, cfg, *batches.pop())
        assert log.reads.reads == []
        with _HostCopies() as copies:
            for batch in batches:
                loss = gpt.train_step(engine, cfg, *batch)
        assert loss.device == META and engine.global_steps == 4
        assert log.reads.reads == []  # no overflow flag, no statistics, no counts
        assert copies.copies == []  # a graph would replay a copy from host memory that is gone
        if ep > 1:  # dispatch and combine, forward and backward, in each MoE layer
            assert log.count("all_to_all_single") == 4 * 4 * (cfg.n_layer // cfg.moe_every)
        engine.flush_report()  # the report's read: the skip counters, then the four steps' statistics at once
        assert log.reads.reads == ["skips", "statistics"]


def test_graph_problems_name_each_layout_and_setting_a_graph_cannot_hold(monkeypatch):
    with simulated_world(monkeypatch, 8, rank=0):
        for layout, kwargs, ep, expected in [
                ("packed", {}, 1, "the packed layout reads its row counts on the host"),
                ("grouped", {}, 2, "the grouped layout under expert parallelism reads its row counts"),
                ("grouped", {"exchange": "per_rank"}, 2, "reads its row counts"),
                ("auto", {"dropless": True}, 1, None),  # grouped without dropping, one process: capturable
                ("padded", {}, 8, None)]:
            engine = _engine(_config(ep, layout=layout, **kwargs))
            problems = graph_problems(engine)
            assert problems[0] == "CUDA graphs need a CUDA device; the model is on meta"
            layers = [p for p in problems[1:] if p.startswith("MoE layer")]
            if expected is None:
                assert problems[1:] == []
            else:
                assert len(layers) == 1 and expected in layers[0] and "blocks.1.ffn.deepspeed_moe" in layers[0]
        engine = _engine(_config(stage=3, gradient_accumulation_steps=2))
        problems = " ".join(graph_problems(engine))
        assert "ZeRO stage 3" in problems and "gradient_accumulation_steps is 2" in problems
        with pytest.raises(ValueError, match="cannot be captured as a CUDA graph: CUDA graphs need a CUDA device"):
            GraphedStep(engine, lambda x, y: None)


class _HostCopies(TorchDispatchMode):
    """Copies from host memory to the device: ops taking a CPU tensor (but a 0-dim one, passed as a
    kernel argument) that return a device tensor, and torch.tensor / as_tensor made on the device."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __enter__(self):
        self._made = (torch.tensor, torch.as_tensor)
        for name, make in zip(("tensor", "as_tensor"), self._made):
            setattr(torch, name, self._recording(name, make))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.tensor, torch.as_tensor = self._made
        return super().__exit__(*exc)

    def _recording(self, name, make):
        def made(*args, **kwargs):
            out = make(*args, **kwargs)
            if out.device.type != "cpu":
                self.copies.append(f"torch.{name} on {out.device}")
            return out

        return made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outputs = out if isinstance(out, (list, tuple)) else [out]
        if any(a.device.type == "cpu" and (a.dim() or "copy" in str(func)) for a in inputs) and \
                any(isinstance(o, torch.Tensor) and o.device.type != "cpu" for o in outputs):
            self.copies.append(str(func))
        return out


class _Allocations(TorchDispatchMode):
    """Every op's name and the shapes and dtypes of the tensors it returns."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (list, tuple)) else [out]
        self.ops.append((str(func), [(tuple(t.shape), t.dtype) for t in outputs if isinstance(t, torch.Tensor)]))
        return out


def _two_steps(monkeypatch, layout, dtype):
    """Each op's outputs in two steps after the first, the first MoE layer's expert counts, the host syncs."""
    monkeypatch.setenv("MOE_KERNELS", "triton")  # the kernels a GPU runs, interpreted on these CPU tensors
    torch.manual_seed(0)
    cfg = _config(layout=layout, dtype=dtype, log_dir="")
    engine = _engine(cfg, device="cpu")
    engine.set_capturable(report_every=100)
    generator = torch.Generator().manual_seed(0)
    gpt.train_step(engine, cfg, *_batch(cfg, generator))  # the optimizer's state is made in the first step
    layer = engine.module.blocks[1].ffn  # the MoE module, whose routing_stats are the last forward's
    steps, counts, synced = [], [], []
    for _ in range(2):
        batch = _batch(cfg, generator)
        with count_syncs() as syncs, _Allocations() as allocations:
            gpt.train_step(engine, cfg, *batch)
        steps.append(allocations.ops)
        counts.append(layer.routing_stats["exp_counts"].tolist())
        synced += syncs.syncs
    return steps, counts, synced


@pytest.mark.slow
@pytest.mark.parametrize("layout, dtype", [("padded", "fp16"), ("grouped", "bf16")])
def test_two_steps_with_different_routings_allocate_the_same_tensors(monkeypatch, layout, dtype):
    steps, counts, syncs = _two_steps(monkeypatch, layout, dtype)
    assert counts[0] != counts[1]  # the routing differs
    assert len(steps[0]) > 100 and steps[0] == steps[1]
    assert syncs == []


@pytest.mark.slow
def test_the_packed_layout_allocates_by_the_routing(monkeypatch):
    """What the comparison above catches: packed rows are sized by the counts, read on the host."""
    steps, counts, syncs = _two_steps(monkeypatch, "packed", "fp32")
    assert counts[0] != counts[1] and steps[0] != steps[1] and syncs
