"""The MoE layer: DeepSpeed's contract, equality of the expert layouts, gradients, modes and errors.

Every fast path is compared with a plain per-token reference: out[s] = sum_j weight[s, j] *
expert_{e(s, j)}(x[s]) over kept choices. Tolerances: fp32 1e-5 relative (1e-6 absolute). The experts'
stacked and module forms are compared in test_experts.py, the optimizer groups of the layer's
parameters in tests/parallel/test_param_groups.py.
"""

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moe import MoE
from tests.devices import DEVICE

FP32 = {"rtol": 1e-5, "atol": 1e-6}


def _mlp(m=8, h=12, act=nn.GELU, bias=True):
    return nn.Sequential(nn.Linear(m, h, bias=bias), act(), nn.Linear(h, m, bias=bias))


def _reference(layer: MoE, x_SM: torch.Tensor) -> torch.Tensor:
    """Per-token sum over the kept choices of the last routing, running each expert as a module."""
    routing = layer.deepspeed_moe.routing
    experts = layer.deepspeed_moe.experts
    out = torch.zeros_like(x_SM)
    for s in range(x_SM.shape[0]):
        for j in range(routing.expert_idx_SK.shape[1]):
            e = int(routing.expert_idx_SK[s, j])
            if e < 0:
                continue
            if experts.stacked:
                h = nn.functional.linear(x_SM[s], experts.weight1[e], experts.bias1[e])
                y = nn.functional.linear(nn.functional.gelu(h), experts.weight2[e], experts.bias2[e])
            else:
                y = experts.deepspeed_experts[e](x_SM[s : s + 1])[0]
            out[s] += routing.weight_SK[s, j] * y
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_output_matches_per_token_reference(k):
    torch.manual_seed(0)
    layer = MoE(8, _mlp(), num_experts=4, k=k, capacity_factor=0.75, min_capacity=0)
    x = torch.randn(2, 12, 8)
    out, l_aux, exp_counts = layer(x)
    assert out.shape == x.shape and l_aux.dim() == 0 and exp_counts.shape == (4,)
    assert int(exp_counts.sum()) == 24 * k
    assert bool((layer.deepspeed_moe.routing.expert_idx_SK < 0).any()), "the test should include dropped choices"
    torch.testing.assert_close(out.reshape(-1, 8), _reference(layer, x.reshape(-1, 8)), **FP32)


def test_dropped_tokens_get_zeros():
    torch.manual_seed(1)
    layer = MoE(8, _mlp(), num_experts=2, k=1, capacity_factor=0.25, min_capacity=0, use_rts=False)
    x = torch.randn(16, 8)
    out, _, _ = layer(x)
    dropped = ~layer.deepspeed_moe.routing.kept_SK[:, 0]
    assert dropped.any() and bool((out[dropped] == 0).all())


def test_gradcheck_float64_through_gate_and_experts():
    torch.manual_seed(4)
    layer = MoE(4, _mlp(4, 6), num_experts=3, k=2, capacity_factor=1.0, min_capacity=0,
                top2_2nd_expert_sampling=False).double()
    names = [name for name, _ in layer.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)

    def f(x, *params):
        out, l_aux, _ = torch.func.functional_call(layer, dict(zip(names, params)), (x,))
        return out, l_aux

    assert torch.autograd.gradcheck(f, (x, *params))
    assert "deepspeed_moe.gate.wg.weight" in names


def test_eval_uses_eval_capacity_and_is_deterministic():
    torch.manual_seed(5)
    layer = MoE(8, _mlp(), num_experts=4, k=2, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0,
                noisy_gate_policy="Jitter")
    x = torch.randn(40, 8)
    layer(x)
    assert layer.deepspeed_moe.routing.capacity == 10
    first, second = layer(x)[0], layer(x)[0]
    assert not torch.equal(first, second), "training adds noise (Jitter and second-expert sampling)"
    layer.eval()
    first, second = layer(x)[0], layer(x)[0]
    assert layer.deepspeed_moe.routing.capacity == 40
    assert torch.equal(first, second)


def test_used_token_masks_tokens():
    torch.manual_seed(6)
    layer = MoE(8, _mlp(), num_experts=2, k=1, min_capacity=0)
    x = torch.randn(2, 5, 8)
    used = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 1]])
    out, _, exp_counts = layer(x, used_token=used)
    assert bool((out[used == 0] == 0).all()) and bool((out[used == 1] != 0).any())
    assert int(exp_counts.sum()) == int(used.sum())


def test_residual_moe_mixes_with_the_dense_mlp():
    torch.manual_seed(7)
    expert = _mlp()
    layer = MoE(8, expert, num_experts=2, k=1, use_residual=True, min_capacity=0, capacity_factor=2.0)
    x = torch.randn(10, 8)
    out, _, _ = layer(x)
    moe_out = layer.deepspeed_moe(x)
    coef = torch.softmax(layer.coefficient(x), dim=-1)
    torch.testing.assert_close(out, moe_out * coef[:, :1] + expert(x) * coef[:, 1:], **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_layer_matches_fp32_within_half_tolerance(dtype):
    torch.manual_seed(8)
    kwargs = dict(num_experts=2, k=2, min_capacity=0, capacity_factor=2.0, top2_2nd_expert_sampling=False)
    layer = MoE(8, _mlp(), **kwargs)
    half = copy.deepcopy(layer).to(dtype)
    x = torch.randn(16, 8)
    x_half = x.to(dtype).requires_grad_()
    out, l_aux, _ = half(x_half)
    assert out.dtype == dtype and l_aux.dtype == torch.float32
    expected, _, _ = layer(x_half.detach().float())
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    out.float().sum().backward()
    assert x_half.grad is not None and half.deepspeed_moe.experts.weight1.grad.dtype == dtype


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("compute", ["packed", "padded"])
def test_no_tensor_of_size_s_e_c_in_forward_or_backward(compute):
    torch.manual_seed(10)
    S, M, E = 256, 8, 16
    layer = MoE(M, _mlp(M, 16), num_experts=E, k=2, capacity_factor=1.25, expert_layout=compute)
    x = torch.randn(S, M, requires_grad=True)
    with _LargestTensor() as mode:
        out, l_aux, _ = layer(x)
        (out.sum() + l_aux).backward()
    capacity = layer.deepspeed_moe.routing.capacity
    assert mode.largest < S * E * capacity // 8, f"largest tensor {mode.largest} vs S*E*C {S * E * capacity}"


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_experts=6, ep_size=4), ValueError, r"num_experts \(6\) must be divisible by ep_size \(4\)"),
        (dict(num_experts=2, k=3), ValueError, r"k \(3\) must be between 1 and num_experts \(2\)"),
        (dict(num_experts=2, noisy_gate_policy="Uniform"), ValueError, "noisy_gate_policy"),
        (dict(num_experts=2, capacity_factor=-1.0), ValueError, "capacity_factor must be a number > 0"),
        (dict(num_experts=2, expert_layout="dense"), ValueError, "expert_layout"),
        (dict(num_experts=2, ep_size=0), ValueError, "ep_size must be an int >= 1"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        MoE(8, _mlp(), **kwargs)


def test_bad_input_shape_names_hidden_size():
    layer = MoE(8, _mlp(), num_experts=2)
    with pytest.raises(ValueError, match=r"hidden_states must have shape \[\.\.\., 8\], got \[4, 6\]"):
        layer(torch.randn(4, 6))
    with pytest.raises(ValueError, match="used_token must have 4 elements"):
        layer(torch.randn(4, 8), used_token=torch.ones(3))
    with pytest.raises(TypeError, match="hidden_states must be a floating-point tensor, got torch.int64"):
        layer(torch.ones(4, 8, dtype=torch.int64))


def test_an_expert_of_another_width_than_hidden_size_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"the expert's first Linear takes 16 features; it must take hidden_size \(32"):
        MoE(32, _mlp(16, 12), num_experts=2)
    wrong_out = nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 6))
    with pytest.raises(ValueError, match=r"the expert's last Linear gives 6 features; it must give hidden_size \(8\)"):
        MoE(8, wrong_out, num_experts=2)
    MoE(8, nn.Sequential(nn.Linear(8, 12), nn.GELU(), nn.Linear(12, 8), nn.Identity()), num_experts=2)  # fits


class _SwiGLU(nn.Sequential):
    """LLaMA's feed-forward, w2(silu(w1 x) * w3 x), held in a Sequential of its own forward (last: w3, M -> H)."""

    def __init__(self, m: int, h: int):
        super().__init__(nn.Linear(m, h), nn.Linear(h, m), nn.Linear(m, h))

    def forward(self, x):
        w1, w2, w3 = self
        return w2(torch.nn.functional.silu(w1(x)) * w3(x))


@pytest.mark.parametrize("expert", [_SwiGLU(8, 16), nn.Sequential(nn.LazyLinear(16), nn.GELU(), nn.Linear(16, 8))],
                         ids=["sequential-subclass", "lazy-linear"])
def test_experts_whose_widths_the_layer_cannot_read_off_are_taken(expert):
    torch.manual_seed(12)
    layer = MoE(8, expert, num_experts=2, k=1, min_capacity=0)
    x = torch.randn(6, 8, requires_grad=True)
    out, l_aux, _ = layer(x)
    (out.sum() + l_aux).backward()
    assert out.shape == (6, 8) and x.grad is not None


def test_deepcopy_per_expert_keeps_the_callers_module():
    expert = _mlp()
    before = copy.deepcopy(expert.state_dict())
    layer = MoE(8, expert, num_experts=2, use_residual=True)
    assert layer.mlp is expert
    assert all(torch.equal(before[k], v) for k, v in expert.state_dict().items())


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_equals_capacity_path_that_drops_nothing(k):
    torch.manual_seed(11)
    expert = _mlp()
    kwargs = dict(num_experts=4, k=k, min_capacity=0, top2_2nd_expert_sampling=False, use_rts=False)
    roomy = MoE(8, expert, capacity_factor=8.0, expert_layout="padded", **kwargs)
    dropless = MoE(8, expert, capacity_factor=0.1, dropless=True, **kwargs)
    dropless.load_state_dict(roomy.state_dict())
    x = torch.randn(40, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, l_aux, counts = roomy(x)
    out2, l_aux2, counts2 = dropless(x2)
    assert bool(dropless.deepspeed_moe.routing.kept_SK.all()) and bool(roomy.deepspeed_moe.routing.kept_SK.all())
    torch.testing.assert_close(out, out2, **FP32)
    torch.testing.assert_close(l_aux, l_aux2, **FP32)
    assert torch.equal(counts, counts2)
    (out.sum() + l_aux).backward()
    (out2.sum() + l_aux2).backward()
    torch.testing.assert_close(x.grad, x2.grad, **FP32)
    for p, p2 in zip(roomy.parameters(), dropless.parameters()):
        torch.testing.assert_close(p.grad, p2.grad, **FP32)


def test_dropless_never_drops_even_with_skewed_routing():
    torch.manual_seed(12)
    layer = MoE(8, _mlp(), num_experts=4, k=2, capacity_factor=0.01, dropless=True)
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight[0].fill_(5.0)  # almost every token's first choice is expert 0
    x = torch.rand(64, 8)
    out, _, counts = layer(x)
    assert bool(layer.deepspeed_moe.routing.kept_SK.all()) and int(counts.sum()) == 128
    torch.testing.assert_close(out, _reference(layer, x), **FP32)
    with pytest.raises(ValueError, match="dropless=True"):
        MoE(8, _mlp(), num_experts=4, dropless=True, expert_layout="padded")


@pytest.mark.parametrize("compute", ["packed", "padded"])
def test_layer_on_triton_kernels_equals_torch_path(compute, monkeypatch):
    torch.manual_seed(13)
    layer = MoE(8, _mlp(8, 12), num_experts=4, k=2, capacity_factor=0.75, min_capacity=0,
                top2_2nd_expert_sampling=False, expert_layout=compute).to(DEVICE)
    x = torch.randn(20, 8, device=DEVICE)
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MOE_KERNELS", backend)
        layer.zero_grad()
        xb = x.clone().requires_grad_()
        out, l_aux, _ = layer(xb)
        (out.square().sum() + l_aux).backward()
        results.append((out.detach(), xb.grad, [p.grad.clone() for p in layer.parameters()]))
    (out, gx, grads), (out2, gx2, grads2) = results
    torch.testing.assert_close(out, out2, **FP32)
    torch.testing.assert_close(gx, gx2, **FP32)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g, g2, **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("dropless", [True, False])  # dropping: a fixed-size buffer ending in padding rows
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gemm", ["torch", "triton", "loop"])
def test_grouped_gemm_path_equals_per_expert_products(bias, gemm, dropless, monkeypatch):
    from kernels.grouped_gemm import _torch_grouped_mm_runs

    if gemm == "torch" and not _torch_grouped_mm_runs(DEVICE, torch.float32):
        pytest.skip("torch's grouped GEMM does not run for fp32 on this device")  # e.g. some GPUs: bf16 only
    monkeypatch.setenv("MOE_GROUPED_GEMM", gemm)
    monkeypatch.setenv("MOE_KERNELS", "triton" if gemm == "triton" else "auto")
    torch.manual_seed(14)
    expert = _mlp(8, 16, nn.GELU, bias=bias)
    kwargs = dict(num_experts=4, k=2, dropless=dropless, top2_2nd_expert_sampling=False, capacity_factor=0.5)
    grouped = MoE(8, expert, expert_layout="grouped", **kwargs)
    packed = MoE(8, expert, expert_layout="packed", **kwargs)
    with torch.no_grad():
        for p in grouped.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    packed.load_state_dict(grouped.state_dict())
    grouped, packed = grouped.to(DEVICE), packed.to(DEVICE)
    x = torch.randn(30, 8, device=DEVICE)
    out, l_aux, _ = grouped(x)
    out2, l_aux2, _ = packed(x)
    torch.testing.assert_close(out, out2, **FP32)
    (out.square().sum() + l_aux).backward()
    (out2.square().sum() + l_aux2).backward()
    for (name, p), p2 in zip(grouped.named_parameters(), packed.parameters()):
        torch.testing.assert_close(p.grad, p2.grad, **FP32, msg=name)


def test_bf16_auto_layout_equals_padded_when_dropping():
    """The layout "auto" takes in bf16 when dropping (grouped where torch's grouped GEMM runs on a GPU,
    packed on the CPU) gives the padded layout's outputs and gradients, within bf16 rounding."""
    from kernels.grouped_gemm import torch_backend_runs

    torch.manual_seed(16)
    kwargs = dict(num_experts=4, k=2, capacity_factor=0.5, min_capacity=0, top2_2nd_expert_sampling=False)
    auto = MoE(16, _mlp(16, 32), **kwargs).to(DEVICE, torch.bfloat16)
    padded = MoE(16, _mlp(16, 32), expert_layout="padded", **kwargs).to(DEVICE, torch.bfloat16)
    padded.load_state_dict(auto.state_dict())
    grouped_runs = DEVICE.type == "cuda" and torch_backend_runs(DEVICE, torch.bfloat16, (16, 32))
    expected = "packed" if DEVICE.type == "cpu" else "grouped" if grouped_runs else "padded"
    assert auto.deepspeed_moe._layout(DEVICE, torch.bfloat16) == expected
    x = torch.randn(40, 16, device=DEVICE, dtype=torch.bfloat16)
    results = []
    for layer in (auto, padded):
        xb = x.clone().requires_grad_()
        out, l_aux, _ = layer(xb)
        (out.float().square().sum() + l_aux).backward()
        results.append((out.float(), xb.grad.float(), [p.grad.float() for p in layer.parameters()]))
    assert bool((auto.deepspeed_moe.routing.expert_idx_SK < 0).any()), "the test should drop choices"
    (out, gx, grads), (out2, gx2, grads2) = results
    torch.testing.assert_close(out, out2, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gx, gx2, rtol=2e-2, atol=2e-2)
    for g, g2 in zip(grads, grads2):
        torch.testing.assert_close(g, g2, rtol=2e-2, atol=5e-2)


def test_backward_twice_with_retained_graph_doubles_the_gradients():
    torch.manual_seed(15)
    layer = MoE(8, _mlp(8, 64), num_experts=2, k=2, min_capacity=0, top2_2nd_expert_sampling=False)
    x = torch.randn(600, 8)  # large enough for the CPU workspace to hand out pooled buffers
    out, l_aux, _ = layer(x)
    loss = out.square().sum() + l_aux
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in layer.parameters()]
    layer(torch.randn(600, 8))[0].sum().backward()  # another graph in between reuses free workspace
    for p, g in zip(layer.parameters(), first):
        p.grad = g.clone()
    loss.backward()
    for p, g in zip(layer.parameters(), first):
        torch.testing.assert_close(p.grad, 2 * g, **FP32)


def test_expert_compute_is_the_deprecated_name_of_expert_layout():
    with pytest.warns(DeprecationWarning, match="renamed expert_layout"):
        layer = MoE(8, _mlp(), num_experts=4, k=1, expert_compute="padded")
    assert layer.deepspeed_moe.expert_layout == "padded"
    with pytest.raises(ValueError, match="expert_layout must be one of"):
        MoE(8, _mlp(), num_experts=4, k=1, expert_compute="packd")


def test_the_layer_takes_deepspeeds_string_none_for_no_noise_and_one_name_of_the_layout():
    layer = MoE(8, _mlp(), num_experts=4, k=1, noisy_gate_policy="None")  # DeepSpeed's MoE takes it
    assert layer.deepspeed_moe.gate.config.noisy_gate_policy is None
    with pytest.raises(ValueError, match="expert_compute is the earlier name of expert_layout; pass one"):
        MoE(8, _mlp(), num_experts=4, k=1, expert_layout="padded", expert_compute="packed")


@pytest.mark.parametrize("pool", ["1", "0"])
def test_building_a_layer_asks_glibc_to_keep_freed_chunks_unless_the_workspace_is_off(pool, monkeypatch):
    """A compiled model never uses the CPU workspace, whose first use tunes glibc; the layer tunes it
    when built (kernels.cpu.workspace.keep_freed_memory), and MOE_CPU_WORKSPACE=0 leaves glibc alone."""
    from kernels.cpu import workspace

    calls = []
    monkeypatch.setattr(workspace, "_tune_malloc", lambda: calls.append(1) or True)
    monkeypatch.setenv("MOE_CPU_WORKSPACE", pool)
    MoE(8, nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=4, k=2)
    assert len(calls) == (1 if pool == "1" else 0)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("tokens", [0, 1, 3])
def test_eval_routes_fewer_tokens_than_min_capacity_with_nothing_dropped(k, tokens):
    """Generation from a short prompt: in eval, S < min_capacity keeps every choice (as a dropless twin
    does); in training it is an error naming both numbers."""
    torch.manual_seed(11)
    layer = MoE(8, _mlp(), num_experts=4, k=k, min_capacity=4, eval_capacity_factor=1.0).eval()
    dropless = MoE(8, _mlp(), num_experts=4, k=k, min_capacity=4, drop_tokens=False).eval()
    dropless.load_state_dict(layer.state_dict())
    x = torch.randn(tokens, 8)
    out, _, exp_counts = layer(x)
    torch.testing.assert_close(out, dropless(x)[0], **FP32)
    assert int(layer.deepspeed_moe.routing.kept_counts().sum()) == int(exp_counts.sum()) == tokens * k
    if tokens:
        torch.testing.assert_close(out, _reference(layer, x), **FP32)
        with pytest.raises(ValueError, match=rf"number of tokens \({tokens}\) must be >= min_capacity \(4\)"):
            layer.train()(x)


def test_a_layer_that_ran_a_forward_pickles_and_deep_copies():
    torch.manual_seed(0)
    layer = MoE(8, _mlp(), num_experts=4, k=2)
    out, l_aux, _ = layer(torch.randn(12, 8))
    (out.sum() + l_aux).backward()  # the forward's graph is still referenced by the layer's losses
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    twin = copy.deepcopy(layer)
    assert layer.deepspeed_moe.l_aux is not None, "the original keeps its last forward's loss"
    x = torch.randn(12, 8)
    for other in (loaded, twin):
        assert other.deepspeed_moe.l_aux is None and other.routing_stats is None
        # eval: no gate noise, so two forwards of equal layers are equal
        torch.testing.assert_close(other.eval()(x)[0], layer.eval()(x)[0], rtol=0, atol=0)
