"""Optimizers whose update reads each parameter's shape (optim.shaped): Muon steps each matrix whole
at every ZeRO stage in one process, Adafactor's factored state survives a checkpoint, and stages that
cut parameters across ranks refuse them, naming why. Each against the same optimizer without the
engine (tests/optim/client.py), fp32, within RTOL/ATOL (bitwise across the checkpoint).
"""

import pytest
import torch
from torch import nn

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.client import LR, assert_same_model, client_engine, two_groups
from tests.optim.models import Net, config, engine_steps, reference_steps


class Matrices(nn.Module):
    """Only 2-D parameters, for Muon."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 5, bias=False))

    def forward(self, x):
        return self.layers(x), torch.zeros(())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_steps_each_matrix_whole(stage):
    reference = Matrices()
    reference_steps(reference, torch.optim.Muon(reference.parameters(), lr=LR), 2, 1, 2, 0.0)
    model = Matrices()
    engine, optimizer, _, _ = initialize(model=model, optimizer=torch.optim.Muon(model.parameters(), lr=LR),
                                         config=config(stage, clip=0.0, optimizer=None))
    assert optimizer.views is not None
    engine_steps(engine, 2, 0, 2)
    assert_same_model(engine, reference)


def test_adafactor_state_survives_a_checkpoint(tmp_path):
    straight = client_engine(torch.optim.Adafactor, 0, steps=3)
    first = client_engine(torch.optim.Adafactor, 0, steps=2)
    first.save_checkpoint(str(tmp_path), tag="two")
    model = Net()
    engine, *_ = initialize(model=model, optimizer=torch.optim.Adafactor(two_groups(model), lr=LR),
                            config=config(0, clip=0.0, optimizer=None))
    engine.load_checkpoint(str(tmp_path), tag="two")
    assert {name for state in engine.optimizer.optimizer.state.values() for name in state} >= {"row_var", "col_var"}
    engine_steps(engine, 1, 0, 2, first_step=2)
    got = dict(engine.module.named_parameters())
    for name, expected in straight.module.named_parameters():
        torch.testing.assert_close(got[name].detach(), expected.detach(), rtol=0, atol=0, msg=name)


def _shaped_refused(rank, world, stage):
    reset_groups()
    model = Net()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=rf"optimizer Adafactor reads each parameter's shape, but ZeRO stage {stage} "
                                         r"cuts parameters across ranks here; use stage 0"):
        initialize(model=model, optimizer=optimizer, config=config(stage, clip=0.0, optimizer=None))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_shape_reading_optimizer_is_refused_where_ranks_hold_slices(stage):
    run_distributed(_shaped_refused, 2, stage, timeout_s=120)
