"""torch.compile of the MoE layer: compiled equals eager, and the graph breaks are the budgeted ones.

The padded layout has no host read, so it compiles whole (fullgraph=True) with Inductor, forward and
backward. The packed and grouped layouts read the kept counts on the host once per layer (slice
sizes): with `torch._dynamo.config.capture_scalar_outputs = True` that read becomes symbolic sizes and
they compile whole too (fullgraph); otherwise it is their one graph break per layer (counted with
`nested_graph_breaks`; by default dynamo also breaks each enclosing frame at the call). They are
compiled with the aot_eager backend (traced forward and backward, no code generation), because Inductor's C++ compilation is slow
on a small CPU. Training mode throughout; random token selection and second-expert sampling stay on,
with the same seed for both runs and Inductor's `fallback_random` so that it draws eager's numbers.
Tolerance fp32 1e-5: Inductor may fuse and reorder sums (the gate's softmax and mean, the bias
gradients), which moves results by a few ulps.
"""

from unittest import mock

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch import nn

from moe import MoE, SwiGLU

FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _stack(expert_layout: str, gated: bool = False) -> nn.ModuleList:
    """A top-1 and a top-2 layer, both dropping (capacity factor 0.75): two MoE layers per compiled call;
    plain MLP experts, or stacked gated ones (SwiGLU)."""
    torch.manual_seed(0)
    expert = SwiGLU(8, 12) if gated else nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8))
    return nn.ModuleList([MoE(8, expert, num_experts=4, k=k, capacity_factor=0.75, min_capacity=0,
                              expert_layout=expert_layout) for k in (1, 2)])


def _step(layers: nn.ModuleList, x: torch.Tensor):
    """Forward through both layers, a loss with l_aux, backward; returns what is compared."""
    h, l_aux_total = x, 0.0
    for layer in layers:
        out, l_aux, _ = layer(h)
        h, l_aux_total = h + out, l_aux_total + l_aux
    return h, l_aux_total


def _run(layers: nn.ModuleList, step, x_SM: torch.Tensor):
    torch.manual_seed(1)  # the gates' random token selection and second-expert sampling
    x = x_SM.clone().requires_grad_()
    out, l_aux = step(layers, x)
    (out.square().sum() + l_aux).backward()
    grads = {name: p.grad.clone() for name, p in layers.named_parameters()}
    counts = [layer.deepspeed_moe.exp_counts.clone() for layer in layers]
    return out.detach(), l_aux.detach(), x.grad, grads, counts


def _assert_same(compiled, eager) -> None:
    out, l_aux, x_grad, grads, counts = compiled
    torch.testing.assert_close(out, eager[0], **FP32)
    torch.testing.assert_close(l_aux, eager[1], **FP32)
    torch.testing.assert_close(x_grad, eager[2], **FP32)
    assert grads.keys() == eager[3].keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager[3][name], **FP32, msg=lambda m, name=name: f"{name}: {m}")
    for got, want in zip(counts, eager[4]):
        assert torch.equal(got, want)


def _compare(expert_layout: str, backend, fullgraph: bool | None = None, gated: bool = False):
    x_SM = torch.randn(24, 8, generator=torch.Generator().manual_seed(2))
    eager = _run(_stack(expert_layout, gated), _step, x_SM)
    layers = _stack(expert_layout, gated)
    assert bool((layers[0].deepspeed_moe.gate(x_SM).expert_idx_SK < 0).any()), "the test should drop choices"
    torch._dynamo.reset()
    fullgraph = expert_layout == "padded" if fullgraph is None else fullgraph
    compiled = torch.compile(_step, backend=backend, fullgraph=fullgraph)
    return _run(layers, compiled, x_SM), eager


@pytest.mark.slow
@mock.patch.object(torch._inductor.config, "fallback_random", True)
def test_padded_fullgraph_inductor_matches_eager():
    compiled, eager = _compare("padded", "inductor")
    _assert_same(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("expert_layout", ["packed", "grouped"])
@mock.patch.object(torch._dynamo.config, "nested_graph_breaks", True)
def test_packed_and_grouped_break_once_per_layer(expert_layout):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    torch._dynamo.utils.counters.clear()
    compiled, eager = _compare(expert_layout, counting)
    _assert_same(compiled, eager)
    # two layers, each reading its kept counts on the host once: two breaks, three graphs, and at most
    # one recompile (both layers resume in the same code after their break, with other counts)
    breaks = torch._dynamo.utils.counters["graph_break"]
    assert sum(breaks.values()) == 2 and all("_local_scalar_dense" in reason for reason in breaks), dict(breaks)
    assert 3 <= len(graphs) <= 4


@pytest.mark.slow
@pytest.mark.parametrize("expert_layout", ["packed", "grouped"])
@mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True)
def test_packed_and_grouped_compile_whole_with_symbolic_counts(expert_layout):
    """With capture_scalar_outputs the host read becomes symbolic sizes: no break at all (fullgraph)."""
    compiled, eager = _compare(expert_layout, "aot_eager", fullgraph=True)
    _assert_same(compiled, eager)


@pytest.mark.slow
@pytest.mark.parametrize("expert_layout", ["packed", "grouped", "padded"])
@mock.patch.object(torch._dynamo.config, "capture_scalar_outputs", True)
def test_stacked_gated_experts_compile_whole(expert_layout):
    compiled, eager = _compare(expert_layout, "aot_eager", fullgraph=True, gated=True)
    assert "deepspeed_moe.experts.weight1" in dict(_stack(expert_layout, gated=True)[0].named_parameters())
    _assert_same(compiled, eager)
