"""kernels.backend: which implementation a dispatch op runs (MOE_KERNELS), the opt-in checks that read
device values on the host (MOE_SYNC_CHECKS), when the CPU shortcuts apply, the Triton block width, and
the launcher that calls its launch function directly in eager code and its custom op where a trace or
a dispatch mode must see it. Each against the rule its docstring states, on hand-picked cases."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from kernels import backend


def _double_launch(t: torch.Tensor) -> torch.Tensor:
    """Twice t (a stand-in for a Triton launch)."""
    return t * 2


def _double_fake(t):
    return torch.empty_like(t)


_double = backend.launcher("exactmoe_tests::double", _double_launch, _double_fake)  # registered once per process


@pytest.mark.parametrize("choice, device, dtype, expected", [
    ("torch", "cpu", torch.float32, False),
    ("auto", "cpu", torch.float32, False),  # auto: Triton on CUDA tensors only
    ("auto", "meta", torch.bfloat16, False),
    ("triton", "cpu", torch.float64, False),  # float64 (gradient checks) always takes the torch path
    ("triton", "cpu", torch.int64, False),
    ("triton", "cpu", torch.float32, True),  # with TRITON_INTERPRET=1, set below
    ("triton", "cpu", torch.float16, True),
    ("triton", "meta", torch.bfloat16, True),
])
def test_use_triton_follows_moe_kernels_device_and_dtype(choice, device, dtype, expected, monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", choice)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.use_triton(torch.zeros(2, dtype=dtype, device=device)) is expected


def test_auto_is_the_default(monkeypatch):
    monkeypatch.delenv("MOE_KERNELS", raising=False)
    assert backend.use_triton(torch.zeros(2)) is False  # a CPU tensor: the torch path


def test_triton_where_it_cannot_run_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"MOE_KERNELS=triton on CPU tensors needs TRITON_INTERPRET=1"):
        backend.use_triton(torch.zeros(2))
    assert backend.use_triton(torch.zeros(2, device="meta")) is True  # no kernel runs on meta tensors
    monkeypatch.setattr(backend, "_triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match="MOE_KERNELS=triton but triton is not installed"):
        backend.use_triton(torch.zeros(2))
    assert backend.use_triton(torch.zeros(2, device="meta")) is True


def test_an_unknown_moe_kernels_value_is_named(monkeypatch):
    monkeypatch.setenv("MOE_KERNELS", "cuda")
    with pytest.raises(ValueError, match=r"MOE_KERNELS must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        backend.use_triton(torch.zeros(2))


def test_sync_checks_are_off_unless_asked_for(monkeypatch):
    monkeypatch.delenv("MOE_SYNC_CHECKS", raising=False)
    assert backend.sync_checks() is False
    monkeypatch.setenv("MOE_SYNC_CHECKS", "0")
    assert backend.sync_checks() is False
    monkeypatch.setenv("MOE_SYNC_CHECKS", "1")
    assert backend.sync_checks() is True
    monkeypatch.setenv("MOE_SYNC_CHECKS", "yes")
    with pytest.raises(ValueError, match="MOE_SYNC_CHECKS must be 0 or 1, got 'yes'"):
        backend.sync_checks()


def test_cpu_shortcuts_apply_to_real_cpu_tensors_off_the_triton_path(monkeypatch):
    monkeypatch.delenv("MOE_KERNELS", raising=False)
    assert backend.cpu_eager(torch.zeros(2)) is True
    assert backend.cpu_eager(torch.zeros(2, device="meta")) is False
    with FakeTensorMode() as fake:
        assert backend.cpu_eager(fake.from_tensor(torch.zeros(2))) is False
    monkeypatch.setenv("MOE_KERNELS", "torch")
    assert backend.cpu_eager(torch.zeros(2)) is True
    monkeypatch.setenv("MOE_KERNELS", "triton")  # the simulated GPU path takes the GPU's branches
    assert backend.cpu_eager(torch.zeros(2)) is False


@pytest.mark.parametrize("n_cols, block", [(0, 16), (1, 16), (16, 16), (17, 32), (33, 64), (1000, 1024), (1024, 1024),
                                           (1025, 1024), (5000, 1024)])
def test_block_size_is_the_width_rounded_up_to_a_power_of_two_between_16_and_1024(n_cols, block):
    assert backend.block_size(n_cols) == block


def test_launcher_calls_the_launch_in_eager_code_and_the_custom_op_under_traces_and_modes(monkeypatch):
    calls = []
    for path in ("op", "launch"):
        inner = getattr(_double, path)
        monkeypatch.setattr(_double, path, lambda t, _path=path, _inner=inner: calls.append(_path) or _inner(t))
    x = torch.arange(3.0)
    assert torch.equal(_double(x), 2 * x) and calls == ["launch"]
    calls.clear()
    assert _double(x.to("meta")).device.type == "meta" and calls == ["op"]
    calls.clear()
    with FlopCounterMode(display=False):  # a user's dispatch mode sees the op
        assert torch.equal(_double(x), 2 * x)
    assert calls == ["op"]
    calls.clear()
    with FakeTensorMode() as fake:
        assert _double(fake.from_tensor(x)).shape == (3,)
    assert calls == ["op"]
    assert torch.equal(torch.ops.exactmoe_tests.double(x), 2 * x)  # the registered op computes the same
    assert _double.__name__ == "_double_launch" and _double.__doc__ == _double_launch.__doc__
