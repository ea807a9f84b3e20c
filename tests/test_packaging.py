"""The five top-level packages are this project's, and imports between them point one way."""

import ast
import importlib
import importlib.metadata
import pathlib

import pytest

PACKAGES = ("moe", "parallel", "optim", "kernels", "recipes")
ALLOWED = {  # package -> project packages it may import (STYLE.md)
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
