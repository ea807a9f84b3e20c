"""Running a training recipe from the command line: what `recipes.gpt` and `recipes.cifar` share.

A recipe hands the runner its config dataclass, its own flag checks and its train function; the
runner parses the flags (taking the checkpoint's config on --resume), checks the ones every recipe
has, starts the processes' group, prints the config, claims the checkpoint folder, trains, and
turns a bad setting into one line on stderr (exit status 2) and a non-finite loss into one line
(exit status 1), never a traceback.
"""

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch.distributed as dist

from parallel import init_distributed
from recipes.common.cli import fail, flag_parser, mark_started, parse_config, require_at_least
from recipes.common.training import SetupError, claim_for_run, release_checkpoint_dir


@dataclass(frozen=True)
class Recipe:
    """What a training recipe brings to the runner.

    Args:
        prog: the command's name in its messages ("recipes.gpt").
        config_class: the recipe's kw_only config dataclass; one flag per field. It has the fields
            `checkpoint_dir`, `resume`, `start_over`, `keep_last`, `config`, `run_name` and `ep_world_size`.
        description: the text of --help (the recipe's module docstring).
        check: `check(parser, cfg, world)`, the recipe's own flag checks; each calls `fail` on a bad value.
        run_label: `run_label(cfg)`, the start of the default TensorBoard run name ("gpt-moe").
        train: `train(cfg, given, rank, world) -> dict`, raising SetupError on bad data, model or engine settings.
        usage: the usage line of --help; None: argparse's list of every flag.
    """

    prog: str
    config_class: type
    description: str
    check: Callable[[argparse.ArgumentParser, object, int], None]
    run_label: Callable[[object], str]
    train: Callable[[object, set, int, int], dict]
    usage: str | None = None


def parser_for(recipe: Recipe) -> argparse.ArgumentParser:
    parser = flag_parser(recipe.config_class, recipe.description)
    parser.prog, parser.usage = recipe.prog, recipe.usage
    return parser


def checked_config(recipe: Recipe, parser: argparse.ArgumentParser, argv: list[str] | None, world: int):
    """The recipe's config and the flags written out, parsed and validated (on --resume, the checkpoint's
    config under the flags); a bad flag stops with one line."""
    cfg, given = parse_config(parser, recipe.config_class, argv)
    if cfg.keep_last < 0:
        fail(parser, f"--keep-last must be 0 (keep all) or more, got {cfg.keep_last}")
    if not cfg.run_name:
        cfg.run_name = f"{recipe.run_label(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    require_at_least(parser, cfg, ("ep_world_size",))
    if world % cfg.ep_world_size and "ep_world_size" not in given:
        # a resumed run's expert-parallel size came from its checkpoint, written at another layout: the
        # checkpoint loads at any, so the run goes on at the largest size that fits both
        resumed_at = math.gcd(cfg.ep_world_size, world)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"resuming at --ep-world-size {resumed_at}: the checkpoint's run used {cfg.ep_world_size}, which "
                  f"does not divide {world} process(es) (pass --ep-world-size to choose another)", flush=True)
        cfg.ep_world_size = resumed_at
    if world % cfg.ep_world_size:
        fail(parser, f"--ep-world-size ({cfg.ep_world_size}) must divide the number of processes ({world})")
    if cfg.config and not os.path.isfile(cfg.config):
        fail(parser, f"--config {cfg.config} does not exist")
    recipe.check(parser, cfg, world)
    return cfg, given


def main(recipe: Recipe, argv: list[str] | None = None) -> dict:
    """Run the recipe with the flags `argv` (default: the command line's); returns what its train returns."""
    argv = sys.argv[1:] if argv is None else argv
    parser = parser_for(recipe)
    rank, world = init_distributed()
    cfg, given = checked_config(recipe, parser, argv, world)
    if rank == 0:
        print("config:", json.dumps(asdict(cfg)), f"processes={world}", flush=True)
    claimed = False

    def release():
        if claimed:
            release_checkpoint_dir(cfg.checkpoint_dir)

    with one_line_failures(parser, release):
        claimed = claim_for_run(cfg.checkpoint_dir, rank)  # one writer per checkpoint folder
        if claimed:
            mark_started(cfg.checkpoint_dir)  # a torchrun restart of this job continues it
        result = recipe.train(cfg, given, rank, world)
    return result


@contextlib.contextmanager
def one_line_failures(parser: argparse.ArgumentParser, cleanup: Callable[[], None] | None = None):
    """Run a recipe's body: a bad setting (SetupError) ends it with one line (exit status 2), a
    non-finite loss (the engine's guard) with one line (exit status 1). After a body that finished,
    the ranks meet before any tears its group down; then, whatever happened, `cleanup` runs and the
    group is destroyed."""
    try:
        yield
        if dist.is_initialized():
            dist.barrier()  # no rank tears its group down while a peer's last exchange is in flight
    except SetupError as error:
        fail(parser, str(error))
    except FloatingPointError as error:
        parser.exit(1, f"{parser.prog}: stopped: {error}\n")
    finally:
        try:
            if cleanup is not None:
                cleanup()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
