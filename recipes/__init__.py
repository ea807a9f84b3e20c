"""Runnable recipes: training scripts at the top, benchmarks in `bench`, the helpers they share in `common`.

Each module at the top level is a command (`python -m recipes.<name>`), except `gpt_model`, the GPT
recipe's model:

    gpt                 train a byte-level MoE GPT (or its dense twin), or sample from a checkpoint
    gpt_model           the GPT recipe's model and its config
    finetune            fine-tune a Hugging Face MoE model on our layer and save it back for transformers
    cifar               a CIFAR-10 classifier with MoE layers
    demo                a short MoE training demo on a synthetic mixture task
    compare_dense_moe   dense GPT against MoE GPT at equal active compute (the README's table)
    ablate              the GPT recipe once per router variant, at equal active compute
    estimate            memory per GPU of one GPT training step, run in a simulated world
    gpu_report          one command for a GPU machine: the CUDA tests, the dispatch ops, our MoE layer beside
                        DeepSpeed's and torchtitan's, the GPT recipe's MoE/dense ratio; one record per part
    report              docs/results.md (and its plots) from the result records under results/

    bench/              benchmarks: scripts that print what they measured (see recipes.bench)
    common/             imported, never run: flags, the run loop, training helpers, the simulated world, our
                        layer beside DeepSpeed's and torchtitan's
    configs/            JSON engine configs for the recipes

Nothing outside recipes imports it: moe, parallel, optim and kernels never do.

The modules of `bench` and `common` also answer to top-level names (`import recipes.bench_moe`,
`python -m recipes.bench_moe`, see ALIASES): `_AliasFinder` below maps each to its module, with no
file at the top-level name.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

# top-level names that users' scripts and commands import, for modules that live in a subpackage: alias -> module
ALIASES = {
    "bench_checkpoint": "bench.checkpoint",
    "bench_engine": "bench.engine",
    "bench_gpt": "bench.gpt",
    "bench_kernels": "bench.kernels",
    "bench_moe": "bench.moe",
    "bench_routing": "bench.routing",
    "step_breakdown": "bench.step_breakdown",
    "cli": "common.cli",
    "runner": "common.runner",
    "simulated": "common.simulated",
    "training": "common.training",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as the module it names: one module object, whichever name imports it first."""

    def __init__(self, name: str):
        self.name = name
        self.spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.name)
        self.spec = module.__spec__  # the import system writes the alias's spec over it; exec_module puts it back
        return module

    def exec_module(self, module):
        module.__spec__ = self.spec  # already executed under its own name

    def get_code(self, fullname):
        """The module's code, for runpy: `python -m recipes.<alias>` runs the file as __main__."""
        return importlib.util.find_spec(self.name).loader.get_code(self.name)


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `recipes.<alias>` of ALIASES, lazily: nothing is imported until an alias is."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, alias = fullname.rpartition(".")
        if package != __name__ or alias not in ALIASES:
            return None
        name = f"{__name__}.{ALIASES[alias]}"
        spec = importlib.machinery.ModuleSpec(fullname, _AliasLoader(name),
                                              origin=importlib.util.find_spec(name).origin)
        spec.has_location = True  # __file__ is the module's file, under runpy too
        return spec


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())  # first: it answers only ALIASES's names, which no file has
