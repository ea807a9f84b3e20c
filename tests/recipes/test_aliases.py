"""The top-level names of the modules in recipes.bench and recipes.common import those very modules, and
`python -m recipes.<alias>` runs them, with no file at the alias and no warning."""

import importlib
import os
import subprocess
import sys

import pytest

import recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("alias", sorted(recipes.ALIASES))
def test_an_alias_imports_the_module_itself(alias):
    module = importlib.import_module(f"recipes.{recipes.ALIASES[alias]}")
    assert importlib.import_module(f"recipes.{alias}") is module
    assert getattr(recipes, alias) is module  # `from recipes import bench_moe`
    assert module.__spec__.name == module.__name__ == f"recipes.{recipes.ALIASES[alias]}"
    assert not os.path.exists(os.path.join(ROOT, "recipes", f"{alias}.py"))


def test_from_an_alias_imports_names():
    from recipes.cli import flag_parser
    from recipes.common.cli import flag_parser as same

    assert flag_parser is same


def test_an_unknown_name_stays_unknown():
    with pytest.raises(ModuleNotFoundError, match="recipes.bench_nothing"):
        importlib.import_module("recipes.bench_nothing")


@pytest.mark.slow
def test_python_m_alias_runs_the_module_as_main_without_a_warning():
    # runpy as `python -m` runs it, every alias in one process (one torch import); bench.moe by `-m` itself below
    code = ("import runpy, sys\n"
            "import recipes\n"
            "for alias in sorted(recipes.ALIASES):\n"
            "    sys.argv = [alias, '--help']\n"
            "    try:\n"
            "        runpy.run_module(f'recipes.{alias}', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as stop:\n"
            "        assert stop.code == 0, (alias, stop.code)\n"
            "        print('usage of', alias)\n")
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    commands = {"bench_checkpoint", "bench_engine", "bench_gpt", "bench_kernels", "bench_moe", "bench_routing"}
    assert {line.split()[-1] for line in done.stdout.splitlines() if line.startswith("usage of")} == commands
    done = subprocess.run([sys.executable, "-W", "error", "-m", "recipes.bench_moe", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and not done.stderr, done.stderr[-3000:]
    assert done.stdout.startswith("usage: recipes.bench.moe "), done.stdout
