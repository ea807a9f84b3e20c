"""The fp16 loss scaler: DeepSpeed's dynamic scaling rules, or a static scale.

Dynamic rules (DeepSpeed's `DynamicLossScaler`): the scale starts at 2^initial_scale_power. On an
overflow the step is skipped and, once `hysteresis` overflows have been absorbed, the scale halves,
never below min_loss_scale. After `loss_scale_window` iterations without an overflow the scale
doubles (and the hysteresis budget refills; with consecutive_hysteresis it refills after every clean
iteration instead). The overflow flag must already be agreed by every rank.

`LossScaler.to_device` moves the state into tensors for a step that reads nothing on the host (a CUDA
graph's): `update` then takes the overflow as a device flag and applies the same rules with tensor
operations, and `scale_tensor` is what the gradients are multiplied by.
"""

from dataclasses import dataclass

import torch

__all__ = ["LossScaler", "LossScalerConfig"]


@dataclass(kw_only=True)
class LossScalerConfig:
    """Scaler settings; static when static_scale > 0."""

    static_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self):
        if self.loss_scale_window < 1 or self.hysteresis < 1 or self.min_loss_scale <= 0:
            raise ValueError(
                f"loss_scale_window ({self.loss_scale_window}) and hysteresis ({self.hysteresis}) must be >= 1 "
                f"and min_loss_scale ({self.min_loss_scale}) > 0"
            )


class LossScaler:
    """The current loss scale and its update after each optimizer step.

    Args:
        config: LossScalerConfig.
    """

    def __init__(self, config: LossScalerConfig):
        self.config = config
        self.dynamic = config.static_scale <= 0
        self.scale = float(2 ** config.initial_scale_power) if self.dynamic else float(config.static_scale)
        self.hysteresis_left = config.hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1
        self._device = None  # with to_device: scale, hysteresis left, iteration, last overflow, as tensors

    @property
    def on_device(self) -> bool:
        return self._device is not None

    def to_device(self, device: torch.device) -> None:
        """Keep the state in tensors on `device`; `update` then takes a device flag and reads nothing."""
        if self._device is None:
            state = self.state_dict()
            self._device = {
                "scale": torch.tensor(state["scale"], dtype=torch.float32, device=device),
                **{key: torch.tensor(state[key], dtype=torch.int64, device=device)
                   for key in ("hysteresis_left", "iteration", "last_overflow_iteration")}}

    def to_host(self) -> None:
        """Back to Python numbers (a read of the device state)."""
        if self._device is not None:
            state = self.state_dict()
            self._device = None
            self.load_state_dict(state)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale as a 0-dim fp32 tensor on the device (with to_device)."""
        return self._device["scale"]

    def update(self, overflow) -> None:
        """Apply one iteration's outcome to the scale: a bool, or a device flag (nonzero: overflow) with to_device."""
        if self._device is not None:
            self._update_on_device(overflow)
            return
        config = self.config
        if self.dynamic and overflow:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale / 2, config.min_loss_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        elif self.dynamic:
            if config.consecutive_hysteresis:
                self.hysteresis_left = config.hysteresis
            if (self.iteration - self.last_overflow_iteration) % config.loss_scale_window == 0:
                if not config.consecutive_hysteresis:
                    self.hysteresis_left = config.hysteresis
                self.scale *= 2
        self.iteration += 1

    def _update_on_device(self, flag: torch.Tensor) -> None:
        """`update`'s rules as tensor operations, in place: no host read, the same result."""
        config, state = self.config, self._device
        if not self.dynamic:
            state["iteration"].add_(1)
            return
        scale, left, iteration, last = (state[key] for key in
                                        ("scale", "hysteresis_left", "iteration", "last_overflow_iteration"))
        overflow = flag.reshape(()).to(scale.device) != 0
        halve = overflow & (left <= 1)
        grow = ~overflow & ((iteration - last) % config.loss_scale_window == 0)
        refill = grow if not config.consecutive_hysteresis else ~overflow
        new_left = torch.where(overflow & (left > 1), left - 1, left)
        left.copy_(torch.where(refill, torch.full_like(left, config.hysteresis), new_left))
        halved = torch.clamp(scale / 2, min=config.min_loss_scale)
        scale.copy_(torch.where(halve, halved, torch.where(grow, scale * 2, scale)))
        last.copy_(torch.where(overflow, iteration, last))
        iteration.add_(1)

    def state_dict(self) -> dict:
        if self._device is not None:
            return {"scale": float(self._device["scale"]),
                    **{key: int(self._device[key]) for key in ("hysteresis_left", "iteration", "last_overflow_iteration")}}
        return {
            "scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict) -> None:
        if self._device is not None:
            self._device["scale"].fill_(float(state["scale"]))
            for key in ("hysteresis_left", "iteration", "last_overflow_iteration"):
                self._device[key].fill_(int(state[key]))
            return
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
