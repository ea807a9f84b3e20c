"""optim.graphs: the whole training step as a CUDA graph.

On a GPU (marked `gpu`, run by `python -m pytest -m gpu` and `recipes.gpu_report`): the GPT recipe's
model trained 20 steps with the step graphed equals the same training eager (losses to 1e-6, weights
to 1e-6), for the layouts a graph holds, in fp32, bf16 and fp16. Everywhere: what cannot be captured is
refused before any step, naming why. The preconditions (no host read in a whole step, the same
allocations whatever the routing) are proved on the CUDA code path without a GPU in
tests/simulated/test_capturable_step.py.
"""

import pytest
import torch

from moe import split_params_into_different_moe_groups_for_optimizer
from optim import initialize
from optim.graphs import GraphedStep
from recipes import gpt
from recipes.common.cli import engine_config
from recipes.gpt_model import GPT

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _engine(layout="padded", dtype="fp32", **kwargs):
    torch.manual_seed(0)
    cfg = gpt.TrainConfig(n_layer=2, n_head=2, n_embd=64, ffn=128, seq_len=32, batch_size=8, num_experts=8, top_k=2,
                          dtype=dtype, expert_layout=layout, warmup_steps=5, log_dir="", **kwargs)
    model = GPT(gpt.model_config(cfg))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = initialize(model, model_parameters=groups, config=engine_config(gpt.engine_fragments(cfg), set(), ""))
    return engine, cfg


def _batches(cfg, steps):
    generator = torch.Generator().manual_seed(1)
    tokens = [torch.randint(256, (cfg.batch_size, cfg.seq_len + 1), generator=generator) for _ in range(steps)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("layout, dtype", [("padded", "fp32"), ("padded", "bf16"), ("padded", "fp16"),
                                           ("grouped", "bf16")])
def test_the_graphed_step_equals_the_eager_step(monkeypatch, layout, dtype):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the tests' default is the CPU (tests/conftest.py)
    eager, cfg = _engine(layout, dtype)
    graphed, _ = _engine(layout, dtype)
    assert eager.device.type == "cuda"
    step = GraphedStep(graphed, lambda x, y: gpt.train_step(graphed, cfg, x, y), warmup=3, report_every=5)
    losses = {"eager": [], "graphed": []}
    torch.manual_seed(2)  # the router samples its second choice
    for x, y in _batches(cfg, 20):
        losses["eager"].append(gpt.train_step(eager, cfg, x, y).clone())
    torch.manual_seed(2)
    for x, y in _batches(cfg, 20):
        losses["graphed"].append(step(x, y).clone())
    torch.testing.assert_close(torch.stack(losses["graphed"]), torch.stack(losses["eager"]), rtol=0, atol=1e-6)
    for a, b in zip(eager.module.parameters(), graphed.module.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)
    assert graphed.global_steps == eager.global_steps == 20 and graphed.get_lr() == eager.get_lr()
    assert graphed.loss_scale == eager.loss_scale


def test_a_step_that_cannot_be_captured_is_refused_with_its_reasons():
    engine, cfg = _engine(gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph: CUDA graphs need a CUDA device; "
                                         "the model is on cpu"):
        GraphedStep(engine, lambda x, y: gpt.train_step(engine, cfg, x, y))
    with pytest.raises(ValueError, match="warmup must be at least 1 eager step, got 0"):
        GraphedStep(engine, lambda x, y: None, warmup=0)
    assert engine.capturable is None  # refused before anything changed
