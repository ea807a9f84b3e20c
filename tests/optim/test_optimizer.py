"""The engine's optimizer (optim.optimizer): a torch optimizer the user built, passed to `initialize`,
is taken as it is at every ZeRO stage (settings, state, hooks and schedule kept, expert groups split
off, unfit classes refused), and the wrapper `initialize` returns answers what scripts read of
DeepSpeed's.

Each check compares the engine with the same optimizer class stepping the same model without the
engine (tests/optim/client.py, on the one-process reference of tests.optim.models), fp32, within
RTOL/ATOL. Runs in one process but for the 2-process tests at the end. The optimizers that read each
parameter's shape (Muon, Adafactor's factored state) have their tests in test_shaped.py.
"""

import inspect

import pytest
import torch
from torch import nn

from optim import initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.client import ATOL, LR, RTOL, assert_same_model, client_engine, client_reference, two_groups
from tests.optim.models import Net, batch, config, engine_steps, loss_of, reference_steps

# every torch.optim class that takes params and lr, but the two the engine refuses (test below) and
# Muon, which takes 2-D parameters only (its own test, in test_shaped.py)
REFUSED = {"LBFGS", "SparseAdam"}
CLASSES = sorted(name for name, cls in vars(torch.optim).items()
                 if inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer
                 and "lr" in inspect.signature(cls.__init__).parameters and name not in REFUSED | {"Muon"})


@pytest.mark.slow
@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_torch_optimizer_steps_as_without_the_engine(name, stage):
    cls = getattr(torch.optim, name)
    assert_same_model(client_engine(cls, stage), client_reference(cls))


def test_the_client_optimizer_keeps_its_settings_and_splits_expert_groups():
    model = Net()
    optimizer = torch.optim.AdamW(two_groups(model), lr=LR, betas=(0.8, 0.9), weight_decay=0.3)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(2, clip=0.0, optimizer=None))
    groups = optimizer.param_groups
    assert [g["lr"] for g in groups if not g["moe"]] == [LR, LR / 2]  # dense: the two user groups
    assert all(g["betas"] == (0.8, 0.9) and g["weight_decay"] == 0.3 for g in groups)
    assert [g["lr"] for g in groups if g["moe"]] == [LR]  # the experts, out of the first group
    assert engine.optimizer.param_groups is groups and engine.get_lr() == [LR, LR, LR / 2]


def test_an_adamw_whose_defaults_its_constructor_does_not_take_is_used_as_it_is():
    # torch 2.13's AdamW lists decoupled_weight_decay among its defaults, which its constructor does not take
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(0, optimizer=None))
    engine_steps(engine, 1, 0, 2)
    assert engine.global_steps == 1


def test_state_taken_before_the_engine_is_kept():
    """One step without the engine, then one with it: equal to two steps without it."""
    reference = client_reference(torch.optim.Adam, steps=2)
    model = Net()
    optimizer = torch.optim.Adam(two_groups(model), lr=LR)
    reference_steps(model, optimizer, 1, 1, 2, 0.0)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(2, clip=0.0, optimizer=None))
    assert all(int(state["step"]) == 1 for state in optimizer.state.values())
    engine_steps(engine, 1, 0, 2, first_step=1)
    assert_same_model(engine, reference)


def test_a_lambda_schedule_built_before_initialize_follows_the_split_groups():
    """One user group holding dense and expert parameters becomes two: the schedule's lists follow."""
    lambdas = lambda step: 1.0 / (step + 1)  # noqa: E731
    model = Net()
    reference_optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambdas)
    for step in range(2):
        reference_steps(model, reference_optimizer, 1, 1, 2, 0.0, first_step=step)
        reference_scheduler.step()
    mine = Net()
    optimizer = torch.optim.SGD(mine.parameters(), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
    engine, *_ = initialize(model=mine, optimizer=optimizer, lr_scheduler=scheduler,
                            config=config(0, clip=0.0, optimizer=None))
    assert len(optimizer.param_groups) == 2 and len(scheduler.base_lrs) == len(scheduler.lr_lambdas) == 2
    engine_steps(engine, 2, 0, 2)
    assert engine.get_lr() == pytest.approx([LR / 3, LR / 3])
    assert_same_model(engine, model)


def test_a_schedule_built_on_the_optimizer_but_not_passed_is_warned_of():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.warns(UserWarning, match=r"the optimizer's 1 param group\(s\) became 2: .* must be passed as "
                                         r"initialize\(lr_scheduler=...\)"):
        initialize(model=model, optimizer=optimizer, config=config(0, optimizer=None))


class Scaled(nn.Module):
    """Net with a learnable scalar temperature first: a 0-dim parameter in the dense group."""

    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.net = Net()

    def forward(self, x):
        logits, l_aux = self.net(x)
        return logits * self.temperature, l_aux


def test_state_of_a_scalar_parameter_is_laid_out_per_element():
    models = []
    for engine_on in (False, True):
        torch.manual_seed(0)
        model = Scaled()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=LR, initial_accumulator_value=0.1)
        if engine_on:
            engine, *_ = initialize(model=model, optimizer=optimizer, config=config(2, clip=0.0, optimizer=None))
            engine_steps(engine, 2, 0, 2)
        else:
            reference_steps(model, optimizer, 2, 1, 2, 0.0)
        models.append(model)
    for (name, expected), got in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(got.detach(), expected.detach(), rtol=RTOL, atol=ATOL, msg=name)


def test_adopted_state_takes_the_optimizers_dtype_with_bf16_master_weights():
    model = Net()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR, initial_accumulator_value=0.1)
    engine, *_ = initialize(model=model, optimizer=optimizer, config={
        **config(2, clip=0.0, optimizer=None), "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
    assert all(u.steps_on_copy for u in engine.units)
    assert {optimizer.state[u.proxy]["sum"].dtype for u in engine.units} == {torch.float32}
    engine_steps(engine, 1, 0, 2)


def test_a_tensor_that_is_not_a_model_parameter_is_refused():
    model = Net()
    loss_weight = nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [loss_weight]}], lr=LR)
    with pytest.raises(ValueError, match=r"param group 1 holds a tensor of shape \[3\] that is not a parameter of the "
                                         r"model"):
        initialize(model=model, optimizer=optimizer, config=config(0, optimizer=None))


def test_stepping_the_returned_optimizer_outside_the_engine_fails():
    model = Net()
    engine, optimizer, _, _ = initialize(model=model, config=config(0))
    x, y = batch(0, 0, 0)
    loss_of(engine(x), y).backward()
    with pytest.raises(RuntimeError, match=r"call engine.step\(\) instead of optimizer.step\(\)"):
        optimizer.step()


def test_adagrad_state_made_in_its_constructor_is_laid_out_like_the_shards():
    # Adagrad fills its accumulators in __init__, so even a fresh one holds state
    model = Net()
    optimizer = torch.optim.Adagrad(two_groups(model), lr=LR, initial_accumulator_value=0.5)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(1, optimizer=None))
    for unit in engine.units:
        assert torch.equal(optimizer.state[unit.proxy]["sum"], torch.full_like(unit.weights, 0.5))


def test_a_scheduler_built_on_the_client_optimizer_before_initialize_drives_the_engine():
    reference = client_reference(torch.optim.SGD, momentum=0.9)
    model = Net()
    optimizer = torch.optim.SGD(two_groups(model), lr=LR, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    engine, _, _, returned = initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                        config=config(2, clip=0.0, optimizer=None))
    assert returned is scheduler
    engine_steps(engine, 1, 0, 2)
    assert engine.get_lr() == [LR / 2, LR / 2, LR / 4]
    model = Net()  # the reference with the same schedule
    reference_optimizer = torch.optim.SGD(two_groups(model), lr=LR, momentum=0.9)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=1, gamma=0.5)
    for step in range(2):
        reference_steps(model, reference_optimizer, 1, 1, 2, 0.0, first_step=step)
        reference_scheduler.step()
    engine_steps(engine, 1, 0, 2, first_step=1)
    assert_same_model(engine, model)
    del reference


class SignSGD(torch.optim.Optimizer):
    """A custom optimizer: p -= lr * sign(grad), with a per-parameter step counter."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])
                    self.state[p]["step"] = self.state[p].get("step", 0) + 1


@pytest.mark.parametrize("stage", [0, 3])
def test_a_custom_optimizer_subclass(stage):
    with pytest.warns(UserWarning, match=r"optimizer SignSGD is not a torch.optim class: .* its update must be "
                                         r"elementwise .* set zero_allow_untested_optimizer: true"):
        engine = client_engine(SignSGD, stage)
    assert_same_model(engine, client_reference(SignSGD))


def test_zero_allow_untested_optimizer_takes_a_custom_optimizer_without_a_warning(recwarn):
    model = Net()
    initialize(model=model, optimizer=SignSGD(model.parameters(), lr=LR),
               config={**config(0, optimizer=None), "zero_allow_untested_optimizer": True})
    assert not [w for w in recwarn if "not a torch.optim class" in str(w.message)]


def test_hooks_registered_on_the_client_optimizer_still_fire():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    calls = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    engine, wrapper, _, _ = initialize(model=model, optimizer=optimizer, config=config(0, optimizer=None))
    wrapper.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    engine_steps(engine, 1, 0, 2)
    assert calls == ["pre", optimizer]


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_optimizers_that_cannot_step_on_the_engines_shards_are_refused_by_name(name):
    model = nn.Linear(4, 4)
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match=rf"optimizer {name} cannot be used with the engine: it .*; use an elementwise"):
        initialize(model=model, optimizer=optimizer, config=config(0, optimizer=None))


def test_the_wrapper_answers_what_scripts_read_of_deepspeeds():
    model = Net()
    engine, wrapper, _, _ = initialize(model=model, config=config(0, fp16={"enabled": True, "initial_scale_power": 8}))
    assert isinstance(wrapper, torch.optim.Optimizer) and isinstance(wrapper.optimizer, torch.optim.AdamW)
    assert wrapper.loss_scale == wrapper.cur_scale == 256.0 == engine.loss_scale
    assert wrapper.state_dict()["param_groups"] == wrapper.optimizer.state_dict()["param_groups"]
    assert wrapper.param_groups is wrapper.optimizer.param_groups
    engine, wrapper, _, _ = initialize(model=Net(), config=config(0))
    assert wrapper.loss_scale == wrapper.cur_scale == 1.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(wrapper, lambda step: 0.5)  # a torch schedule on the wrapper
    assert engine.get_lr() == [0.005, 0.005]
    engine_steps(engine, 1, 0, 2)
    scheduler.step()


def _distributed_client(rank, world, stage, name, ep_size):
    reset_groups()
    cls = getattr(torch.optim, name)
    model = Net(ep_size=ep_size)
    optimizer = cls(two_groups(model), lr=LR)
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(stage, clip=0.0, optimizer=None))
    engine_steps(engine, 2, rank, 2)
    state = engine.consolidated_state_dict()
    if rank == 0:
        model = Net()
        reference = cls(two_groups(model), lr=LR)
        reference_steps(model, reference, 2, world, 2, 0.0)
        for key, expected in model.state_dict().items():
            torch.testing.assert_close(state[key], expected, rtol=RTOL, atol=ATOL, msg=key)


# Adafactor at ep 1: its RMS scale spans a stacked parameter's experts, so at ep 2 (two of the four
# experts per rank) its update differs from one process's by design, not by the engine
@pytest.mark.parametrize("stage,name,ep_size", [(1, "Adagrad", 2), (2, "AdamW", 2), (3, "RMSprop", 2),
                                                (0, "Adafactor", 1)])
@pytest.mark.slow
def test_client_optimizer_on_two_ranks(stage, name, ep_size):
    run_distributed(_distributed_client, 2, stage, name, ep_size, timeout_s=180)


def _local(full: torch.Tensor, name: str, rank: int) -> torch.Tensor:
    """This rank's piece of a one-process tensor: its two of four experts for stacked expert tensors."""
    return full[2 * rank:2 * rank + 2].clone() if ".experts." in name else full.clone()


def _pre_stepped(rank, world, stage):
    """The user's Adam after one step (the reference's, cut to this rank's experts), then one engine step."""
    reset_groups()
    reference = Net()
    reference_optimizer = torch.optim.Adam(two_groups(reference), lr=LR)
    reference_steps(reference, reference_optimizer, 1, world, 2, 0.0)
    after_one = {n: p.detach().clone() for n, p in reference.named_parameters()}
    states = {n: reference_optimizer.state[p] for n, p in reference.named_parameters()}
    model = Net(ep_size=2)
    optimizer = torch.optim.Adam(two_groups(model), lr=LR)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(_local(after_one[n], n, rank))
            optimizer.state[p] = {k: v.clone() if k == "step" else _local(v, n, rank) for k, v in states[n].items()}
    engine, *_ = initialize(model=model, optimizer=optimizer, config=config(stage, clip=0.0, optimizer=None))
    engine_steps(engine, 1, rank, 2, first_step=1)
    state = engine.consolidated_state_dict()
    reference_steps(reference, reference_optimizer, 1, world, 2, 0.0, first_step=1)
    if rank == 0:
        for key, expected in reference.state_dict().items():
            torch.testing.assert_close(state[key], expected, rtol=RTOL, atol=ATOL, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_held_before_initialize_is_sharded_on_two_ranks(stage):
    run_distributed(_pre_stepped, 2, stage, timeout_s=180)
