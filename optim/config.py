"""The engine's configuration: DeepSpeed's JSON keys parsed once into nested dataclasses.

`parse_config(dict or JSON path, world_size)` checks every key and type at the edge: a wrong type
raises with the key's full path (`zero_optimization.stage`). Unknown keys are treated as DeepSpeed
0.19.8 treats them: at the top level and beside `optimizer`'s and `scheduler`'s `type` and `params`
(comment keys such as `_comment`) they are ignored and listed once in a warning; inside the other
sections they fail; a key close to a known one (`train_batch_sizee`) fails everywhere, naming the known
key. DeepSpeed's other top-level keys (`activation_checkpointing`, `sparse_gradients`, ...) are accepted
without effect, and its older `bfloat16` is read as `bf16`. A JSON file that repeats a key fails, as DeepSpeed's loader does. Keys DeepSpeed knows
that change nothing here (bucket sizes, overlap switches, ...) are accepted and listed once in a
warning; DeepSpeed's deprecated spellings it still reads (`zero_optimization.cpu_offload`, ...) are read
as their current keys and listed once in a DeprecationWarning. After parsing, no code looks anything up in a dict.
"""

import argparse
import dataclasses
import difflib
import inspect
import json
import numbers
import os
import types
import typing
import warnings
from dataclasses import dataclass, field

__all__ = ["EngineConfig", "add_config_arguments", "parse_config"]


@dataclass(kw_only=True)
class OptimizerConfig:
    """`optimizer`: type Adam, AdamW or SGD (any case) and its keyword arguments."""

    type: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.type.lower() not in ("adam", "adamw", "sgd"):
            raise ValueError(f"optimizer.type must be Adam, AdamW or SGD, got {self.type!r}")


@dataclass(kw_only=True)
class SchedulerConfig:
    """`scheduler`: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest, and its params."""

    type: str
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        valid = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")
        if self.type not in valid:
            raise ValueError(f"scheduler.type must be one of {', '.join(valid)}, got {self.type!r}")


@dataclass(kw_only=True)
class FP16Config:
    """`fp16`: half precision with a dynamic loss scaler (static when loss_scale > 0)."""

    enabled: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False
    fp16_master_weights_and_grads: bool = False

    def __post_init__(self):
        _check_range("fp16.loss_scale", self.loss_scale, 0)
        _check_range("fp16.initial_scale_power", self.initial_scale_power, 0)
        _check_range("fp16.loss_scale_window", self.loss_scale_window, 1)
        _check_range("fp16.hysteresis", self.hysteresis, 1)
        if not self.min_loss_scale > 0:
            raise ValueError(f"fp16.min_loss_scale must be > 0, got {self.min_loss_scale}")
        if self.fp16_master_weights_and_grads:
            raise ValueError("fp16.fp16_master_weights_and_grads=true is not supported; use false")


@dataclass(kw_only=True)
class BF16Config:
    """`bf16`: bfloat16 compute; fp32 master weights unless the two low-precision flags are set."""

    enabled: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False
    immediate_grad_update: bool = True
    check_grad_overflow: bool = False

    def __post_init__(self):
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError("bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads=true")


_AUTOCAST_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
                    "float16": "float16", "fp16": "float16", "torch.float16": "float16"}


@dataclass(kw_only=True)
class TorchAutocastConfig:
    """`torch_autocast`: run the forward under torch.autocast with `dtype`."""

    enabled: bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: list = field(default_factory=list)

    def __post_init__(self):
        if self.dtype not in _AUTOCAST_DTYPES:
            raise ValueError(f"torch_autocast.dtype must be bfloat16 or float16, got {self.dtype!r}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, _AUTOCAST_DTYPES[self.dtype])


@dataclass(kw_only=True)
class OffloadConfig:
    """`zero_optimization.offload_optimizer` / `offload_param`: device none or cpu."""

    device: str = "none"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    fast_init: bool = False
    ratio: float = 1.0

    def __post_init__(self):
        if self.device not in ("none", "cpu"):
            raise ValueError(f"offload device must be 'none' or 'cpu', got {self.device!r} (nvme is not supported)")


@dataclass(kw_only=True)
class ZeroConfig:
    """`zero_optimization`: the stage, its offload and the reduction buckets of stages 0-2 (`reduce_bucket_size`
    elements each, reduced during the backward; asynchronously with `overlap_comm`); the other keys are
    DeepSpeed tuning knobs."""

    stage: int = 0
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    overlap_comm: bool = False
    reduce_bucket_size: int = 500_000_000
    contiguous_gradients: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    reduce_scatter: bool = True
    round_robin_gradients: bool = False
    sub_group_size: int = 1_000_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    ignore_unused_parameters: bool = True

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {self.stage}")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ValueError(
                f"zero_optimization.offload_param needs stage 3, got stage {self.stage}"
            )
        _check_range("zero_optimization.reduce_bucket_size", self.reduce_bucket_size, 1)


@dataclass(kw_only=True)
class TensorBoardConfig:
    """`tensorboard`: scalars written on rank 0 under output_path/job_name."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(kw_only=True)
class EngineConfig:
    """The whole configuration; batch sizes are resolved against the data-parallel world size."""

    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = 0.0
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    memory_breakdown: bool = False
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    zero_allow_untested_optimizer: bool = False  # a custom client optimizer, taken without a warning
    communication_data_type: str | None = None
    dump_state: bool = False
    # gradients holding inf or nan at a step without a loss scaler (fp32, bf16): "stop" raises before the
    # weights change, "skip" skips the step as fp16's scaler does, "off" does not look (no host read)
    nonfinite: str = "stop"

    def __post_init__(self):
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError("fp16.enabled and bf16.enabled cannot both be true")
        if self.nonfinite not in ("stop", "skip", "off"):
            raise ValueError(f"nonfinite must be stop, skip or off, got {self.nonfinite!r}")
        _check_range("gradient_clipping", self.gradient_clipping, 0)
        _check_range("steps_per_print", self.steps_per_print, 1)

    @property
    def low_precision(self) -> str | None:
        """'fp16', 'bf16' or None (fp32 parameters)."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else None


# Keys DeepSpeed knows that change nothing in this engine; a user who sets them is told once.
_WITHOUT_EFFECT = {
    "zero_optimization": (
        "contiguous_gradients", "allgather_partitions",
        "allgather_bucket_size", "reduce_scatter", "round_robin_gradients", "sub_group_size",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold", "stage3_gather_16bit_weights_on_model_save",
        "load_from_fp32_weights", "elastic_checkpoint", "ignore_unused_parameters",
    ),
    "offload": ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "fast_init", "ratio"),
    "fp16": ("auto_cast",),
    "bf16": ("immediate_grad_update", "check_grad_overflow"),
    "torch_autocast": ("lower_precision_safe_modules",),
    "": ("prescale_gradients", "gradient_predivide_factor",
         "communication_data_type", "dump_state"),
}


# DeepSpeed's deprecated zero_optimization spellings it still reads: old key -> (current key, its value).
# cpu_offload_use_pin_memory sets nothing in DeepSpeed either; it is accepted and reported.
_DEPRECATED_ZERO = {
    "cpu_offload": ("offload_optimizer", lambda on: {"device": "cpu" if on else "none"}),
    "cpu_offload_param": ("offload_param", lambda on: {"device": "cpu" if on else "none"}),
    "stage3_gather_fp16_weights_on_model_save": ("stage3_gather_16bit_weights_on_model_save", lambda on: on),
    "cpu_offload_use_pin_memory": (None, None),
}


def _agree(old: str, new_value, value) -> bool:
    """Whether the current key's value says what the deprecated key's translation says."""
    if old in ("cpu_offload", "cpu_offload_param"):
        return isinstance(value, dict) and value.get("device", "none") == new_value["device"]
    return value == new_value


def _translate_deprecated(data: dict, notes: list[str]) -> dict:
    """zero_optimization with its deprecated keys replaced by their current ones; a disagreement raises."""
    data = dict(data)
    for old, (new, translate) in _DEPRECATED_ZERO.items():
        if old not in data:
            continue
        value = _convert(bool, data.pop(old), f"zero_optimization.{old}", _Notes())
        if new is None:
            notes.append(f"zero_optimization.{old} (without effect, as in DeepSpeed; offload_optimizer.pin_memory "
                         "and offload_param.pin_memory are its current keys)")
            continue
        new_value = translate(value)
        if new in data and not _agree(old, new_value, data[new]):
            raise ValueError(f"zero_optimization.{old} ({str(value).lower()}) and zero_optimization.{new} "
                             f"({json.dumps(data[new])}) disagree; keep only {new}, the current key")
        data.setdefault(new, new_value)
        notes.append(f"zero_optimization.{old} -> zero_optimization.{new}")
    return data


def _translate_bfloat16(config: dict, notes: list[str]) -> dict:
    """The config with DeepSpeed's older `bfloat16` section read as `bf16`; both given must agree."""
    config = dict(config)
    value = config.pop("bfloat16")
    if "bf16" in config and config["bf16"] != value:
        raise ValueError(f"bfloat16 ({json.dumps(value)}) and bf16 ({json.dumps(config['bf16'])}) disagree; keep only "
                         "bf16, the current key")
    config["bf16"] = value
    notes.append("bfloat16 -> bf16")
    return config


def _check_range(path: str, value, low) -> None:
    if value < low:
        raise ValueError(f"{path} must be >= {low}, got {value}")


def _type_name(hint) -> str:
    return getattr(hint, "__name__", str(hint))


class ConfigTypeError(TypeError):
    """A config value of the wrong type, named by its key (a TypeError, so callers catching that still do)."""


@dataclass
class _Notes:
    """What parsing met that a warning reports: keys without effect here, and keys nobody reads."""

    without_effect: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)


def _convert(hint, value, path: str, ignored: _Notes):
    """Check `value` against the type hint, recursing into nested config dataclasses."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(h for h in options if h is not type(None))
    if dataclasses.is_dataclass(hint):
        return _parse(hint, value, path, ignored)
    hint = typing.get_origin(hint) or hint
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigTypeError(f"{path} must be {_type_name(hint)}, got {type(value).__name__} {value!r}")
    return value


def _number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Real) or (hasattr(value, "numel") and value.numel() == 1)  # a 1-element tensor


_NUMBER_PER_GROUP = "a number (or a list of one per param group)"


def _wanted(value, param: inspect.Parameter, per_group: bool) -> str | None:
    """What `value` should be, judged by the parameter's default (or, with none, its annotation), where it
    is not that; else None. per_group: the parameter takes a number or a list of one per param group."""
    default = param.default
    if default is param.empty:
        annotation = param.annotation
        annotation = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        default = 0 if annotation in ("int", "float") or per_group else None
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "true or false"
    if _number(default) and per_group:
        fits = _number(value) or (isinstance(value, (list, tuple)) and value and all(map(_number, value)))
        return None if fits else _NUMBER_PER_GROUP
    if _number(default):
        return None if _number(value) else "a number"
    if isinstance(default, tuple) and all(map(_number, default)):
        fits = isinstance(value, (list, tuple)) and len(value) == len(default) and all(map(_number, value))
        return None if fits else f"a list of {len(default)} numbers"
    if isinstance(default, str):
        return None if isinstance(value, str) else "a string"
    return None


def accepted_params(fn, skip: set[str]) -> dict:
    """The keyword parameters of `fn` (a class's __init__, say) less `skip`, by name."""
    return {name: p for name, p in inspect.signature(fn).parameters.items()
            if name not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_params(prefix: str, owner: str, fn, params: dict, skip: set[str],
                 per_group: frozenset = frozenset()) -> None:
    """Each key of `params` is a parameter of `fn` (less `skip`) and of the kind its default (or, where
    it has none, its annotation) is; the names in `per_group` also take a list of one per param group.

    Raises:
        ValueError: an unknown key, naming prefix.key and the valid ones.
        ConfigTypeError: a value of another kind (a string for a number, say), naming prefix.key.
    """
    accepted = accepted_params(fn, skip)
    for key, value in params.items():
        if key not in accepted:
            raise ValueError(f"unknown config key {prefix}.{key} for {owner}; valid: {', '.join(sorted(accepted))}")
        wanted = _wanted(value, accepted[key], key in per_group)
        if wanted:
            raise ConfigTypeError(f"{prefix}.{key} for {owner} must be {wanted}, got {type(value).__name__} {value!r}")


def _parse(cls, data, path: str, ignored: _Notes):
    if not isinstance(data, dict):
        raise ConfigTypeError(f"{path or 'config'} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{path}." if path else ""
    for key in [key for key in data if key not in names]:
        if cls is EngineConfig and key in _DEEPSPEED_KEYS:  # DeepSpeed's own section or switch, not read here
            ignored.without_effect.append(key)
            data = {k: v for k, v in data.items() if k != key}
            continue
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.8)
        if close:
            raise ValueError(f"unknown config key {prefix}{key}; did you mean {prefix}{close[0]}?")
        if cls not in _LENIENT:
            raise ValueError(f"unknown config key {prefix}{key} (DeepSpeed refuses it too); valid keys here: "
                             f"{', '.join(sorted(names))}")
        ignored.unknown.append(prefix + key)
        data = {k: v for k, v in data.items() if k != key}
    section = "offload" if cls is OffloadConfig else path.split(".")[-1]
    for key in _WITHOUT_EFFECT.get(section, ()):
        if key in data:
            ignored.without_effect.append(prefix + key)
    kwargs = {key: _convert(hints[key], value, prefix + key, ignored) for key, value in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required key is missing
        raise ValueError(f"{path or 'config'}: {error}") from None


# Where DeepSpeed 0.19.8 reads the config with dict lookups, a key it does not know passes (its top level,
# beside optimizer's and scheduler's type and params); its other sections are pydantic models that refuse
# one. Here a key that passes is reported in one warning, and one close to a known key fails either way.
_LENIENT = (EngineConfig, OptimizerConfig, SchedulerConfig)
# DeepSpeed 0.19.8's other top-level keys (its sections and switches): accepted without effect here,
# never taken for a misspelling of a key read here (sparse_gradients is not prescale_gradients).
_DEEPSPEED_KEYS = frozenset((
    "activation_checkpointing", "aio", "amp", "autotuning", "checkpoint", "comet", "comms_logger", "compile",
    "compression_training", "csv_monitor", "curriculum_learning", "data_efficiency", "data_types",
    "dataloader_drop_last", "disable_allgather", "disable_python_gc", "eigenvalue", "elasticity", "expert_parallel",
    "flops_profiler", "fp32_reduce_scatter", "gradient_accumulation_dtype", "gradient_allreduce_op",
    "graph_harvesting", "hybrid_engine", "legacy_fusion", "managed_gradient_accumulation", "nebula", "pipeline",
    "progressive_layer_drop", "quantize_training", "seq_parallel_communication_data_type", "sparse_attention",
    "sparse_gradients", "timers", "use_data_before_expert_parallel_", "use_data_before_expert_parallelism",
    "vocabulary_size", "wandb", "weight_quantization", "zero_force_ds_cpu_optimizer",
))


def _resolve_batch(config: EngineConfig, world_size: int) -> None:
    """Fill the missing one of (train_batch_size, micro batch, accumulation) and check the three agree."""
    total, micro, accum = config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps
    for name, value in (("train_batch_size", total), ("train_micro_batch_size_per_gpu", micro),
                        ("gradient_accumulation_steps", accum)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if total is None and micro is None:
        raise ValueError("config needs train_batch_size or train_micro_batch_size_per_gpu")
    if total is not None and micro is not None and accum is None:
        accum = total // (micro * world_size)
    elif total is not None and micro is None:
        accum = accum or 1
        micro = total // (accum * world_size)
    elif total is None:
        accum = accum or 1
        total = micro * accum * world_size
    if micro < 1 or accum < 1 or total != micro * accum * world_size:
        raise ValueError(
            f"train_batch_size ({config.train_batch_size}) must equal train_micro_batch_size_per_gpu "
            f"({config.train_micro_batch_size_per_gpu}) * gradient_accumulation_steps "
            f"({config.gradient_accumulation_steps}) * world size ({world_size})"
        )
    config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps = total, micro, accum


def _refuse_duplicates(pairs: list) -> dict:
    """A JSON object's dict; a key given twice fails (DeepSpeed's loader refuses it too)."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"config file repeats the key(s) {', '.join(repeated)}; give each key once")
    return dict(pairs)


def parse_config(config: dict | str | os.PathLike, world_size: int) -> EngineConfig:
    """Parse a config dict or JSON file into an EngineConfig.

    Args:
        config: the DeepSpeed-style dict, or the path of a JSON file holding it.
        world_size: the data-parallel world size the batch sizes are resolved against.

    Returns:
        the parsed config, batch sizes filled in.

    Raises:
        ValueError: an unknown key where DeepSpeed refuses one (or close to a known key), a bad value,
            inconsistent batch sizes or a repeated key in a file, naming the key; a deprecated
            key (DeepSpeed's `zero_optimization.cpu_offload`, ...) that disagrees with its current one.
        TypeError: a value of the wrong type, naming the key.
    """
    if isinstance(config, (str, os.PathLike)):
        with open(config) as handle:
            config = json.load(handle, object_pairs_hook=_refuse_duplicates)
    ignored = _Notes()
    deprecated: list[str] = []
    if isinstance(config, dict) and "bfloat16" in config:  # DeepSpeed still reads its old name of bf16
        config = _translate_bfloat16(config, deprecated)
    if isinstance(config, dict) and isinstance(config.get("zero_optimization"), dict):
        config = {**config, "zero_optimization": _translate_deprecated(config["zero_optimization"], deprecated)}
    parsed = _parse(EngineConfig, config, "", ignored)
    _resolve_batch(parsed, world_size)
    if deprecated:
        warnings.warn(f"deprecated config keys, read as their current ones: {'; '.join(deprecated)}",
                      DeprecationWarning, stacklevel=3)
    if ignored.unknown:
        warnings.warn(f"config keys neither DeepSpeed nor this engine reads, ignored as DeepSpeed ignores them: "
                      f"{', '.join(ignored.unknown)}", stacklevel=3)
    if ignored.without_effect:
        warnings.warn(f"config keys accepted for compatibility, without effect here: {', '.join(ignored.without_effect)}",
                      stacklevel=3)
    return parsed


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line flags for the config: `--deepspeed_config PATH` and friends.

    `initialize(args=parser.parse_args(), model=...)` then reads the config from `args.deepspeed_config`.
    `--deepspeed` is a flag for the script's own use (the engine ignores it); `--deepscale` and
    `--deepscale_config` are DeepSpeed's older spellings of the two.

    Args:
        parser: the script's parser; a "DeepSpeed" argument group is added to it.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable DeepSpeed-style training (a flag for the script; the engine ignores it)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="the JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true", help="deprecated spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="deprecated spelling of --deepspeed_config")
    return parser
