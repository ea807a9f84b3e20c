"""Mixed precision for the engine: dtypes, the fp16 loss scale, and the watch over inf and nan in a step.

`Precision` holds what the engine's numbers are made of and what happens to its gradients between the
backward and the optimizer:

- the dtypes: the model computes in fp16, bf16 or fp32; master weights are fp32 (bf16 when asked
  for); the optimizer's states take the master dtype, or fp32 beside bf16 master weights;
- the gradient factor loss_scale / gradient_accumulation_steps (`optim.scaler` keeps the scale);
- unscaling each ZeRO unit's gradient into the optimizer's dtype, the global gradient norm and its
  clipping;
- the overflow flag: whether a step's gradients (or the previous step's writes) hold inf or nan,
  read once per step through `optim.nonfinite`, and what follows (a lower scale, a warning, a stop).

Gradient scaling: every floating tensor the engine's forward returns passes through an identity whose
backward multiplies the incoming gradient by the gradient factor. So a plain `loss.backward()` (or
`out.backward(grad)`) gets the same gradients as `engine.backward(loss)`, which instead scales the
loss itself (and so also covers loss terms that bypass the outputs).

A capturable step (`set_capturable`, for CUDA graphs) reads nothing on the host: the loss scale and
the gradient factor are device tensors, the overflow is a device flag (`found_nonfinite`) that the
optimizer skips on and the scaler updates from on the device, and the steps it skipped are counted
there too, read when the engine next reports (`read_skips`).

It reduces no gradient and shards nothing: units reach it through the `optim.zero.Unit` protocol.
"""

import contextlib
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from optim import nonfinite
from optim.config import EngineConfig
from optim.nonfinite import NonfiniteGuard
from optim.scaler import LossScaler, LossScalerConfig

__all__ = ["Precision", "PrecisionConfig"]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
_WIDE = (torch.float32, torch.float64)


@dataclass(kw_only=True)
class PrecisionConfig:
    """The engine config's precision keys.

    Args:
        low_precision: "fp16", "bf16" or None (fp32 parameters).
        bf16_master_weights: bf16.bf16_master_weights_and_grads (with bf16 only).
        bf16_optimizer_states: bf16.bf16_optimizer_states (with bf16 master weights only).
        autocast_dtype: torch_autocast's dtype when it is enabled, else None.
        loss_scaler: the fp16 scaler's settings (used with fp16, or with fp16 autocast).
        gradient_accumulation_steps: micro-batches per optimizer step.
        nonfinite: "stop", "skip" or "off": what a step without a loss scaler does with inf or nan.
    """

    low_precision: str | None = None
    bf16_master_weights: bool = False
    bf16_optimizer_states: bool = False
    autocast_dtype: torch.dtype | None = None
    loss_scaler: LossScalerConfig = field(default_factory=LossScalerConfig)
    gradient_accumulation_steps: int = 1
    nonfinite: str = "stop"

    def __post_init__(self):
        if self.low_precision not in (None, *_DTYPES):
            raise ValueError(f"low_precision must be fp16, bf16 or None, got {self.low_precision!r}")
        if self.nonfinite not in ("stop", "skip", "off"):
            raise ValueError(f"nonfinite must be stop, skip or off, got {self.nonfinite!r}")

    @classmethod
    def from_engine(cls, config: EngineConfig) -> "PrecisionConfig":
        """The precision keys of a parsed engine config."""
        fp16, autocast = config.fp16, config.torch_autocast
        return cls(
            low_precision=config.low_precision, bf16_master_weights=config.bf16.bf16_master_weights_and_grads,
            bf16_optimizer_states=config.bf16.bf16_optimizer_states,
            autocast_dtype=autocast.torch_dtype if autocast.enabled else None,
            loss_scaler=LossScalerConfig(
                static_scale=fp16.loss_scale, initial_scale_power=fp16.initial_scale_power,
                loss_scale_window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
                consecutive_hysteresis=fp16.consecutive_hysteresis, min_loss_scale=fp16.min_loss_scale),
            gradient_accumulation_steps=config.gradient_accumulation_steps, nonfinite=config.nonfinite)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies by the gradient factor (unless engine.backward scaled the loss)."""

    @staticmethod
    def forward(ctx, tensor, precision):
        ctx.precision = precision
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        precision = ctx.precision
        if precision.in_backward:
            return grad, None
        factor = precision.grad_factor()
        if isinstance(factor, torch.Tensor):  # in fp32, as a Python factor is applied: 2^16 overflows fp16
            return (grad.float() * factor).to(grad.dtype), None
        return grad * factor, None


class Precision:
    """The dtypes, the loss scale and the inf/nan watch of one engine.

    Args:
        config: PrecisionConfig.
        world_size: the data-parallel world size (the overflow flag is agreed over it above 1).
        device: the model's device, where the flags and the gradient norm live.

    Attributes:
        compute_dtype: the model's dtype (fp32 without fp16/bf16).
        model_dtype: the dtype the model is cast to, None when it keeps the dtype it was built in.
        master_dtype: the dtype of the weights the optimizer updates.
        state_dtype: the dtype the optimizer steps in (its states take it).
        scaler: the fp16 LossScaler, or None.
        guard: the NonfiniteGuard over losses, gradients and what each step wrote.
        watch: whether a step looks for inf and nan (a scaler, or nonfinite stop or skip).
        in_backward: set while `backward` runs, so the outputs' identity passes gradients through.
    """

    def __init__(self, config: PrecisionConfig, world_size: int, device: torch.device):
        self.config, self.world_size, self.device = config, world_size, device
        low = config.low_precision
        self.compute_dtype = _DTYPES.get(low, torch.float32)
        self.model_dtype = self.compute_dtype if low is not None else None
        bf16_master = low == "bf16" and config.bf16_master_weights
        self.master_dtype = torch.bfloat16 if bf16_master else torch.float32
        self.state_dtype = torch.bfloat16 if bf16_master and config.bf16_optimizer_states else torch.float32
        fp16 = low == "fp16" or config.autocast_dtype == torch.float16  # fp16 autocast needs a scaler too
        self.scaler = LossScaler(config.loss_scaler) if fp16 else None
        self.guard = NonfiniteGuard(world_size, device)
        self.watch = self.scaler is not None or config.nonfinite != "off"
        self.in_backward = False
        self.capturable = False
        self.skips = None  # with capturable: [steps skipped, of them for the previous step's writes] on the device

    def set_capturable(self, on: bool) -> None:
        """Keep the loss scale on the device and decide overflows there (no host read in a step), or go back."""
        if on and not self.capturable:
            self.skips = torch.zeros(2, dtype=torch.int64, device=self.device)
        if self.scaler is not None:
            self.scaler.to_device(self.device) if on else self.scaler.to_host()
        self.capturable = on

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        if self.scaler is None:
            return 1.0
        return float(self.scaler.scale_tensor) if self.scaler.on_device else self.scaler.scale

    @property
    def stops_on_nonfinite(self) -> bool:
        """Whether inf or nan in a step's gradients stops the run (nonfinite: stop, without a scaler)."""
        return self.scaler is None and self.config.nonfinite == "stop"

    def grad_factor(self) -> float | torch.Tensor:
        """loss scale / gradient_accumulation_steps: a device tensor while the scale lives on the device."""
        if self.scaler is not None and self.scaler.on_device:
            return self.scaler.scale_tensor / self.config.gradient_accumulation_steps
        return self.loss_scale / self.config.gradient_accumulation_steps

    # 1. Forward and backward.

    def cast_input(self, value, device: torch.device):
        """Tensors to `device`; floating ones to the fp16/bf16 compute dtype."""
        if not isinstance(value, torch.Tensor):
            return value
        dtype = self.model_dtype if value.is_floating_point() else None
        return value.to(device, dtype, non_blocking=True)

    def autocast(self, device_type: str):
        """torch.autocast with torch_autocast's dtype, or nothing."""
        dtype = self.config.autocast_dtype
        return torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def scale_outputs(self, output):
        """The outputs, each floating tensor that needs a gradient behind the gradient factor's identity."""
        return tree_map(lambda t: _ScaleGrad.apply(t, self) if isinstance(t, torch.Tensor) and t.requires_grad
                        and t.is_floating_point() else t, output)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """loss.backward() with the gradient factor applied (in fp32), the loss watched for inf and nan."""
        self.in_backward = True
        try:
            (loss.float() * self.grad_factor()).backward(retain_graph=retain_graph)
        finally:
            self.in_backward = False
        self.guard.add_loss(loss)

    # 2. The step: unscaled gradients for the optimizer, their norm, the overflow flag.

    def prepare_proxies(self, units: list, grads: list[torch.Tensor]) -> list[nn.Parameter]:
        """Give each unit's proxy its gradient in the optimizer's dtype and device, unscaled."""
        proxies = []
        on_device = self.scaler is not None and self.scaler.on_device
        inverse = self.scaler.scale_tensor.reciprocal() if on_device else 1.0 / self.loss_scale
        for unit, grad in zip(units, grads):
            proxy = unit.proxy
            if unit.steps_on_copy:  # bf16 master weights with fp32 optimizer states: step on an fp32 copy
                proxy.data = unit.weights.to(self.state_dtype)
            converted = grad.to(proxy.device, proxy.dtype)
            if on_device:
                factor = inverse.to(converted.dtype)  # as the host path: multiplied in the optimizer's dtype
                converted = converted * factor if converted is grad else converted.mul_(factor)
            elif inverse != 1.0:
                converted = converted * inverse if converted is grad else converted.mul_(inverse)
            proxy.grad = converted
            proxies.append(proxy)
        return proxies

    def release_proxies(self, units: list) -> None:
        """Drop the proxies' gradients and the optimizer-dtype copies of `steps_on_copy` units (after a
        step, or when a step is skipped once they were prepared)."""
        for unit in units:
            if unit.steps_on_copy:
                unit.proxy.data = torch.empty(0, dtype=self.state_dtype, device=unit.weights.device)
            unit.proxy.grad = None

    def global_norm(self, units: list) -> torch.Tensor:
        """The L2 norm of the proxies' gradients over all ranks, counting each element once (on the device).

        Each slice's norm is taken in (at least) fp32 without a widened copy of the gradients; the
        squares add up in fp64."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for unit in units:
            grad = unit.proxy.grad
            if unit.counts_once() and grad.numel():
                norm = torch.linalg.vector_norm(grad, dtype=None if grad.dtype in _WIDE else torch.float32)
                total += norm.double().square().to(self.device)
        total = self.guard.with_writes(total)  # inf where the previous step wrote inf: one read for both
        if self.world_size > 1:
            dist.all_reduce(total)
        return total.sqrt()

    def clip(self, proxies: list[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
        """Scale every gradient by min(1, max_norm / norm), on the device: no host read there."""
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        # on the CPU reading it costs nothing, and a factor of exactly 1 (nothing clipped: most steps
        # once training settles) changes no bit, so that pass over every gradient is left out there
        # (a NaN factor, `nonfinite: off`, still multiplies); a capturable step reads nothing
        if self.capturable or coefficient.device.type != "cpu" or not float(coefficient) >= 1.0:
            for proxy in proxies:
                proxy.grad.mul_(coefficient.to(proxy.grad.device, proxy.grad.dtype))

    def overflowed(self, grads: list[torch.Tensor], norm: torch.Tensor | None = None) -> bool:
        """Whether any rank's gradients hold inf or nan, or its previous step wrote them (agreed by all ranks).

        Given the global norm that clipping takes anyway, the norm answers first: it is finite exactly
        when every gradient is (an inf or nan makes it inf or nan); a norm that is not finite (also
        reached from huge finite values) is checked element by element."""
        if norm is not None and not bool(nonfinite.read_flag(~torch.isfinite(norm))):
            return False
        return self.guard.any_overflow(grads)

    def found_nonfinite(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """A capturable step's overflow: 1.0 when any rank's gradients hold inf or nan or its previous step
        wrote them, else 0.0; 0-dim, fp32, on the device, agreed over the ranks; no host read.
        Torch's fused optimizers skip their update where it is 1 (their `found_inf`)."""
        flag = self.guard.device_flag(grads)
        self.skips += torch.stack([flag.reshape(()) > 0, flag.reshape(()) >= 2]).to(self.skips.dtype)
        return (flag > 0).to(torch.float32).reshape(())

    def read_skips(self) -> tuple[int, int]:
        """The steps a capturable step skipped so far, and how many of them for the previous step's
        writes (a host read; the engine's report makes it)."""
        skipped, for_writes = nonfinite.read_skip_counts(self.skips)
        return int(skipped), int(for_writes)

    # 3. After the step, taken or skipped.

    def record_writes(self, units: list, optimizer, step: int) -> None:
        """Flag (on the device) whether what this rank's step wrote holds inf or nan: its piece of the
        weights (in the model's dtype and as the master) and its optimizer states."""
        written = [t for unit in units for t in _own_writes(unit)]
        for unit in units:
            for _, state in optimizer.unit_states(unit):
                written += [value for value in state.values() if isinstance(value, torch.Tensor) and value.dim()]
        self.guard.record_writes(written, step)

    def after_skip(self, step: int) -> None:
        """A step skipped for inf or nan: the scale goes down, or (nonfinite: skip) a warning names the step."""
        if self.scaler is not None:
            self.scaler.update(True)
        else:
            # attributed to the caller of engine.step(), through Engine._optimizer_step and _skip_step
            warnings.warn(f"step {step} skipped: gradients hold inf or nan (nonfinite: skip)", stacklevel=5)

    def after_step(self, found: torch.Tensor | None = None) -> None:
        """A step taken: the scale may go up. A capturable step passes its device flag instead."""
        if self.scaler is not None:
            self.scaler.update(False if found is None else found)

    def check_learning_rates(self, param_groups: list[dict], lr_scheduler) -> None:
        """Refuse a learning rate that is not finite or beyond the range of the model's dtype: every step
        would write inf into the weights.

        Raises:
            ValueError: naming the group or the schedule's setting, the rate and the dtype's largest value.
        """
        largest, dtype = torch.finfo(self.compute_dtype).max, str(self.compute_dtype).removeprefix("torch.")
        # the groups' rates, those a schedule started from (base_lrs, initial_lr: the rate before its
        # warm-up), then its own (warmup_max_lr, max_lrs, ...), which it reaches later
        rates = [(f"param group {index}'s lr", group[key]) for index, group in enumerate(param_groups)
                 for key in ("initial_lr", "lr") if key in group]
        for name, value in (vars(lr_scheduler) if lr_scheduler is not None else {}).items():
            values = value if isinstance(value, (list, tuple)) else [value]
            if "lr" in name and name != "_last_lr":
                rates += [(f"param group {index}'s lr" if name == "base_lrs" else f"the schedule's {name}", lr)
                          for index, lr in enumerate(values)
                          if isinstance(lr, (int, float)) and not isinstance(lr, bool)]
        for what, lr in rates:
            if not math.isfinite(float(lr)) or abs(float(lr)) > largest:
                raise ValueError(f"{what} ({float(lr):g}) is beyond the range of the model's {dtype} "
                                 f"(largest {largest:.4g})")


def _own_writes(unit) -> list[torch.Tensor]:
    """What a unit's step writes on this rank: its weights, and its slice of the model's copy when the
    master is separate (a cast to fp16 can overflow where the fp32 master does not)."""
    if getattr(unit, "separate", False):
        return [unit.weights, unit.flat[unit.lo:unit.lo + unit.shard]]
    return [unit.weights]
