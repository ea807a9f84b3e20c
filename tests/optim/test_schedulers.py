"""optim.schedulers, DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR,
OneCycle with its momentum, LRRangeTest), step by step against their formulas worked out by hand."""

import math

import pytest
import torch

from optim.schedulers import build_scheduler


def _lrs(name, params, steps, lr=0.1):
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    schedule = build_scheduler(name, optimizer, params)
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs, optimizer


def test_schedules_follow_deepspeed_formulas():
    lrs, _ = _lrs("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1.0, "warmup_num_steps": 4}, 6)
    assert lrs == pytest.approx([0, 0, math.log(2) / math.log(4), math.log(3) / math.log(4), 1, 1, 1])
    lrs, _ = _lrs("WarmupDecayLR", {"total_num_steps": 8, "warmup_max_lr": 1.0, "warmup_num_steps": 4,
                                    "warmup_type": "linear"}, 9)
    assert lrs == pytest.approx([0, 0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0])
    lrs, _ = _lrs("WarmupCosineLR", {"total_num_steps": 6, "warmup_num_steps": 2, "cos_min_ratio": 0.0,
                                     "warmup_type": "linear"}, 6, lr=2.0)
    assert lrs == pytest.approx([0, 0, 1.0, 2 * (1 + math.cos(math.pi / 4)) / 2, 1.0, 2 * (1 + math.cos(3 * math.pi / 4)) / 2, 0])
    lrs, optimizer = _lrs("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 2,
                                       "cycle_min_mom": 0.8, "cycle_max_mom": 0.9}, 5)
    assert lrs == pytest.approx([0.1, 0.3, 0.5, 0.3, 0.1, 0.1])
    assert optimizer.param_groups[0]["betas"][0] == pytest.approx(0.9)
    lrs, _ = _lrs("LRRangeTest", {"lr_range_test_min_lr": 0.1, "lr_range_test_step_size": 2,
                                  "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": True}, 4)
    assert lrs == pytest.approx([0.1, 0.1, 0.2, 0.2, 0.3])
