"""The CPU machinery's import paths: kernels.cpu and the paths its modules had under kernels, and
checkpoints that keep its choices without importing it."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_the_old_paths_are_the_cpu_packages_modules():
    """`import kernels.gemm` (then its attributes), `from kernels.threads import ...` and `from kernels
    import workspace` reach kernels.cpu's modules, in a fresh process."""
    code = ("import kernels.gemm, kernels.threads, kernels.workspace\n"
            "from kernels.threads import run_each\n"
            "from kernels import workspace\n"
            "import kernels.cpu as cpu\n"
            "assert kernels.gemm is cpu.gemm and kernels.threads is cpu.threads and workspace is cpu.workspace\n"
            "assert kernels.gemm.linear is cpu.linear and run_each is cpu.run_each\n"
            "assert kernels.gemm.choices() == cpu.backend.choices() == {}\n"
            "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_checkpoints_keep_the_cpu_choices_through_a_registered_hook_not_an_import():
    from kernels import cpu
    from optim import checkpoint

    tree = ast.parse((ROOT / "optim" / "checkpoint.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name.split(".")[0] == "kernels" for name in imported)
    assert checkpoint._EXTRA_STATE["gemm"] == (cpu.backend.choices, cpu.backend.adopt)
