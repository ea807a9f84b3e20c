"""optim.precision against plain torch: the loss scaler's overflow skipping, the gradient factor, the
unscaled gradients the optimizer gets, the global norm and its clipping, the dtypes a config asks for,
and what a step wrote watched for inf."""

import copy

import pytest
import torch
from torch import nn

from optim.config import parse_config
from optim.precision import Precision, PrecisionConfig
from optim.scaler import LossScalerConfig
from optim.zero import FlatGroup, describe_parameters

CPU = torch.device("cpu")
RTOL = 1e-6  # fp32 norms summed in another order


def _unit(model: nn.Module, state_dtype=torch.float32) -> FlatGroup:
    """The model's parameters in one stage-0 flat group without a process group (the engine's one-process unit)."""
    infos = list(describe_parameters(model, lambda param: 0).values())
    return FlatGroup(infos, None, 1, 0, 0, torch.float32, state_dtype, CPU)


def _fp16(**scaler) -> Precision:
    return Precision(PrecisionConfig(low_precision="fp16", loss_scaler=LossScalerConfig(**scaler)), 1, CPU)


# The scale in use at each step and after it: initial 2^4, hysteresis 2, window 2 (DeepSpeed's rules:
# the first overflow is absorbed, the second halves; two clean steps since the last overflow double).
POISONED = [False, True, True, False, False, False]
SCALE_USED = [16.0, 16.0, 16.0, 8.0, 8.0, 16.0]
SCALE_AFTER = [16.0, 16.0, 8.0, 8.0, 16.0, 16.0]


def test_overflow_skipping_equals_a_hand_written_scaled_sgd():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    precision = _fp16(initial_scale_power=4, hysteresis=2, loss_scale_window=2)
    unit = _unit(model)
    optimizer = torch.optim.SGD([unit.proxy], lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, poisoned in enumerate(POISONED):
        x = torch.randn(5, 4)
        factor = float("inf") if poisoned else 1.0
        precision.backward(model(x).square().mean() * factor)
        unit.micro_step()
        unit.reduce()
        grads = [unit.grad()]
        skipped = precision.overflowed(grads)
        if skipped:
            precision.release_proxies([unit])
            precision.after_skip(step + 1)
        else:
            precision.prepare_proxies([unit], grads)
            optimizer.step()
            unit.write_back()
            precision.release_proxies([unit])
            precision.after_step()
        unit.zero_grad()

        # plain torch: scale the loss, skip on inf or nan, else unscale and step
        (reference(x).square().mean() * factor * SCALE_USED[step]).backward()
        overflow = any(not torch.isfinite(p.grad).all() for p in reference.parameters())
        if not overflow:
            for p in reference.parameters():
                p.grad = p.grad * (1.0 / SCALE_USED[step])
            reference_optimizer.step()
        reference_optimizer.zero_grad()

        assert skipped == overflow == poisoned, step
        assert precision.loss_scale == SCALE_AFTER[step], step
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert torch.equal(ours, theirs), step


def test_outputs_carry_the_gradient_factor_and_backward_scales_once():
    torch.manual_seed(0)
    config = PrecisionConfig(low_precision="fp16", gradient_accumulation_steps=4,
                             loss_scaler=LossScalerConfig(initial_scale_power=3))
    precision = Precision(config, 1, CPU)
    assert precision.loss_scale == 8.0 and precision.grad_factor() == 2.0
    model, reference = nn.Linear(4, 3), nn.Linear(4, 3)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(5, 4)
    precision.scale_outputs(model(x)).square().sum().backward()  # a plain backward through the outputs
    (reference(x).square().sum() * 2.0).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    model.zero_grad()
    reference.zero_grad()
    precision.backward(precision.scale_outputs(model(x)).square().sum())  # the loss scaled, the outputs not again
    (reference(x).square().sum().float() * 2.0).backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
    outputs = precision.scale_outputs((model(x), torch.ones(2, dtype=torch.long), "name"))
    assert outputs[1].dtype == torch.long and outputs[2] == "name"


def test_inputs_take_the_compute_dtype_and_autocast_its_dtype():
    bf16 = Precision(PrecisionConfig(low_precision="bf16"), 1, CPU)
    assert bf16.cast_input(torch.ones(2), CPU).dtype == torch.bfloat16
    assert bf16.cast_input(torch.ones(2, dtype=torch.long), CPU).dtype == torch.long
    assert bf16.cast_input("text", CPU) == "text"
    fp32 = Precision(PrecisionConfig(autocast_dtype=torch.bfloat16), 1, CPU)
    assert fp32.cast_input(torch.ones(2, dtype=torch.float64), CPU).dtype == torch.float64  # left as it is
    with fp32.autocast("cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16


def test_global_norm_and_clipping_equal_torchs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    reference = copy.deepcopy(model)
    precision = Precision(PrecisionConfig(), 1, CPU)
    unit = _unit(model)
    x = torch.randn(6, 4)
    precision.backward(model(x).square().sum())
    reference(x).square().sum().backward()
    proxies = precision.prepare_proxies([unit], [unit.grad()])
    norm = precision.global_norm([unit])
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.testing.assert_close(norm.float(), expected, rtol=RTOL, atol=0)
    assert not precision.overflowed([unit.grad()], norm)
    precision.clip(proxies, norm, 0.5)
    clipped = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(proxies[0].grad, clipped, rtol=RTOL, atol=0)
    before = proxies[0].grad.clone()
    precision.clip(proxies, norm, 1e9)  # nothing to clip: not a bit changes
    assert torch.equal(proxies[0].grad, before)


def test_a_nonfinite_norm_is_checked_element_by_element():
    precision = Precision(PrecisionConfig(), 1, CPU)
    huge = [torch.full((4,), 3e38)]  # finite, though the norm of them overflows
    assert not precision.overflowed(huge, torch.tensor(float("inf")))
    assert precision.overflowed([torch.tensor([1.0, float("nan")])], torch.tensor(float("nan")))
    assert precision.overflowed([torch.tensor([1.0, float("inf")])])


def test_writes_holding_inf_are_flagged_and_make_the_next_norm_inf():
    model = nn.Linear(2, 2)
    precision = Precision(PrecisionConfig(), 1, CPU)
    unit = _unit(model)
    optimizer = torch.optim.SGD([unit.proxy], lr=0.1)
    optimizer.unit_states = lambda u: [(u.infos, optimizer.state.get(u.proxy, {}))]  # as optim.ZeroOptimizer answers
    precision.record_writes([unit], optimizer, step=1)
    assert float(precision.guard.written) == 0.0
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    precision.record_writes([unit], optimizer, step=2)
    assert float(precision.guard.written) == 1.0
    unit.proxy.grad = torch.zeros_like(unit.weights)
    assert torch.isinf(precision.global_norm([unit]))


@pytest.mark.parametrize("keys, compute, master, state, scaler", [
    ({}, torch.float32, torch.float32, torch.float32, False),
    ({"fp16": {"enabled": True}}, torch.float16, torch.float32, torch.float32, True),
    ({"bf16": {"enabled": True}}, torch.bfloat16, torch.float32, torch.float32, False),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, torch.bfloat16, torch.bfloat16,
     torch.float32, False),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
     torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
    ({"torch_autocast": {"enabled": True, "dtype": "float16"}}, torch.float32, torch.float32, torch.float32, True),
])
def test_dtypes_and_scaler_follow_the_engine_config(keys, compute, master, state, scaler):
    config = parse_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                           **keys}, 1)
    precision = Precision(PrecisionConfig.from_engine(config), 1, CPU)
    assert (precision.compute_dtype, precision.master_dtype, precision.state_dtype) == (compute, master, state)
    assert (precision.scaler is not None) == scaler
    assert precision.model_dtype == (None if compute == torch.float32 else compute)


def test_without_a_scaler_a_skip_warns_and_stop_is_the_default():
    skip = Precision(PrecisionConfig(nonfinite="skip"), 1, CPU)
    assert skip.watch and not skip.stops_on_nonfinite and skip.loss_scale == 1.0
    with pytest.warns(UserWarning, match=r"step 3 skipped: gradients hold inf or nan \(nonfinite: skip\)"):
        skip.after_skip(3)
    assert Precision(PrecisionConfig(), 1, CPU).stops_on_nonfinite
    assert not Precision(PrecisionConfig(nonfinite="off"), 1, CPU).watch
    assert _fp16().watch and not _fp16().stops_on_nonfinite


def test_a_learning_rate_beyond_the_dtype_is_refused():
    precision = Precision(PrecisionConfig(low_precision="fp16"), 1, CPU)
    precision.check_learning_rates([{"lr": 1e-3}], None)
    with pytest.raises(ValueError, match=r"param group 1's lr \(1e\+06\) is beyond the range of the model's float16 "
                                         r"\(largest 6\.55e\+04\)"):
        precision.check_learning_rates([{"lr": 1e-3}, {"lr": 1e6}], None)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="low_precision must be fp16, bf16 or None, got 'fp8'"):
        PrecisionConfig(low_precision="fp8")
    with pytest.raises(ValueError, match="nonfinite must be stop, skip or off, got 'ignore'"):
        PrecisionConfig(nonfinite="ignore")
