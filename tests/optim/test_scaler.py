"""optim.scaler, the fp16 loss scaler on its own: DeepSpeed's dynamic rules (hysteresis, halving down
to the floor, doubling after a clean window, consecutive hysteresis) and a static scale, on a hand-made
run of overflows. The engine's use of it is tested in test_fp16.py and test_precision.py."""

import pytest
import torch

from optim import LossScaler, LossScalerConfig


def test_loss_scaler_rules():
    scaler = LossScaler(LossScalerConfig(initial_scale_power=3, loss_scale_window=3, hysteresis=2, min_loss_scale=2))
    seen = []
    for overflow in (True, True, True, True, False, False, False, False, False, False):
        scaler.update(overflow)
        seen.append(scaler.scale)
    # hysteresis absorbs the first overflow; then halving, floored at 2; 3 clean iterations double
    assert seen == [8, 4, 2, 2, 2, 2, 4, 4, 4, 8]
    static = LossScaler(LossScalerConfig(static_scale=128))
    static.update(True)
    assert static.scale == 128
    consecutive = LossScaler(LossScalerConfig(initial_scale_power=3, hysteresis=2, consecutive_hysteresis=True))
    for overflow in (True, False, True):
        consecutive.update(overflow)
    assert consecutive.scale == 8  # the clean iteration refilled the hysteresis budget


@pytest.mark.parametrize("settings", [
    dict(initial_scale_power=3, loss_scale_window=3, hysteresis=2, min_loss_scale=2),
    dict(initial_scale_power=5, loss_scale_window=2, hysteresis=3, consecutive_hysteresis=True),
    dict(initial_scale_power=16, loss_scale_window=1, hysteresis=1, min_loss_scale=0.25),
    dict(static_scale=1000.0),
])
def test_the_device_rules_equal_the_host_rules(settings):
    """`to_device` state updated from a device flag: the same scale, hysteresis and counters as the
    host rules after every iteration of a random run of overflows."""
    generator = torch.Generator().manual_seed(0)
    host, device = LossScaler(LossScalerConfig(**settings)), LossScaler(LossScalerConfig(**settings))
    device.to_device(torch.device("cpu"))
    assert device.on_device and device.scale_tensor.dtype == torch.float32
    for overflow in (torch.rand(60, generator=generator) < 0.4).tolist():
        host.update(overflow)
        device.update(torch.tensor([2.0 if overflow else 0.0]))  # any nonzero flag is an overflow
        assert device.state_dict() == host.state_dict()
    device.to_host()
    assert not device.on_device and device.scale == host.scale and device.iteration == host.iteration
    loaded = LossScaler(LossScalerConfig(**settings))
    loaded.to_device(torch.device("cpu"))
    loaded.load_state_dict(host.state_dict())
    assert loaded.state_dict() == host.state_dict()
