"""The user's own optimizer beside the engine, for the optimizer tests: two param groups as scripts
pass them, the engine stepping that optimizer, and the same optimizer class stepping the same model
without the engine (the one-process reference of tests.optim.models)."""

import torch

from optim import initialize
from tests.optim.models import Net, config, engine_steps, reference_steps

RTOL, ATOL = 1e-5, 1e-6
LR = 0.01


def two_groups(model):
    """Two groups with their own settings (the router's weight decayed less), as scripts pass them."""
    router = [p for n, p in model.named_parameters() if "gate" in n]
    rest = [p for n, p in model.named_parameters() if "gate" not in n]
    return [{"params": rest}, {"params": router, "lr": LR / 2}]


def client_reference(cls, steps=2, accumulation=2, clip=0.0, **kwargs):
    """Net after `steps` steps of optimizer class `cls` on two_groups, without the engine."""
    model = Net()
    optimizer = cls(two_groups(model), lr=LR, **kwargs)
    reference_steps(model, optimizer, steps, 1, accumulation, clip)
    return model


def client_engine(cls, stage, steps=2, accumulation=2, clip=0.0, **kwargs):
    """An engine at ZeRO `stage` after `steps` steps of the user's `cls` optimizer, taken as it is."""
    model = Net()
    optimizer = cls(two_groups(model), lr=LR, **kwargs)
    engine, returned, _, _ = initialize(model=model, optimizer=optimizer,
                                        config=config(stage, accumulation, clip, optimizer=None))
    assert returned is engine.optimizer and returned.optimizer is optimizer
    engine_steps(engine, steps, 0, accumulation)
    return engine


def assert_same_model(engine, reference):
    """Every parameter of the engine's module equals the reference model's, fp32, within RTOL/ATOL."""
    got = dict(engine.module.named_parameters())
    for name, expected in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), expected.detach(), rtol=RTOL, atol=ATOL, msg=name)
