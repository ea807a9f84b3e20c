"""Command-line flags from a recipe's config dataclass, resuming a run's config, and the engine config.

One `--flag-name` per field, typed by its default; a field's metadata may add argparse settings
(`help`, `choices`, `nargs`, `type`). A bool field that defaults to False is a plain switch
(`--resume`), one that defaults to True gets a `--no-` form.
"""

import argparse
import copy
import dataclasses
import json
import math
import os
import re
import sys
import warnings

import torch.distributed as dist

from optim import read_client_state
from optim.optimizer import optimizer_params
from optim.schedulers import scheduler_params
from parallel import accelerator_name


# The flags both recipes share (dataclass fields): the checkpoint folder's, the gate noise.
def resume_field():
    return dataclasses.field(default="", metadata={
        "nargs": "?", "const": "yes", "choices": ["yes", "auto"],
        "help": "continue from the latest checkpoint in --checkpoint-dir; `--resume auto`: when there is one, "
                "else start (for torchrun --max-restarts)"})


def start_over_field():
    return dataclasses.field(default=False, metadata={
        "help": "write into a --checkpoint-dir that holds an earlier run without resuming it"})


def keep_last_field():
    return dataclasses.field(default=0, metadata={"help": "keep only the newest n checkpoints (0: all)"})


def noisy_gate_policy_field():
    return dataclasses.field(default="None", metadata={
        "choices": ["None", "Jitter", "RSample"], "help": "gate noise in training (None: no noise)"})


def noisy_gate_policy(flag: str) -> str | None:
    """The gate's noisy_gate_policy for the flag's value: the flag spells "no noise" as the string "None"
    (as DeepSpeed's recipes do), the gate takes None."""
    return None if flag == "None" else flag


class _Parser(argparse.ArgumentParser):
    """Flags are spelled out: a prefix such as `--topk` is an error, not silently `--topk-group`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        """One line, no usage block."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def flag_parser(config_class, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per field of `config_class`; a bad flag stops with one line."""
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(config_class):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        options = {"default": default, **field.metadata}
        options["help"] = (options.get("help", "") + " (default: %(default)s)").lstrip()
        if isinstance(default, bool) and "nargs" not in options:
            options["action"] = argparse.BooleanOptionalAction if default else "store_true"
        elif "type" not in options:
            options["type"] = type(default)
        parser.add_argument("--" + field.name.replace("_", "-"), **options)
    return parser


def flag_names(message: str, config_class) -> str:
    """`message` with the config's field names written as their flags ("capacity_factor" -> "--capacity-factor"):
    the model's layers name their Python arguments, the user wrote flags. Only names with an underscore
    are rewritten (plain words such as dense or routing stay words), and not inside paths or
    attribute names. For the model's own errors only: engine-config errors name JSON keys."""
    fields = {f.name for f in dataclasses.fields(config_class)}
    flags = {name: name for name in fields if "_" in name}
    flags.update({alias: name for alias, name in _MODEL_ARGUMENTS.items() if name in fields})
    names = sorted(flags, key=len, reverse=True)
    if not names:
        return message
    pattern = re.compile(r"(?<![\w\-/.\\'\"])(" + "|".join(map(re.escape, names)) + r")(?![\w\-/\\]|\.\w)")
    return pattern.sub(lambda match: "--" + flags[match.group(1)].replace("_", "-"), message)


# the model's argument names where the recipes' flag differs: the model's ep_size is --ep-world-size
_MODEL_ARGUMENTS = {"ep_size": "ep_world_size"}


def built(make, config_class):
    """make(), a model built from the flags; its ValueError or TypeError (a bad setting the layers
    caught) is re-raised as ValueError naming the flags (`flag_names`)."""
    try:
        return make()
    except (TypeError, ValueError) as error:
        raise ValueError(flag_names(str(error), config_class)) from None


def given_flags(parser: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the flags actually written on the command line."""
    probe = _Parser(prog=parser.prog, add_help=False)
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            probe._add_action(_copy_suppressed(action))
    names, _ = probe.parse_known_args(sys.argv[1:] if argv is None else argv)
    return set(vars(names))


def _copy_suppressed(action: argparse.Action) -> argparse.Action:
    clone = copy.copy(action)
    clone.default = argparse.SUPPRESS
    return clone


_STARTED = ".torchrun_job"  # in a checkpoint folder: the torchrun job (run id) whose first attempt set it up


def mark_started(folder: str) -> None:
    """Under torchrun, record in `folder` that this job's first attempt passed its checks and claimed it."""
    if folder and "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        with open(os.path.join(folder, _STARTED), "w") as handle:
            handle.write(os.environ["TORCHELASTIC_RUN_ID"])


def started_here(folder: str) -> bool:
    """Whether this torchrun job's first attempt set `folder` up (so a restart continues it), on every rank
    as rank 0 sees it. A restart of an attempt that was refused (an earlier run there) is refused again."""
    try:
        with open(os.path.join(folder, _STARTED)) as handle:
            mine = [handle.read().strip() == os.environ.get("TORCHELASTIC_RUN_ID")]
    except OSError:
        mine = [False]
    if dist.is_initialized():
        dist.broadcast_object_list(mine, src=0)
    return mine[0]


def parse_config(parser: argparse.ArgumentParser, config_class, argv: list[str] | None):
    """The recipe config and the flags written out; with --resume, the checkpoint's config under them.

    A resumed run takes the config saved in the checkpoint's client state (key "recipe"), and the flags
    written on the command line override it: a run continues as it was set up unless told otherwise.
    """
    cfg = config_class(**vars(parser.parse_args(argv)))
    given = given_flags(parser, argv)
    folder = cfg.checkpoint_dir
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        fail(parser, f"--checkpoint-dir {folder} is a file, not a folder")
    earlier = [bool(folder) and os.path.isfile(os.path.join(folder, "latest"))]
    if dist.is_initialized():  # rank 0's view decides, so every rank resumes or none does
        dist.broadcast_object_list(earlier, src=0)
    earlier = earlier[0]
    if cfg.resume and cfg.start_over:
        fail(parser, "--start-over and --resume cannot be combined: start over, or resume")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and folder and started_here(folder):  # torchrun restarted this run: on from what it wrote
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"torchrun restart {restart}: {'resuming from ' + _latest(folder) if earlier else 'starting again'} "
                  f"in --checkpoint-dir {folder}", flush=True)
        cfg.resume, cfg.start_over = "auto", False
    if cfg.resume == "auto":  # a restarted run (torchrun --max-restarts) continues; a first run starts
        cfg.resume = "yes" if earlier else ""
    if not cfg.resume:
        if earlier and not cfg.start_over:
            fail(parser, f"--checkpoint-dir {folder} holds an earlier run (latest: {_latest(folder)}): add --resume "
                         "to continue it, --start-over to write over it, or name another folder")
        return cfg, given
    if not folder:
        fail(parser, "--resume needs --checkpoint-dir")
    if not earlier:
        fail(parser, f"--resume: --checkpoint-dir {folder} holds no checkpoint (no file 'latest'); leave out --resume "
                     "to start a run there, or pass --resume auto to start or continue")
    try:
        saved = saved_recipe(read_client_state(cfg.checkpoint_dir))
        cfg = config_class(**{**saved, **{name: getattr(cfg, name) for name in given}, "resume": "yes"})
    except (OSError, RuntimeError, KeyError, TypeError) as error:
        fail(parser, f"cannot resume from --checkpoint-dir {cfg.checkpoint_dir}: {error}")
    return cfg, given


RENAMED = {"expert_compute": "expert_layout"}  # config fields saved by earlier versions, by their names now


def saved_recipe(client_state: dict) -> dict:
    """The recipe config a checkpoint saved (client state "recipe"), with fields renamed since under their new names."""
    saved = dict(client_state["recipe"])
    for old, new in RENAMED.items():
        if old in saved:
            saved.setdefault(new, saved.pop(old))
    return saved


def _latest(folder: str) -> str:
    try:
        with open(os.path.join(folder, "latest"), "rb") as handle:
            return handle.read(200).decode("utf-8", "replace").strip()
    except OSError:
        return "unreadable"


def fail(parser: argparse.ArgumentParser, message: str):
    """Stop with one line naming the problem (no usage block, no traceback); exit status 2."""
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def require_at_least(parser: argparse.ArgumentParser, cfg, names: tuple[str, ...], least: int = 1) -> None:
    """Stop with one line at the first field in `names` below `least`, named as its flag."""
    for name in names:
        if getattr(cfg, name) < least:
            bound = "0 or more" if least == 0 else f"at least {least}"
            fail(parser, f"--{name.replace('_', '-')} must be {bound}, got {getattr(cfg, name)}")


def require_positive(parser: argparse.ArgumentParser, cfg, names: tuple[str, ...]) -> None:
    """Stop with one line at the first field in `names` that is not a positive finite number."""
    for name in names:
        if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
            fail(parser, f"--{name.replace('_', '-')} must be a positive finite number, got {getattr(cfg, name)}")


def merge(base: dict, override: dict) -> dict:
    """Nested dicts merged, `override` winning."""
    out = dict(base)
    for key, value in override.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _type_of(config: dict, block: str) -> str | None:
    entry = config.get(block)
    kind = entry.get("type") if isinstance(entry, dict) else None
    return kind.lower() if isinstance(kind, str) else None


def _params_taken(block: str, kind: str | None) -> set[str] | None:
    """The params an optimizer or scheduler of type `kind` takes; None for a type the engine will refuse."""
    if kind is None:
        return None
    try:
        return optimizer_params(kind) if block == "optimizer" else scheduler_params(kind)
    except KeyError:
        return None


_TYPED = ("optimizer", "scheduler")  # blocks whose params belong to their type


def _written_onto(fragment: dict, config: dict, defaults: dict, flag: str) -> dict:
    """A written flag's entries, less what does not fit an optimizer or scheduler of another type than
    the recipe's (from the JSON file): that type stays, and only the params it takes are set (a
    warning names the others). A block the JSON file makes no object is left for the engine to refuse."""
    out = dict(fragment)
    for block in _TYPED:
        if block not in fragment:
            continue
        if not isinstance(config.get(block), dict):
            del out[block]
            continue
        kind = _type_of(config, block)
        if kind == _type_of(defaults, block):
            continue
        taken = _params_taken(block, kind)
        params = fragment[block].get("params", {})
        out[block] = {"params": {k: v for k, v in params.items() if taken is None or k in taken}}
        dropped = sorted(set(params) - set(out[block]["params"]))
        if dropped:
            warnings.warn(f"{config[block]['type']} (from --config) takes no {block}.params {', '.join(dropped)}: "
                          f"--{flag.replace('_', '-')} does not set {'it' if len(dropped) == 1 else 'them'}",
                          stacklevel=3)
    return out


# the param by which a schedule sets the learning rate itself, whatever the optimizer's lr (one per type)
_OWN_RATES = ("warmup_max_lr", "cycle_max_lr", "lr_range_test_min_lr")


def _warn_if_lr_overridden(config: dict, fragment: dict) -> None:
    """Warn when a schedule from the JSON file sets the learning rate from its own rates that --lr does not set."""
    # (the CIFAR recipe's --lr sets warmup_max_lr too, so under WarmupLR it does change the rate)
    scheduler = config.get("scheduler")
    taken = _params_taken("scheduler", _type_of(config, "scheduler")) or set()
    rate = next((name for name in _OWN_RATES if name in taken), None)
    if rate is None or rate in fragment.get("scheduler", {}).get("params", {}):
        return
    warnings.warn(f"--lr sets the optimizer's lr, but {scheduler['type']} (from --config) sets the learning rate from "
                  f"its own rates ({rate}, ...): --lr does not change the run's learning rate", stacklevel=3)


def adamw_cosine_fragments(cfg) -> dict[str, dict]:
    """The engine-config entries of a language-model recipe, keyed by the flag that sets each: AdamW
    (betas 0.9, 0.95), warm-up then cosine decay, clipping, precision, ZeRO stage, TensorBoard.

    `cfg` has batch_size, lr, weight_decay, steps, warmup_steps, gradient_clipping, dtype, stage,
    log_dir and run_name.
    """
    return {
        "batch_size": {"train_micro_batch_size_per_gpu": cfg.batch_size},
        "optimizer": {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}},  # no flag's: defaults
        "lr": {"optimizer": {"params": {"lr": cfg.lr}}},
        "weight_decay": {"optimizer": {"params": {"weight_decay": cfg.weight_decay}}},
        "scheduler": {"scheduler": {"type": "WarmupCosineLR"}},  # no flag's: a default
        "steps": {"scheduler": {"params": {"total_num_steps": cfg.steps}}},
        "warmup_steps": {"scheduler": {"params": {"warmup_num_steps": cfg.warmup_steps}}},
        "gradient_clipping": {"gradient_clipping": cfg.gradient_clipping},
        "dtype": {"bf16": {"enabled": cfg.dtype == "bf16"}, "fp16": {"enabled": cfg.dtype == "fp16"}},
        "stage": {"zero_optimization": {"stage": cfg.stage}},
        "run_name": {"tensorboard": {"enabled": True, "output_path": cfg.log_dir, "job_name": cfg.run_name}},
        "steps_per_print": {"steps_per_print": 10**9},
    }


def engine_config(fragments: dict[str, dict], given: set[str], json_path: str) -> dict:
    """The engine config: flag defaults, then the JSON file, then the flags written on the command line.

    An optimizer or scheduler block in the JSON file of another type than the recipe's replaces the
    recipe's whole (its params are that type's); a flag written on the command line then sets only
    the params of its block that this type takes, and never the type.

    Args:
        fragments: per flag destination, the nested config entries it sets.
        given: flag destinations written on the command line (they override the JSON file).
        json_path: a DeepSpeed-style JSON config, or "".
    """
    config = {}
    for fragment in fragments.values():
        config = merge(config, fragment)
    if json_path:
        with open(json_path) as handle:
            try:
                loaded = json.load(handle)
            except ValueError as error:
                raise ValueError(f"--config {json_path} is not valid JSON: {error}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {json_path} must hold a JSON object of engine settings")
        defaults = config
        for block in _TYPED:
            if _type_of(loaded, block) not in (None, _type_of(defaults, block)):
                config = {key: value for key, value in config.items() if key != block}
        config = merge(config, loaded)
        for name in sorted(given & fragments.keys()):
            config = merge(config, _written_onto(fragments[name], config, defaults, name))
        if "lr" in given and "lr" in fragments:
            _warn_if_lr_overridden(config, fragments["lr"])
    return config


def device_or_accelerator(parser: argparse.ArgumentParser, device: str) -> str:
    """`device`, or where it is empty the process's accelerator; a bad DS_ACCELERATOR stops with one line."""
    if device:
        return device
    try:
        return accelerator_name()
    except ValueError as error:
        fail(parser, str(error))
