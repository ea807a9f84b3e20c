"""The training engine: `initialize(model, config=...)` and the `Engine` it returns.

The engine coordinates pieces usable alone and answers DeepSpeed's queries: the parsed config
(`optim.config`); the precision (`optim.precision`: dtypes, the fp16 loss scale, the gradient factor
and the inf/nan watch); the ZeRO stage (`optim.stages`) whose units hold parameters, gradients and
master weights (`optim.zero`), stage 3 through torch's `fully_shard`; a plain torch optimizer
stepping on the units' shards (`optim.optimizer`); DeepSpeed's schedules (`optim.schedulers`); and
checkpoints (`optim.checkpoint`); and the report after each step (`optim.monitor.StepReport`:
TensorBoard and the progress line). What it keeps itself: the step counters and the order of a
training step.
"""

import os
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from optim import checkpoint
from optim.buckets import release_hooks
from optim.capturable import CapturableStep, capture_problems
from optim.config import EngineConfig, parse_config
from optim.memory import model_state_bytes
from optim.monitor import StepReport
from optim.optimizer import (
    ZeroOptimizer, build_optimizer, check_client_optimizer, follow_split, split_expert_groups, user_param_groups,
)
from optim.precision import Precision, PrecisionConfig
from optim.schedulers import build_scheduler
from optim.stages import broadcast_initial_state, build_stage, offload_wanted
from optim.zero import describe_parameters
from parallel import data_before_expert, groups_for_name, init_distributed, local_device
from parallel.distributed import TORCHRUN_VARIABLES

__all__ = ["Engine", "initialize"]


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Engine:
    """A model trained with ZeRO, mixed precision and checkpoints; built by `initialize`.

    Attributes:
        module: the wrapped model.
        optimizer: a `ZeroOptimizer` around the torch optimizer stepping on this rank's master-weight shards.
        lr_scheduler: the schedule, or None.
        global_steps: optimizer steps taken (skipped fp16 steps included, as in DeepSpeed).
        micro_steps: micro-batches seen.
        monitor: with `tensorboard.enabled`, rank 0's `optim.Monitor` (None elsewhere); each optimizer
            step writes loss, lr, loss scale, step time and the MoE layers' routing statistics, and
            callers may add their own scalars (validation loss, tokens/s) through it.
        precision: the dtypes, loss scale and inf/nan watch (`optim.precision.Precision`); its
            `compute_dtype`, `master_dtype`, `state_dtype` and `scaler` are the engine's too.
        zero: the ZeRO stage (`optim.stages`); its `units` are the engine's.
    """

    def __init__(self, model: nn.Module, config: EngineConfig, model_parameters=None, optimizer=None,
                 lr_scheduler=None):
        self.config = config
        self.world_size, self.rank = _distributed()
        self.stage = config.zero_optimization.stage
        self.accumulation = config.gradient_accumulation_steps
        self.device = local_device()
        self.module = model.to(self.device)
        self.global_steps = self.micro_steps = self.skipped_steps = 0
        self._grad_norm = None  # the last step's global gradient norm before clipping, on the device
        self._skipped_last = False
        self.last_checkpoint: str | None = None  # the folder of the last checkpoint saved or loaded
        self.precision = precision = Precision(PrecisionConfig.from_engine(config), self.world_size, self.device)
        self.compute_dtype, self.master_dtype = precision.compute_dtype, precision.master_dtype
        self.state_dtype, self.scaler = precision.state_dtype, precision.scaler
        self.offload = offload_wanted(config.zero_optimization, self.device)
        release_hooks(self.module.parameters())  # an earlier engine's stage-2 hooks must not take our gradients
        broadcast_initial_state(self.module, self.world_size, self.device)
        infos = describe_parameters(
            self.module, lambda param: groups_for_name(param.group_name, data_before_expert(param)).ep_rank)
        client = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        if client is not None:
            check_client_optimizer(client, config.zero_allow_untested_optimizer)
        user_groups = user_param_groups(self.module, model_parameters, optimizer)
        groups, origins = split_expert_groups(user_groups, infos, self.module)
        groups = [dict(g, params=[infos[id(p)] for p in g["params"]]) for g in groups]
        client_state = {id(info): client.state.get(info.param) for info in infos.values()} \
            if client is not None else None
        self.zero = build_stage(config.zero_optimization, self.module, infos, groups, precision, self.offload,
                                self.world_size, self.rank, self.device, self.is_gradient_accumulation_boundary)
        self.units = self.zero.units
        self.optimizer = ZeroOptimizer(*build_optimizer(config, optimizer, groups, self.zero.units_by_group,
                                                        client_state), engine=self)
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        precision.check_learning_rates(self.optimizer.param_groups, self.lr_scheduler)
        if client is not None and origins != list(range(len(user_groups))):
            follow_split(client, self.lr_scheduler, origins, len(user_groups))
        self._report = StepReport(config, self.module, self.device, self.rank)
        self.monitor = self._report.monitor
        # Routers that keep state across steps (an expert bias, the step's counts) advance after each step:
        # any module with an update_routing(skipped=...) method (the MoE layer's gate has one).
        self._routers = [m for m in self.module.modules() if callable(getattr(m, "update_routing", None))]
        self.capturable: CapturableStep | None = None  # set_capturable's split step

    def _build_scheduler(self, lr_scheduler):
        if lr_scheduler is not None:
            return lr_scheduler(self.optimizer) if callable(lr_scheduler) and not hasattr(lr_scheduler, "step") \
                else lr_scheduler
        if self.config.scheduler is None:
            return None
        return build_scheduler(self.config.scheduler.type, self.optimizer, dict(self.config.scheduler.params))

    # Training.

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without fp16)."""
        return self.precision.loss_scale

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Run the model on inputs moved to its device (floating ones cast to the fp16/bf16 compute dtype);
        outputs get the gradient factor (optim.precision)."""
        start = time.perf_counter()
        self._report.forward_started(start, self.module.training)
        args, kwargs = tree_map(lambda value: self.precision.cast_input(value, self.device), (args, kwargs))
        with self.precision.autocast(self.device.type):
            output = self.module(*args, **kwargs)
        self.zero.after_forward(self.module)
        self._report.forward_ran(self.module.training)
        if torch.is_grad_enabled():
            output = self.precision.scale_outputs(output)
        self._report.add_time("forward", start)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """loss.backward() with the loss scale and the 1 / gradient_accumulation_steps factor applied."""
        start = time.perf_counter()
        self.precision.backward(loss, retain_graph)
        self._report.add_loss(loss)
        self._report.add_time("backward", start)

    @property
    def last_routing_stats(self) -> list:
        """The last reported optimizer step's per-layer routing (optim.monitor.LayerStats), with TensorBoard."""
        return self._report.last_routing_stats

    def flush_report(self) -> None:
        """Read and write the statistics a capturable step queued (`set_capturable`) now; with the usual
        step every step is written at once and this does nothing."""
        if self.capturable is not None:
            self.capturable.check_skips()
            self._report.flush()

    def set_capturable(self, report_every: int = 10) -> None:
        """Make every optimizer step read nothing on the host, so that a CUDA graph can capture it
        (`optim.graphs`); TensorBoard's statistics are then read every `report_every` steps, and what
        else differs is in `optim.capturable`.

        Raises:
            ValueError: naming each setting that keeps the step from it.
        """
        problems = capture_problems(self)
        if problems:
            raise ValueError("the engine's step cannot run without host reads: " + "; ".join(problems))
        if self.capturable is None:
            self.precision.set_capturable(True)
            self.capturable = CapturableStep(self, report_every)

    def step(self) -> None:
        """Count a micro-batch; at the accumulation boundary reduce, check, clip and step."""
        start = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        self.zero.micro_step(boundary)
        self.micro_steps += 1
        if boundary and self.capturable is not None:
            self.capturable.run()
            if not self.capturable.holding:
                self.capturable.finish()
        elif boundary:
            self._optimizer_step()
            self.global_steps += 1
            self._report.step_done(self.global_steps, self.skipped_steps, self.get_lr(), self.loss_scale,
                                   self.memory_breakdown)
        self._report.add_time("step", start)

    def _optimizer_step(self) -> None:
        """1. reduce; 2. look for inf and nan; 3. skip, or unscale, clip and step; 4. write back and advance."""
        precision, clipping = self.precision, self.config.gradient_clipping > 0
        self._grad_norm = None
        grads = self.zero.reduce(self.module)
        proxies = None
        if precision.watch and clipping:  # the norm clipping takes anyway answers the check first
            proxies = precision.prepare_proxies(self.units, grads)
            self._grad_norm = precision.global_norm(self.units)
            self._skipped_last = precision.overflowed(grads, self._grad_norm)
        else:
            self._skipped_last = precision.watch and precision.overflowed(grads)
        if self._skipped_last:
            self._skip_step(grads)
            return
        if proxies is None:
            proxies = precision.prepare_proxies(self.units, grads)
        if clipping:
            if self._grad_norm is None:
                self._grad_norm = precision.global_norm(self.units)
            precision.clip(proxies, self._grad_norm, self.config.gradient_clipping)
        self.optimizer._stepping = True
        try:
            self.optimizer.step()
        finally:
            self.optimizer._stepping = False
        self.zero.write_back()
        if precision.watch:  # finite gradients can still overflow what the step writes (a learning rate far too large)
            precision.record_writes(self.units, self.optimizer, self.global_steps + 1)
        precision.release_proxies(self.units)
        self.zero_grad()
        self._update_routers(skipped=False)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        precision.after_step()

    def _skip_step(self, grads: list[torch.Tensor]) -> None:
        """A step whose gradients (or the last step's writes) hold inf or nan: stop, or count it and go on."""
        self._grad_norm = None  # no norm is reported for a skipped step
        self.precision.release_proxies(self.units)
        if self.precision.guard.written_seen:  # the previous step's writes: they cannot be skipped
            self._stop_if_writes_went_bad(saving=False)
        if self.precision.stops_on_nonfinite:
            try:
                self.precision.guard.stop_on_nonfinite(grads, self.global_steps + 1, self.last_checkpoint)
            finally:  # the flags are read first; then the window's gradients and routing counts go
                self.zero_grad()
                self._update_routers(skipped=True)
        self.skipped_steps += 1
        self.precision.after_skip(self.global_steps + 1)
        self.zero_grad()
        self._update_routers(skipped=True)

    def _update_routers(self, skipped: bool) -> None:
        """Advance every router's balancing state (the expert bias from the step's global counts): collective."""
        for router in self._routers:
            router.update_routing(skipped=skipped)

    def _stop_if_writes_went_bad(self, saving: bool) -> None:
        """Raise on every rank when some rank's last step wrote inf or nan (collective)."""
        learning_rates = sorted({group["lr"] for group in self.optimizer.param_groups})
        try:
            self.precision.guard.stop_if_writes_went_bad(learning_rates, self.last_checkpoint, saving)
        except FloatingPointError:
            self.zero_grad()
            raise

    def zero_grad(self) -> None:
        """Clear accumulated gradients (buffers are kept and zeroed)."""
        self.precision.guard.new_window()
        self.zero.zero_grad()

    # DeepSpeed's engine queries, so its scripts run unchanged.

    @property
    def local_rank(self) -> int:
        """This process's rank on its node: LOCAL_RANK as an int, 0 without it."""
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole world (`rank`)."""
        return self.rank

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def zero_optimization_stage(self) -> int:
        return self.stage

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks (the config's, resolved)."""
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.accumulation

    def get_global_grad_norm(self) -> float | None:
        """The last optimizer step's L2 norm of all gradients over all ranks, before clipping and unscaled.

        The norm is the one gradient clipping computes on the device; this reads it (a host sync when
        called, none in the step). Without gradient clipping the step computes no norm (it would cost a
        collective every step), so the answer is None, as DeepSpeed's is where its norm computation is off.

        Returns:
            The norm as a float; None before the first step, after a skipped step, or without clipping.
        """
        return None if self._grad_norm is None else float(self._grad_norm.item())

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accumulation == 0

    def was_step_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (an fp16 overflow, or non-finite gradients with nonfinite: skip);
        after a capturable step, a read of its device flag."""
        if self.capturable is not None:
            return self.capturable.found is not None and bool(self.capturable.found)
        return self._skipped_last

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    # Memory and state.

    def memory_breakdown(self) -> dict:
        """This rank's bytes of model states: parameters, gradients and optimizer states (optim.memory).

        Returns:
            {"parameters", "gradients", "optimizer_states", "total"} in bytes, and the same three for
            "dense" and "expert" parameters separately.
        """
        return model_state_bytes(self.units, self.optimizer, self.module)

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Save model, optimizer, scheduler, scaler, counters and RNG states atomically (collective).

        Returns:
            the checkpoint's directory.

        Raises:
            FloatingPointError: the last step wrote inf or nan into the weights or optimizer states
                (nothing is written; the message names the last checkpoint).
        """
        self.zero.settle(self.module)
        self.flush_report()  # a capturable step's skipped steps and statistics, read before saving
        if self.precision.guard.written is not None:  # never a checkpoint of weights that are not finite
            self._stop_if_writes_went_bad(saving=True)
        self.last_checkpoint = checkpoint.save(self, save_dir, tag, client_state or {}, save_latest)
        return self.last_checkpoint

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Load a checkpoint saved at any world size, ep size and stage (collective; DeepSpeed's arguments).

        Args:
            load_dir, tag: the folder and the checkpoint's tag (default: the one `latest` names).
            load_module_strict: must be True: every parameter of the model is read, and a checkpoint of
                another model fails, naming the difference.
            load_optimizer_states, load_lr_scheduler_states: also read those (the step counters, loss
                scale and random states are read unless load_module_only).
            load_module_only: read the model's weights and buffers only (a warm start).
            custom_load_fn: DeepSpeed's hook for its own module loading; must be None here.

        Returns:
            (path, client_state).

        Raises:
            ValueError: load_module_strict=False or a custom_load_fn.
        """
        checkpoint.check_load_options(load_module_strict, custom_load_fn)
        self.zero.settle(self.module)
        path, client_state = checkpoint.load(self, load_dir, tag, load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only)
        if self.precision.guard.written is not None:  # the weights are the checkpoint's now (the states may not be)
            self.precision.record_writes(self.units, self.optimizer, self.global_steps)
        self.last_checkpoint = path
        return path, client_state

    def consolidated_state_dict(self) -> dict | None:
        """The full model state_dict, as a one-process model with every expert names it, on rank 0 (collective)."""
        self.zero.settle(self.module)
        return checkpoint.consolidated_state_dict(self)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Write the full model state_dict in the compute dtype (fp16, bf16 or fp32) to save_dir/save_filename.

        Every rank calls it (collective); rank 0 writes, atomically (a temporary name, then a rename),
        and every rank returns once the file is there. Stage 3 needs no extra config key: the state is
        always gathered (DeepSpeed wants stage3_gather_16bit_weights_on_model_save and returns False
        without it).

        Returns:
            True.
        """
        checkpoint.save_state_dict(self.consolidated_state_dict(), self.compute_dtype, save_dir, save_filename,
                                   self.world_size)
        return True

    def empty_partition_cache(self) -> None:
        """Free gathered stage-3 parameters and cached device memory (DeepSpeed's, between training and
        generation, say): the parameters are sharded again and the allocator's cache is emptied."""
        self.zero.reshard(self.module)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def initialize(model: nn.Module = None, model_parameters=None, config=None, training_data=None, optimizer=None,
               lr_scheduler=None, config_params=None, args=None, **_ignored):
    """Wrap a model for training (DeepSpeed's `deepspeed.initialize`).

    As DeepSpeed's does, it joins the process group torchrun describes (unless
    `dist_init_required=False`) and makes the expert-parallel groups of MoE layers built before that.
    DeepSpeed's other keywords (`mpu`, `collate_fn`, `distributed_port`, ...) are accepted and ignored. Call it with keywords, as DeepSpeed scripts do: `initialize(args=args,
    model=model, model_parameters=params)`; `model` is the first positional argument here, where
    DeepSpeed's first is `args`.

    Args:
        model: the model; MoE layers' expert parameters carry `allreduce=False` and `group_name`.
        model_parameters: parameters or param groups to optimize (groups flagged `moe: True` are
            welcome; expert parameters are split out of unflagged groups); default all trainable ones.
        config: a DeepSpeed-style dict or JSON path (`config_params` is accepted as its alias).
        training_data: an optional Dataset; a DataLoader over this rank's share is returned.
        optimizer: a torch optimizer built over the model's parameters (kept, with its settings,
            state and hooks, its param groups re-pointed at the engine's shards; see optim.optimizer)
            or a callable taking param groups; else the config's `optimizer`.
        lr_scheduler: a schedule or a callable taking the optimizer; else the config's `scheduler`.
        config_params: DeepSpeed's older name of `config`, used when `config` is None.
        args: parsed command-line arguments (see `add_config_arguments`); their `deepspeed_config`
            (or the deprecated `deepscale_config`) is the config's path when `config` and
            `config_params` are None.

    Returns:
        (engine, optimizer, dataloader or None, lr_scheduler or None); the optimizer is
        `engine.optimizer`, an `optim.optimizer.ZeroOptimizer` around the torch optimizer.

    Raises:
        ValueError, TypeError: a bad config key or value, naming the key, before any training; no
            config or two of them (`config` and `args.deepspeed_config`, or both command-line spellings).
    """
    if model is None:
        raise TypeError("initialize needs model, an nn.Module, got None")
    config = _config_source(config if config is not None else config_params, args)
    join = _ignored.get("dist_init_required", True) is not False  # DeepSpeed's initialize joins the group too
    world_size = _distributed()[0]
    if join and world_size == 1 and all(name in os.environ for name in TORCHRUN_VARIABLES):
        world_size = int(os.environ["WORLD_SIZE"])  # the group to be joined: the config is checked before it is
    parsed = parse_config(config, world_size)
    if join:
        init_distributed()
    _make_expert_groups(model)
    world_size, rank = _distributed()
    engine = Engine(model, parsed, model_parameters, optimizer, lr_scheduler)
    loader = None
    if training_data is not None:
        sampler = torch.utils.data.DistributedSampler(training_data, world_size, rank) if world_size > 1 else None
        loader = torch.utils.data.DataLoader(training_data, batch_size=parsed.train_micro_batch_size_per_gpu,
                                             sampler=sampler, shuffle=sampler is None)
    return engine, engine.optimizer, loader, engine.lr_scheduler


def _make_expert_groups(model: nn.Module) -> None:
    """Let layers built before the process group existed make their expert-parallel groups (DeepSpeed's
    `set_deepspeed_parallelism`, called on every module that has it, as DeepSpeed's engine does)."""
    for module in model.modules():
        make = getattr(module, "set_deepspeed_parallelism", None)
        if callable(make):
            make()


def _config_source(config, args):
    """The config from the call or from `args.deepspeed_config` / `args.deepscale_config`, as DeepSpeed takes it."""
    from_args = getattr(args, "deepspeed_config", None)
    deepscale = getattr(args, "deepscale_config", None)
    if deepscale is not None:
        if from_args is not None:
            raise ValueError(f"args.deepscale_config ({deepscale!r}) and args.deepspeed_config ({from_args!r}) "
                             "are both set; pass one, --deepspeed_config")
        warnings.warn("--deepscale_config is deprecated; use --deepspeed_config", DeprecationWarning, stacklevel=3)
        from_args = deepscale
    if from_args is not None and config is not None:
        raise ValueError(f"initialize got config and args.deepspeed_config ({from_args!r}); pass one of them")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize needs a config: pass config= (a dict or JSON path), config_params=, or "
                         "args= with --deepspeed_config PATH parsed (see optim.add_config_arguments)")
    return config
