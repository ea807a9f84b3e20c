"""Autocast as seen by the MoE layer: where it is on, and switching it off for the fp32 router.

torch.autocast exists for a few device types only; asking about another (meta, in the simulated
GPU world) raises, so these helpers answer "off" there.
"""

import contextlib

import torch

__all__ = ["autocast_dtype", "no_autocast"]

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes in on `device` now, None when it is off."""
    if device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def no_autocast(device: torch.device):
    """A context that turns autocast off for `device` (a no-op where it is off)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
