"""recipes.common.frameworks: the four layers of a size share their weights, each library's output is
compared with ours, and a layer that is missing or fails is a row with the reason while the others
are timed. torchtitan and DeepSpeed are stood in for by layers made here (neither is a dependency)."""

import copy

import pytest
import torch
from torch import nn

from recipes.common import frameworks
from recipes.common.frameworks import LayerSize, compare

SIZE = LayerSize(name="small", hidden=16, ffn=24, experts=4, k=2, tokens=32)
CPU = torch.device("cpu")


class Scaled(nn.Module):
    """A copy of one of our layers whose output is multiplied by `scale`."""

    def __init__(self, layer: nn.Module, scale: float):
        super().__init__()
        self.layer, self.scale = copy.deepcopy(layer), scale

    def forward(self, x):
        out, l_aux, counts = self.layer(x)
        return out * self.scale, l_aux, counts


class OutOfMemory(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB\nmore text")


@pytest.fixture
def stand_ins(monkeypatch):
    """torchtitan's layer: a copy of ours; DeepSpeed's: a copy of ours with its output 10% larger."""
    monkeypatch.setattr(frameworks, "torchtitan_layer", lambda mine, size: Scaled(mine, 1.0))
    closed = []
    monkeypatch.setattr(frameworks, "open_deepspeed", lambda: True)
    monkeypatch.setattr(frameworks, "close_deepspeed", closed.append)
    monkeypatch.setattr(frameworks, "deepspeed_layer", lambda mine, size: Scaled(mine, 1.1))
    return closed


def test_our_two_layers_hold_the_same_seeded_experts_and_an_fp32_gate():
    dropless = frameworks.ours(SIZE, CPU, torch.bfloat16, dropless=True)
    capacity = frameworks.ours(SIZE, CPU, torch.bfloat16, dropless=False)
    assert dropless.deepspeed_moe.gate.wg.weight.dtype == torch.float32
    experts = frameworks._expert_tensors(dropless)
    assert dropless.deepspeed_moe.experts.gated  # SwiGLU experts held stacked
    assert experts[0]["up_proj.weight"].dtype == torch.bfloat16 and experts[0]["up_proj.weight"].shape == (24, 16)
    assert not torch.equal(experts[0]["up_proj.weight"], experts[1]["up_proj.weight"])  # seeded apart, not copies
    for (name, mine), theirs in zip(dropless.named_parameters(), capacity.parameters()):
        assert torch.equal(mine, theirs), name


@pytest.mark.slow
def test_each_library_row_says_whether_its_output_agrees_with_ours(stand_ins):
    rows = {row["layer"]: row for row in compare(SIZE, CPU, torch.float32, steps=1, warmup=0)}
    assert list(rows) == list(frameworks.ORDER)
    for row in rows.values():
        assert row["status"] == "ran" and row["ms"] > 0 and row["step_peak_mib"] > 0, row
        assert row["tokens_per_s"] == pytest.approx(SIZE.tokens / row["ms"] * 1e3)
        assert (row["size"], row["experts"], row["k"], row["dtype"]) == ("small", 4, 2, "float32")
    titan, deepspeed = rows["torchtitan (dropless)"], rows["deepspeed (capacity)"]
    assert titan["max_abs_diff"] == titan["rel_diff"] == 0 and titan["agrees"] is True
    assert deepspeed["max_abs_diff"] > 0 and deepspeed["rel_diff"] == pytest.approx(0.1, rel=1e-4)
    assert deepspeed["agrees"] is False
    assert "agrees" not in rows["ours (dropless)"] and "agrees" not in rows["ours (capacity)"]
    assert stand_ins == [True]  # the group open_deepspeed made is closed again


@pytest.mark.slow
def test_a_layer_that_fails_is_a_row_with_its_error_and_the_others_are_timed(stand_ins, monkeypatch):
    monkeypatch.setattr(frameworks, "torchtitan_layer", lambda mine, size: OutOfMemory())
    rows = {row["layer"]: row for row in compare(SIZE, CPU, torch.float32, steps=1, warmup=0)}
    assert rows["torchtitan (dropless)"]["status"] == "failed"
    assert rows["torchtitan (dropless)"]["reason"] == "RuntimeError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert "agrees" not in rows["torchtitan (dropless)"] and rows["torchtitan (dropless)"]["ms"] is None
    assert all(rows[name]["status"] == "ran" for name in ("ours (dropless)", "ours (capacity)", "deepspeed (capacity)"))


@pytest.mark.slow
def test_a_library_that_is_not_importable_is_not_run(monkeypatch):
    def missing(*args):
        raise ImportError("No module named 'torchtitan'")

    monkeypatch.setattr(frameworks, "torchtitan_layer", missing)
    monkeypatch.setattr(frameworks, "open_deepspeed", missing)
    rows = {row["layer"]: row for row in compare(SIZE, CPU, torch.float32, steps=1, warmup=0)}
    for name, library in (("torchtitan (dropless)", "torchtitan"), ("deepspeed (capacity)", "deepspeed")):
        assert rows[name]["status"] == "not run" and rows[name]["ms"] is None
        assert rows[name]["reason"] == f"{library} is not importable here (No module named 'torchtitan')"
    assert rows["ours (dropless)"]["status"] == rows["ours (capacity)"]["status"] == "ran"
