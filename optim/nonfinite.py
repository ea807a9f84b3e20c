"""The engine's watch over inf and nan: in the losses and gradients of a step, and in what a step wrote.

Everything is decided on the device and read on the host once per step (`read_flag`, the one place the
engine's step reads a device value): the flag of a step's gradients, max-reduced over the ranks, also
carries the previous step's writes, so a run that a too-large learning rate drove to inf (from finite
gradients) stops at the next step without a read of its own. The messages name the step, the ranks
and the last checkpoint, and are raised on every rank alike.
"""

import math

import torch
import torch.distributed as dist

__all__ = ["NonfiniteGuard", "nonfinite_flag", "read_flag", "read_skip_counts"]


def read_flag(flag: torch.Tensor) -> float:
    """A device flag's value read on the host (a sync); the one place the engine's step reads a device value."""
    return float(flag.item())


def read_skip_counts(counts: torch.Tensor) -> list[int]:
    """A capturable step's skip counters read on the host (a sync), when the engine reports, not in a step."""
    return [int(value) for value in counts.tolist()]


def nonfinite_flag(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """1.0 on `device` when any tensor holds inf or nan, else 0.0; no host read."""
    flag = torch.zeros(1, device=device)
    for tensor in tensors:
        if tensor.numel():  # min and max carry any nan or inf, without a temporary the size of the tensor
            low, high = torch.aminmax(tensor)
            finite = torch.isfinite(low) & torch.isfinite(high)
            flag = torch.maximum(flag, (~finite).to(flag.device, flag.dtype))
    return flag


class NonfiniteGuard:
    """What one rank knows of inf and nan in the current accumulation window and the last step's writes.

    Args:
        world_size: the data-parallel world size (collectives only above 1).
        device: where the flags live.
    """

    def __init__(self, world_size: int, device: torch.device):
        self.world_size, self.device = world_size, device
        self.losses_finite = None  # this window's losses were finite (on the device; read only to explain a stop)
        self.written = None  # the last step wrote inf or nan (a device flag), None until a watched step
        self.written_at = 0  # that step's number
        self.written_seen = False  # this step's read found the last step's writes bad on some rank

    def add_loss(self, loss: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).all()
        self.losses_finite = finite if self.losses_finite is None else self.losses_finite & finite

    def new_window(self) -> None:
        self.losses_finite = None

    def record_writes(self, tensors: list[torch.Tensor], step: int) -> None:
        """After a step: flag (on the device) whether what it wrote holds inf or nan."""
        self.written, self.written_at = nonfinite_flag(tensors, self.device), step

    def any_overflow(self, grads: list[torch.Tensor]) -> bool:
        """True when any rank's gradients hold inf or nan, or its previous step wrote them (agreed by all
        ranks): the step's one host read. The flag is 1 for gradients, 2 for the previous step's writes
        (`written_seen`), max-reduced: the writes, which stop the run, outrank the gradients."""
        self.written_seen = False
        value = read_flag(self.device_flag(grads))
        self.written_seen = value >= 2
        return bool(value)

    def device_flag(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """`any_overflow`'s flag left on the device (1 gradients, 2 the previous step's writes, max over
        the ranks), for a step that reads nothing on the host."""
        flag = nonfinite_flag(grads, self.device)
        if self.written is not None:
            flag = torch.maximum(flag, 2 * self.written)
        if self.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag

    def with_writes(self, squared_norm: torch.Tensor) -> torch.Tensor:
        """The squared gradient norm, made inf where the previous step wrote inf or nan: the norm's one read
        then answers for both."""
        if self.written is None:
            return squared_norm
        return torch.where(self.written.bool().squeeze(), torch.full_like(squared_norm, math.inf), squared_norm)

    def stop_if_writes_went_bad(self, learning_rates: list[float], last_checkpoint: str | None, saving: bool) -> None:
        """Raise FloatingPointError on every rank when some rank's last step wrote inf or nan (collective)."""
        mine = self.written is not None and bool(self.written.item())
        flags = self._gathered(mine)
        ranks = [rank for rank, bad in enumerate(flags) if bad]
        if not ranks:
            return
        raise FloatingPointError(
            f"step {self.written_at}: the optimizer step wrote inf or nan into the weights or optimizer states on "
            f"rank(s) {ranks} from finite gradients (is the learning rate, {', '.join(map(str, learning_rates))}, "
            f"far too large?); {'the checkpoint was not written' if saving else 'training stopped'}; last "
            f"checkpoint: {last_checkpoint or 'none'}")

    def stop_on_nonfinite(self, grads: list[torch.Tensor], step: int, last_checkpoint: str | None) -> None:
        """Raise FloatingPointError on every rank, naming the step, the ranks whose loss or gradients are
        not finite and the last checkpoint (collective)."""
        mine = (self.losses_finite is not None and not bool(self.losses_finite),
                any(bool((~torch.isfinite(g)).any()) for g in grads if g.numel()))
        flags = self._gathered(mine)
        losses = [r for r, (loss, _) in enumerate(flags) if loss]
        where = (f"the loss was inf or nan on rank(s) {losses}" if losses else
                 f"the gradients hold inf or nan on rank(s) {[r for r, (_, grad) in enumerate(flags) if grad]}")
        raise FloatingPointError(
            f"step {step}: {where} (diverged? lower the learning rate); the weights were not changed; last "
            f"checkpoint: {last_checkpoint or 'none'}. "
            'Set "nonfinite": "skip" in the engine config to skip such steps instead')

    def _gathered(self, mine) -> list:
        flags = [mine]
        if self.world_size > 1:
            flags = [None] * self.world_size
            dist.all_gather_object(flags, mine)
        return flags
