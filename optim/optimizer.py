"""The optimizer the engine steps: built from the config, or the user's own, and DeepSpeed's wrapper view.

The engine's optimizer steps on the ZeRO units' proxies (`optim.zero`): flat shards of each param
group's master weights. It comes from one of three places:

- the config's `optimizer` block (Adam, AdamW or SGD, DeepSpeed's key names);
- a callable the user passes, called with the engine's param groups;
- a `torch.optim.Optimizer` the user built over the model's parameters. It is taken as it is, not
  rebuilt: its param groups are re-pointed at the proxies (each group's settings kept, expert
  parameters split into their own groups) and any state it holds is laid out like the proxies. Its
  hooks, its class and any scheduler built on it stay valid. Flat shards suit optimizers whose update
  is elementwise (torch.optim's, and custom subclasses written the same way); Adafactor and Muon,
  whose updates read each parameter's shape, step on per-parameter views (`optim.shaped`); LBFGS and
  SparseAdam (`_UNFIT`) are refused.

The engine's param groups start from the user's (`user_param_groups`: the optimizer's, or
`model_parameters`), with expert parameters split into groups of their own (`split_expert_groups`).

`ZeroOptimizer` is what `initialize` returns and `engine.optimizer` is: a torch `Optimizer` that
forwards to the optimizer above and answers what scripts read of DeepSpeed's ZeRO wrapper
(`.optimizer`, `.loss_scale`, `.cur_scale`, `.overflow`).
"""

import warnings
from collections import defaultdict

import torch

from optim.config import ConfigTypeError, EngineConfig, accepted_params, check_params
from optim.shaped import ShapedViews, shaped
from parallel import split_group

__all__ = ["ZeroOptimizer", "build_optimizer", "check_client_optimizer", "follow_split", "optimizer_params",
           "split_expert_groups", "user_param_groups"]

_OPTIMIZERS = {"adam": torch.optim.AdamW, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_FUSED_DEVICES = {"cpu", "cuda", "xpu"}  # where torch's fused Adam and AdamW run (not meta)

# torch.optim classes whose step cannot run on the engine's shards, and why.
_UNFIT = {
    "LBFGS": "needs a closure that re-evaluates the loss at each step, and engine.step() takes none",
    "SparseAdam": "steps on sparse gradients only, and the engine reduces dense ones",
}


def optimizer_params(kind: str) -> set[str]:
    """The config keys optimizer.params takes for the optimizer type `kind` (Adam, AdamW or SGD, any case)."""
    kind = kind.lower()
    classes = (torch.optim.AdamW, torch.optim.Adam) if kind == "adam" else (_OPTIMIZERS[kind],)
    taken = set().union(*(accepted_params(cls.__init__, {"self", "params"}) for cls in classes))
    return taken | ({"adam_w_mode", "torch_adam"} if kind == "adam" else set())


def check_client_optimizer(optimizer, allow_untested: bool) -> None:
    """Refuse, before any work, a torch optimizer whose step cannot run on the engine's flat shards; warn
    of one that is not torch's, unless the config's `zero_allow_untested_optimizer` is true.

    Raises:
        ValueError: naming the class and the reason.
    """
    for cls in type(optimizer).__mro__:
        if cls.__module__.startswith("torch.optim") and cls.__name__ in _UNFIT:
            raise ValueError(f"optimizer {type(optimizer).__name__} cannot be used with the engine: it "
                             f"{_UNFIT[cls.__name__]}; use an elementwise optimizer (AdamW, Adam, SGD, RMSprop, ...)")
    if not type(optimizer).__module__.startswith("torch.optim") and not allow_untested:
        warnings.warn(f"optimizer {type(optimizer).__name__} is not a torch.optim class: the engine steps it on flat "
                      "shards that join each group's parameters, so its update must be elementwise (a norm per "
                      "parameter, as LAMB or LARS take, would span several); set zero_allow_untested_optimizer: "
                      "true in the config once it is", stacklevel=4)


def user_param_groups(model: torch.nn.Module, model_parameters, optimizer) -> list[dict]:
    """The user's param groups (dicts): the optimizer's when one was given, else from model_parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = optimizer.param_groups
    elif model_parameters is None:
        groups = [{"params": [p for p in model.parameters() if p.requires_grad]}]
    else:
        items = list(model_parameters)
        groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    return [dict(g, params=list(g["params"])) for g in groups]


def split_expert_groups(groups: list[dict], infos: dict, model: torch.nn.Module) -> tuple[list[dict], list[int]]:
    """Each group's trainable dense parameters (flagged moe=False), then its expert groups (parallel.split_group);
    and for each group made, the index of the user's group it came from.

    Raises:
        ValueError: a group holds a tensor that is not a parameter of the model.
    """
    known = {id(p) for p in model.parameters()}
    out, origins = [], []
    for index, group in enumerate(groups):
        stray = next((p for p in group["params"] if id(p) not in known), None)
        if stray is not None:
            raise ValueError(f"param group {index} holds a tensor of shape {list(stray.shape)} that is not a parameter "
                             "of the model; the engine trains the model's parameters only")
        dense, experts = split_group({**group, "params": [p for p in group["params"] if id(p) in infos]})
        made = ([{**dense, "moe": False}] if dense["params"] else []) + experts
        out += made
        origins += [index] * len(made)
    return out, origins


def build_optimizer(config: EngineConfig, optimizer, groups: list[dict], units_by_group: list[list],
                    client_state: dict | None = None) -> tuple[torch.optim.Optimizer, ShapedViews | None]:
    """The torch optimizer stepping on the units' proxies (or, for Adafactor and Muon, on per-parameter
    views of them: the second value, else None).

    Args:
        config: the engine config (its `optimizer` block is read when `optimizer` is None).
        optimizer: the user's torch optimizer, a callable taking param groups, or None.
        groups: the engine's param groups: the user's settings, `params` a list of ParamInfo.
        units_by_group: the units holding each group's parameters.
        client_state: the user's optimizer's state by `id(ParamInfo)`, read before the engine moved
            or sharded the parameters.
    """
    units = [u for group_units in units_by_group for u in group_units]
    views = ShapedViews(units, type(optimizer).__name__) if shaped(optimizer) else None
    proxy_groups = [{**{k: v for k, v in g.items() if k != "params"},
                     "params": [v for u in group_units for _, v in views.of(u)] if views else [u.proxy for u in group_units]}
                    for g, group_units in zip(groups, units_by_group)]
    if isinstance(optimizer, torch.optim.Optimizer):
        return _adopt(optimizer, proxy_groups, units, client_state or {}, views), views
    if callable(optimizer):
        return optimizer(proxy_groups), None
    if config.optimizer is None:
        raise ValueError("no optimizer: pass optimizer= to initialize or set the config key optimizer")
    return _from_config(config, proxy_groups), None


def _from_config(config: EngineConfig, groups: list[dict]) -> torch.optim.Optimizer:
    params = dict(config.optimizer.params)
    kind = config.optimizer.type.lower()
    if kind == "adam":
        for key in ("adam_w_mode", "torch_adam"):  # DeepSpeed's own, not torch's: checked here
            if not isinstance(params.get(key, True), bool):
                raise ConfigTypeError(f"optimizer.params.{key} for {config.optimizer.type} must be true or false, "
                                      f"got {type(params[key]).__name__} {params[key]!r}")
        cls = torch.optim.AdamW if params.pop("adam_w_mode", True) else torch.optim.Adam
        params.pop("torch_adam", None)
    else:
        cls = _OPTIMIZERS[kind]
    check_params("optimizer.params", config.optimizer.type, cls.__init__, params, {"self", "params"})
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if cls is not torch.optim.SGD and "fused" not in params and "foreach" not in params:
        # torch's fused Adam(W) steps every shard in one pass without temporaries, where its default
        # steps tensor by tensor. Not SGD: torch 2.13's fused CPU SGD with momentum drifts far from the
        # loop in bf16/fp16.
        devices = {p.device.type for group in groups for p in group["params"]}
        params["fused"] = devices <= _FUSED_DEVICES
    return cls(groups, **params)


def _adopt(optimizer: torch.optim.Optimizer, groups: list[dict], units: list, old_state: dict,
           views: ShapedViews | None) -> torch.optim.Optimizer:
    """The user's optimizer, its param groups replaced by `groups` and its state laid out like what it steps."""
    optimizer.param_groups = []
    optimizer.state = defaultdict(dict)
    for group in groups:
        optimizer.add_param_group(group)
    if views is not None:
        views.hook(optimizer)
        for unit in units:  # each view is its parameter whole: its state is the parameter's as it was
            for info, view in views.of(unit):
                if old_state.get(id(info)):
                    optimizer.state[view] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                             for k, v in old_state[id(info)].items()}
        return optimizer
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    for unit in units:
        group = group_of[id(unit.proxy)]
        # fused and capturable steps keep their counters beside the weights, the others on the host
        counters = unit.weights.device if group.get("fused") or group.get("capturable") else None
        state = _unit_state(unit, old_state, counters)
        if state:
            optimizer.state[unit.proxy] = state
    return optimizer


def _unit_state(unit, old_state, counters: torch.device | None) -> dict:
    """The state the user's optimizer held for a unit's parameters, as one state for its proxy.

    A tensor shaped like its parameter is elementwise: its pieces are laid out as the unit lays out
    the weights. Anything else (a step count) must be equal for every parameter of the unit.

    Raises:
        ValueError: some of the unit's parameters have state and others none, or their counters differ.
    """
    held = [(info, old_state.get(id(info))) for info in unit.infos]
    with_state = [(info, state) for info, state in held if state]
    if not with_state:
        return {}
    if len(with_state) != len(held):
        bare = next(info.name for info, state in held if not state)
        raise ValueError(f"the optimizer holds state for some parameters of a group but none for {bare}; "
                         "step it on every parameter of a group, or pass it before its first step")
    merged = {}
    for name, first in with_state[0][1].items():
        if _elementwise(name, with_state):
            # the proxy's dtype is the optimizer's (an empty proxy, with steps_on_copy, still has it)
            value = torch.zeros(unit.weights.shape, dtype=unit.proxy.dtype, device=unit.weights.device)
            by_info = {id(info): state[name] for info, state in with_state}
            for info, offsets, view in unit.boxes(value):
                piece = by_info[id(info)][tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]
                view.copy_(piece)
        else:
            for info, state in with_state[1:]:
                if not _same(state.get(name), first):
                    raise ValueError(f"optimizer state {name!r} differs between {with_state[0][0].name} and "
                                     f"{info.name}, which the engine steps as one shard; pass the optimizer "
                                     "before its first step")
            value = first.clone() if isinstance(first, torch.Tensor) else first
            if isinstance(value, torch.Tensor) and counters is not None:
                value = value.to(counters)
        merged[name] = value
    return merged


_COUNTERS = ("step", "eta", "mu")  # torch.optim's per-parameter scalars that are not per element (ASGD's eta, mu)


def _elementwise(name: str, with_state: list) -> bool:
    """Whether state `name` holds a value per element: shaped like its parameter, for a parameter with
    dimensions; for scalar parameters alone, unless torch names it a counter."""
    shaped = [(info, state.get(name)) for info, state in with_state if info.param.dim() >= 1]
    if not shaped:
        return name not in _COUNTERS and all(isinstance(state.get(name), torch.Tensor) for _, state in with_state)
    return all(isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(info.param.shape)
               for info, value in shaped)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    return a == b


def follow_split(optimizer: torch.optim.Optimizer, scheduler, origins: list[int], user_groups: int) -> None:
    """Give a torch schedule built on the user's optimizer before `initialize` one value per engine group.

    The engine splits a group holding dense and expert parameters in two; a schedule keeps lists with
    one entry per group (base_lrs, lr_lambdas, ...), each now repeated for every group made from it.
    A torch schedule built on the optimizer but not passed to `initialize` gets a warning saying what to do.

    Args:
        optimizer: the user's optimizer, its groups already the engine's.
        scheduler: the schedule passed to initialize (any kind), or None.
        origins: for each engine group, the index of the user's group it came from.
        user_groups: how many groups the user's optimizer had.
    """
    schedules = [scheduler] if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) \
        and scheduler.optimizer is optimizer else []
    if not schedules and hasattr(optimizer.step, "_wrapped_by_lr_sched"):  # torch schedules mark the step they watch
        warnings.warn(f"the optimizer's {user_groups} param group(s) became {len(origins)}: expert parameters "
                      "are split into groups of their own (moe.split_params_into_different_moe_groups_for_optimizer "
                      "makes them before the optimizer); a torch schedule built on the optimizer must be passed "
                      "as initialize(lr_scheduler=...) to follow", stacklevel=4)
    while schedules:
        schedule = schedules.pop()
        schedules += [s for s in getattr(schedule, "_schedulers", []) if s.optimizer is optimizer]
        for name, value in vars(schedule).items():
            if isinstance(value, list) and len(value) == user_groups and name != "_schedulers":
                setattr(schedule, name, [value[i] for i in origins])


class ZeroOptimizer(torch.optim.Optimizer):
    """The engine's optimizer as scripts see it (DeepSpeed's ZeRO optimizer wrapper).

    It forwards to the torch optimizer that steps on this rank's shards: `param_groups`, `state`,
    `defaults`, `state_dict()`, `load_state_dict()`, `step()` and its hooks are that optimizer's, so a
    torch or DeepSpeed learning-rate schedule built on either steps the same groups.

    Attributes:
        optimizer: the torch optimizer (the user's own when one was passed to `initialize`).
        views: for Adafactor and Muon, the per-parameter views they step on (optim.shaped), else None.
        loss_scale, cur_scale: the fp16 loss scale (1.0 without fp16).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, views: ShapedViews | None, engine):
        # no super().__init__: it holds nothing of its own
        self.optimizer = optimizer
        self.views = views
        self._engine = engine
        self._stepping = False  # set by the engine around its own call of step()

    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, value: setattr(self.optimizer, "param_groups", value))
    state = property(lambda self: self.optimizer.state, lambda self, value: setattr(self.optimizer, "state", value))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, value: setattr(self.optimizer, "defaults", value))

    @property
    def loss_scale(self) -> float:
        return self._engine.loss_scale

    cur_scale = loss_scale

    def unit_states(self, unit) -> list[tuple[list, dict]]:
        """The optimizer's state for a unit, as (the ParamInfos it covers, state) pairs: one pair for the
        unit's flat proxy, or one per parameter where the optimizer steps on views."""
        if self.views is None:
            return [(unit.infos, self.optimizer.state.get(unit.proxy, {}))]
        return [([info], self.optimizer.state.get(view, {})) for info, view in self.views.of(unit)]

    @property
    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow, or nonfinite: skip)."""
        return self._engine.was_step_skipped()

    def step(self, closure=None):
        """The engine's step on this rank's shards; called by `engine.step()`, not by scripts.

        Raises:
            RuntimeError: called from outside the engine, where the shards have no gradients.
        """
        if not self._stepping:
            raise RuntimeError("the engine's optimizer steps inside engine.step(), which reduces the gradients "
                               "into the shards first; call engine.step() instead of optimizer.step()")
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the engine's accumulated gradients (as `engine.zero_grad()`)."""
        self._engine.zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("the engine's param groups are fixed at initialize; pass every group to initialize")

    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self):
        raise TypeError("the engine's optimizer holds the engine and cannot be pickled or copied; save "
                        "engine.save_checkpoint(...) or optimizer.optimizer.state_dict()")

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"
