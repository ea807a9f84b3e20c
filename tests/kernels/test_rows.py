"""kernels.rows, the row gathers and sums under permute and unpermute_combine: the torch path's
chunked widening of half-precision rows, the launchers' direct eager calls beside the custom ops that
traces see, the CPU shortcuts and their cached index tensors, each against plain formulas or the
torch references. Tolerances: fp32 1e-5; bf16 and fp16 1e-2.
"""

import pytest
import torch

from kernels import permute, permute_reference, unpermute_combine, unpermute_combine_reference
from tests.devices import DEVICE
from tests.kernels.layouts import row_layout

FP32 = {"rtol": 1e-5, "atol": 1e-5}
BF16 = {"rtol": 1e-2, "atol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_over_many_row_chunks_matches_fp32_sums(dtype, monkeypatch):
    # the torch path widens half-precision rows a chunk of rows at a time (256 rows at M = 1024): wide
    # rows and many tokens give several chunks, with a short last one, checked against sums of the same
    # widened values in fp32 (the Triton kernels widen per element; their cases are above)
    monkeypatch.setenv("MOE_KERNELS", "torch")
    S, K, M = 600, 2, 1024
    row_SK, num_rows = row_layout(S, K, 8, 160, 0.1, seed=5, packed=True)
    buffer = torch.randn(num_rows, M, device=DEVICE).to(dtype).requires_grad_()
    weight = torch.rand(S, K, device=DEVICE, requires_grad=True)
    buffer_f = buffer.detach().float().requires_grad_()
    weight_f = weight.detach().clone().requires_grad_()
    out = unpermute_combine(buffer, row_SK, weight)
    ref = unpermute_combine_reference(buffer_f, row_SK, weight_f)
    # the same fp32 operations over all tokens at once, rounded once: chunks change nothing, bit for bit
    w_SK = torch.where(row_SK >= 0, weight.detach(), 0.0)
    rows_SK = row_SK.clamp(min=0)
    whole = (buffer_f.detach()[rows_SK[:, 0]] * w_SK[:, :1]).addcmul_(buffer_f.detach()[rows_SK[:, 1]], w_SK[:, 1:])
    assert torch.equal(out, whole.to(dtype))
    torch.testing.assert_close(out.float(), ref, **BF16)
    grad = torch.randn(S, M, device=DEVICE).to(dtype)
    out.backward(grad)
    ref.backward(grad.float())
    torch.testing.assert_close(weight.grad, weight_f.grad, **FP32)  # dots of exactly widened values, in fp32
    torch.testing.assert_close(buffer.grad.float(), buffer_f.grad, **BF16)


def test_eager_calls_launch_directly_and_traces_see_the_custom_ops(monkeypatch):
    """Real tensors in eager mode skip the custom ops' dispatch (host time); meta and fake tensors,
    dispatch modes, torch.compile and torch.jit.trace go through them, with the same results."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from kernels import rows

    monkeypatch.setenv("MOE_KERNELS", "triton")
    S, K, M, E, C = 6, 2, 16, 3, 4
    row_SK, num_rows = row_layout(S, K, E, C, 0.2, 11, packed=False)
    x = torch.randn(S, M, device=DEVICE)
    weight_SK = torch.rand(S, K, device=DEVICE)
    calls = []  # ("op" or "launch", launcher name) of every call, in order

    for launcher in (rows.gather_rows_triton, rows.combine_rows_triton):
        for path in ("op", "launch"):
            def counted(*args, _path=path, _name=launcher.__name__, _inner=getattr(launcher, path)):
                calls.append((_path, _name))
                return _inner(*args)
            monkeypatch.setattr(launcher, path, counted)

    def paths_of(run):
        calls.clear()
        run()
        return {path for path, _ in calls}, len(calls)

    def forward(x_SM, rows_SK, weights):
        return unpermute_combine(permute(x_SM, rows_SK, num_rows), rows_SK, weights)

    expected = unpermute_combine_reference(permute_reference(x, row_SK, num_rows), row_SK, weight_SK)
    assert paths_of(lambda: forward(x, row_SK, weight_SK)) == ({"launch"}, 2)
    assert paths_of(lambda: forward(x.to("meta"), row_SK.to("meta"), weight_SK.to("meta"))) == ({"op"}, 2)
    with FlopCounterMode(display=False):  # a user's dispatch mode sees the ops
        assert paths_of(lambda: forward(x, row_SK, weight_SK)) == ({"op"}, 2)
    with FakeTensorMode() as fake:
        fakes = [fake.from_tensor(t) for t in (x, row_SK, weight_SK)]
        assert paths_of(lambda: forward(*fakes)) == ({"op"}, 2)
    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)(x, row_SK, weight_SK)
    traced = torch.jit.trace(forward, (x, row_SK, weight_SK), check_trace=False)  # a direct launch fails here
    for out in (forward(x, row_SK, weight_SK), compiled, traced(x, row_SK, weight_SK)):
        torch.testing.assert_close(out, expected, **FP32)


def test_cpu_shortcuts_equal_the_general_path():
    """On the CPU: a gather whose rows all have a token skips the clamp and the empty-row pass (scaled,
    in fp32 and float64, it is an embedding bag of one row per bag; rows of no width keep the plain
    path); the weights' dots come from an embedding bag's per-sample-weight gradient; K = 0 has no
    bags. Each against the plain formula."""
    from kernels.rows import gather_rows, row_dots

    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 6, generator=g)
    full = torch.randint(0, 7, (11,), generator=g)
    gappy = full.clone()
    gappy[[2, 9]] = -1
    scale = torch.rand(11, generator=g)
    for dtype in (torch.float32, torch.float64):  # scaled full gathers: bags of one row, weighted
        for token in (full, gappy):
            xd, scaled = x.to(dtype), scale.to(dtype)
            want = torch.where((token >= 0).unsqueeze(1), xd[token.clamp(min=0)] * scaled.unsqueeze(1), 0.0)
            assert torch.equal(gather_rows(xd, token, scaled), want)
            plain = torch.where((token >= 0).unsqueeze(1), xd[token.clamp(min=0)], 0.0)
            assert torch.equal(gather_rows(xd, token, None), plain)
    for n in (11, 3, 40):  # row counts that change from call to call (the packed layout's do, with dropping)
        token = torch.randint(0, 7, (n,), generator=g)
        weights = torch.rand(n, generator=g)
        assert torch.equal(gather_rows(x, token, weights), x[token] * weights.unsqueeze(1))
    assert gather_rows(x[:, :0], full, scale).shape == (11, 0)
    buffer = torch.randn(11, 6, generator=g)
    grad = torch.randn(7, 6, generator=g)
    rows = torch.randperm(11, generator=g)[:8].view(4, 2)
    rows[1, 0] = -1
    dots = row_dots(grad[:4], buffer, rows)
    want = torch.where(rows >= 0, (grad[:4].unsqueeze(1) * buffer[rows.clamp(min=0)]).sum(2), 0.0)
    torch.testing.assert_close(dots, want, **FP32)
    assert dots[1, 0] == 0
    assert row_dots(grad[:4], buffer, rows[:, :0]).shape == (4, 0)


def test_cached_bags_are_plain_cpu_tensors_whoever_made_them_first():
    """The bags' index tensors are kept across calls: made first under a meta device context or in
    inference mode, they still serve real CPU tensors that need gradients."""
    from kernels import rows as rows_module

    rows_module._bags.cache_clear()
    row_SK = torch.tensor([[0, 3], [1, -1], [4, 2]])
    with torch.device("meta"):
        rows_module._bags(3, 2)
    with torch.inference_mode():
        rows_module._bags(5, 1)
    rows_module._ranges[0] = torch.empty(0, dtype=torch.int64, device="cpu")
    with torch.device("meta"), torch.inference_mode():
        rows_module._range(5)
    short, longer = rows_module._range(3), rows_module._range(9)  # one kept range, grown when too short
    assert short.device.type == longer.device.type == "cpu" and not longer.is_inference()
    assert short.tolist() == [0, 1, 2] and longer.tolist() == list(range(9))
    assert rows_module._range(7).data_ptr() == longer.data_ptr()
    for S, K in ((3, 2), (5, 1)):
        offsets, bag = rows_module._bags(S, K)
        assert offsets.device.type == bag.device.type == "cpu" and not offsets.is_inference()
        assert offsets.tolist() == list(range(0, S * K, K)) and bag.tolist() == [s for s in range(S) for _ in range(K)]
    buffer = torch.randn(5, 4, requires_grad=True)
    weight = torch.rand(3, 2, requires_grad=True)
    out = unpermute_combine(buffer, row_SK, weight)
    ref = unpermute_combine_reference(buffer.detach().clone().requires_grad_(), row_SK, weight.detach().clone())
    torch.testing.assert_close(out, ref, **FP32)
    out.sum().backward()
    assert buffer.grad is not None and weight.grad is not None
