"""DeepSpeed's learning-rate schedules: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Each is a function of the iteration index (`last_batch_iteration`, -1 before the first step) that
sets every param group's lr (OneCycle also beta1). As in DeepSpeed, building a schedule sets the lr
of iteration 0 at once, and `step()` advances by one. Per-group values may be given as lists.
"""

import math

import torch

from optim.config import accepted_params, check_params

__all__ = ["build_scheduler"]


def _per_group(optimizer: torch.optim.Optimizer, value, name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"scheduler.params.{name} has {len(value)} values for {groups} param groups")
        return [float(v) for v in value]
    return [float(value)] * groups


def _warmup_fraction(iteration: int, steps: int, kind: str) -> float:
    """Progress through warm-up in [0, 1]: log (DeepSpeed's default) or linear."""
    if iteration >= steps:
        return 1.0
    if kind == "log":
        return math.log(iteration + 1) / math.log(steps)
    return iteration / steps


class _Schedule:
    """Common stepping and state; subclasses give `lrs(iteration)`."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._start()

    def _start(self) -> None:
        """The lr before the first step: the value at iteration 0."""
        self._apply(0)

    def _apply(self, iteration: int) -> None:
        self._last_lr = self.lrs(iteration)
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None else last_batch_iteration
        self._apply(max(self.last_batch_iteration, 0))

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def get_lr(self) -> list[float]:
        return self.lrs(max(self.last_batch_iteration, 0))

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = int(state["last_batch_iteration"])
        self._apply(max(self.last_batch_iteration, 0))


class WarmupLR(_Schedule):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        if warmup_num_steps < 1:
            raise ValueError(f"scheduler.params.warmup_num_steps must be >= 1, got {warmup_num_steps}")
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)

    def lrs(self, iteration: int) -> list[float]:
        gamma = self.gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to zero at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return super().gamma(iteration)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_Schedule):
    """A ratio of each group's initial lr: warm-up from warmup_min_ratio to 1, cosine to cos_min_ratio."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        if warmup_type not in ("log", "linear"):
            raise ValueError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            progress = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1 - self.warmup_min_ratio) * progress
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / span)
        return max(0.0, self.cos_min_ratio + (1 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def lrs(self, iteration: int) -> list[float]:
        return [lr * self.ratio(iteration) for lr in self.base_lrs]


class OneCycle(_Schedule):
    """1Cycle (Smith): lr up from cycle_min_lr to cycle_max_lr and back, then decay; beta1 the opposite way."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1):
        if cycle_first_step_size <= 0:
            raise ValueError(f"scheduler.params.cycle_first_step_size must be > 0, got {cycle_first_step_size}")
        self.first = float(cycle_first_step_size)
        self.second = float(cycle_first_step_size if cycle_second_step_size is None else cycle_second_step_size)
        self.total = self.first + self.second
        self.stairs = (cycle_first_stair_count,
                       cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count)
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate, self.decay_step_size = decay_lr_rate, decay_mom_rate, decay_step_size
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_batch_iteration)

    def _start(self) -> None:
        """DeepSpeed starts the cycle at cycle_min_lr (and beta1 at cycle_min_mom)."""
        self._last_lr = list(self.min_lrs)
        for group, lr, mom in zip(self.optimizer.param_groups, self.min_lrs, self.min_moms):
            group["lr"] = lr
            if self.cycle_momentum:
                group["betas"] = (mom, group["betas"][1])

    def _scale(self, iteration: int) -> float:
        """Height within the cycle in [0, 1], quantised to stairs when a stair count is set."""
        position = (iteration + 1) % self.total
        rising = position <= self.first
        stairs = self.stairs[0] if rising else self.stairs[1]
        scale = position / self.first if rising else (self.total - position) / self.second
        if stairs > 0:
            scale = math.floor(scale * stairs) / stairs
        return scale

    def _decay_factor(self, iteration: int, rate: float) -> float | None:
        if iteration < self.total or self.decay_step_size == 0 or rate == 0:
            return None
        return 1 + rate * (iteration - self.total + 1) / self.decay_step_size

    def lrs(self, iteration: int) -> list[float]:
        if iteration >= self.total:
            factor = self._decay_factor(iteration, self.decay_lr_rate) or 1.0
            return [low / factor for low in self.min_lrs]
        scale = self._scale(iteration)
        return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]

    def _apply(self, iteration: int) -> None:
        super()._apply(iteration)
        if not self.cycle_momentum:
            return
        if iteration >= self.total:
            factor = self._decay_factor(iteration, self.decay_mom_rate) or 1.0
            moms = [high * factor for high in self.max_moms]
        else:
            scale = self._scale(iteration)
            moms = [high - (high - low) * scale for low, high in zip(self.min_moms, self.max_moms)]
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, group["betas"][1])


class LRRangeTest(_Schedule):
    """lr = lr_range_test_min_lr * (1 + step_rate * interval), interval continuous or staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        if lr_range_test_step_size < 1:
            raise ValueError(f"scheduler.params.lr_range_test_step_size must be >= 1, got {lr_range_test_step_size}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate, self.staircase = lr_range_test_step_size, lr_range_test_step_rate, lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def _start(self) -> None:
        self._last_lr = list(self.min_lrs)
        for group, lr in zip(self.optimizer.param_groups, self.min_lrs):
            group["lr"] = lr

    def lrs(self, iteration: int) -> list[float]:
        interval = (iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


# the params `_per_group` reads: a number, or a list of one per param group
_PER_GROUP = frozenset({"warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr", "cycle_min_mom",
                        "cycle_max_mom", "lr_range_test_min_lr"})
_SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def scheduler_params(name: str) -> set[str]:
    """The config keys scheduler.params takes for the schedule `name` (any case).

    Raises:
        KeyError: no such schedule.
    """
    cls = next((c for key, c in _SCHEDULES.items() if key.lower() == name.lower()), None)
    if cls is None:
        raise KeyError(name)
    return set(accepted_params(cls.__init__, {"self", "optimizer"}))


def build_scheduler(name: str, optimizer: torch.optim.Optimizer, params: dict) -> _Schedule:
    """The schedule `name` over `optimizer`.

    Raises:
        ValueError: an unknown parameter, or values the schedule refuses; optim.ConfigTypeError (a
            TypeError): a parameter of the wrong kind (a string for a number). Each names
            scheduler.params.<key> where it can.
    """
    cls = _SCHEDULES[name]
    check_params("scheduler.params", name, cls.__init__, params, {"self", "optimizer"}, _PER_GROUP)
    try:
        return cls(optimizer, **params)
    except TypeError as error:
        raise ValueError(f"scheduler.params for {name}: {error}") from None
