"""The five top-level packages are this project's, imports between them point one way, and no module
imports itself back through others."""

import ast
import importlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest
import torch

PACKAGES = ("moe", "parallel", "optim", "kernels", "recipes")
ALLOWED = {  # package -> project packages it may import: imports point one way
    "kernels": set(),
    "parallel": set(),
    "moe": {"kernels", "parallel"},
    "optim": {"parallel", "kernels"},
    "recipes": {"moe", "parallel", "optim", "kernels"},
}
ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", PACKAGES)
def test_each_package_is_this_projects(name):
    module = importlib.import_module(name)
    location = pathlib.Path(module.__file__).resolve()
    in_checkout = location.is_relative_to(ROOT / name)
    owners = importlib.metadata.packages_distributions().get(name, [])
    assert in_checkout or "exactmoe" in owners, f"{name} resolves to {location}, owned by {owners}"
    assert (location.parent / "__init__.py").exists()


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_point_one_way(package):
    for path in sorted((ROOT / package).rglob("*.py")):
        used = _imports(path) & set(PACKAGES) - {package}
        assert used <= ALLOWED[package], f"{path.relative_to(ROOT)} imports {sorted(used - ALLOWED[package])}"


def test_nothing_imports_triton_at_module_level():
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            tree = ast.parse(path.read_text())
            top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            assert "triton" not in {m for n in top for m in _imports_of(n)}, f"{path} imports triton eagerly"


def _imports_of(node) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name.split(".")[0] for alias in node.names}
    return {node.module.split(".")[0]} if node.module else set()


def _module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_edges(path: pathlib.Path, modules: set[str], root: pathlib.Path = ROOT) -> set[str]:
    """The project modules a file names in any import, at module level or inside a function.

    `from a.b import c` points at a.b.c where that is a module, else at a.b; relative imports resolve
    against the file's package.
    """
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_back():
    paths = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _module_edges(p, modules) for p in paths}
    assert _cycle(graph) is None, "import cycle: " + " -> ".join(_cycle(graph))


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("def g():\n    from . import a\n")
    paths = sorted((tmp_path / "pkg").rglob("*.py"))
    modules = {_module_name(p, tmp_path) for p in paths}
    graph = {_module_name(p, tmp_path): _module_edges(p, modules, tmp_path) for p in paths}
    assert _cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


@pytest.mark.slow
def test_a_cpu_install_needs_no_triton():
    """triton is only in extras (torch's CUDA builds bring their own), and the CPU path runs with it unimportable."""
    try:  # the project file itself (an installed copy's metadata may be older than the checkout)
        import tomllib

        plain = [r for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                 if r.lower().startswith("triton")]
    except ModuleNotFoundError:  # Python 3.10: the installed metadata
        plain = [r for r in importlib.metadata.requires("exactmoe") or []
                 if r.lower().startswith("triton") and "extra ==" not in r]
    assert not plain, f"triton is a plain dependency: {plain}"
    code = (
        "import sys; sys.modules['triton'] = None\n"  # any import of triton now raises ImportError
        "import torch\n"
        "from moe import MoE\n"
        "from optim import initialize\n"
        "torch.manual_seed(0)\n"
        "layer = MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2)\n"
        "engine, *_ = initialize(layer, config={'train_batch_size': 4, 'optimizer': {'type': 'AdamW', 'params': {'lr': 0.1}}})\n"
        "out, l_aux, _ = engine(torch.randn(4, 8))\n"
        "engine.backward(out.square().mean() + l_aux)\n"
        "engine.step()\n"
        "print('stepped', engine.global_steps)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MOE_KERNELS", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and "stepped 1" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
def test_importing_the_project_leaves_dynamo_and_dcp_unimported():
    """`import moe` (and the rest) costs what `import torch` costs: torch._dynamo and
    torch.distributed.checkpoint, slow to import, load only when a compile or a checkpoint needs them;
    every rank of a torchrun job pays an import."""
    code = ("import sys, moe, optim, parallel, kernels, recipes.gpt, recipes.cifar\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.checkpoint') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_the_constant_result_mark_is_the_one_torch_sets():
    """kernels.grouped_gemm marks a function as torch.compiler.assume_constant_result does, without
    importing Dynamo; a torch that marks it otherwise fails here."""
    from kernels.grouped_gemm import _constant_result

    def ours():
        return True

    def torchs():
        return True

    _constant_result(ours)
    torch_marked = torch.compiler.assume_constant_result(torchs)
    assert torch_marked is torchs
    added = dict(vars(torchs))
    assert added and vars(ours) == added
