"""The fp16 loss scaler: DeepSpeed's dynamic scaling rules, or a static scale.

Dynamic rules (DeepSpeed's `DynamicLossScaler`): the scale starts at 2^initial_scale_power. On an
overflow the step is skipped and, once `hysteresis` overflows have been absorbed, the scale halves,
never below min_loss_scale. After `loss_scale_window` iterations without an overflow the scale
doubles (and the hysteresis budget refills; with consecutive_hysteresis it refills after every clean
iteration instead). The overflow flag must already be agreed by every rank.
"""

from dataclasses import dataclass

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

    def update(self, overflow: bool) -> None:
        """Apply one iteration's outcome to the scale."""
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

    def state_dict(self) -> dict:
        return {
            "scale": self.scale, "hysteresis_left": self.hysteresis_left, "iteration": self.iteration,
            "last_overflow_iteration": self.last_overflow_iteration,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
