"""optim.scaler, the fp16 loss scaler on its own: DeepSpeed's dynamic rules (hysteresis, halving down
to the floor, doubling after a clean window, consecutive hysteresis) and a static scale, on a hand-made
run of overflows. The engine's use of it is tested in test_fp16.py and test_precision.py."""

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
