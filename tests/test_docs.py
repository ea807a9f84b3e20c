"""The README and the docs as users read them: their Python examples run, their commands exist, their
links resolve, and no text in the repository tells its own history.

- Every ```python block of README.md and docs/*.md runs on the CPU, a page's blocks in order in one
  namespace (a page may build on its earlier blocks), in a fresh process per page.
- Every `python -m <module>` (or `torchrun ... -m <module>`) line of a ```bash block names a module
  whose `--help` exits 0.
- Every relative link of those pages names a file of the repository.
- The word HISTORY_WORD (the unit of work a history would be told in) appears in no tracked text
  file, outside the uses ALLOWED_USES lists.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT_SUFFIXES = {".md", ".py", ".toml", ".json", ".txt", ".cfg", ".sh", ".yml", ".yaml"}
HISTORY_WORD = "sess" + "ion"  # in two pieces, so that a search of the repository for it finds no use
ALLOWED_USES: list[str] = []  # lines (stripped) where the word is a technical term, not history


def _blocks(page: pathlib.Path, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", page.read_text(), re.S | re.M)


def _tracked_text_files() -> list[pathlib.Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:  # not a git checkout: every file under the root
        return [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and p.suffix in TEXT_SUFFIXES]
    return [ROOT / name for name in listed.stdout.splitlines() if pathlib.Path(name).suffix in TEXT_SUFFIXES]


_RUN_PAGE = """
import sys
blocks = {blocks!r}
namespace = {{"__name__": "__main__"}}
for number, code in enumerate(blocks, 1):
    try:
        exec(compile(code, f"{page}, python block {{number}}", "exec"), namespace)
    except BaseException:
        print(f"{page}: python block {{number}} failed", file=sys.stderr)
        raise
"""


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python")], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path):
    code = _RUN_PAGE.format(blocks=_blocks(page, "python"), page=page.relative_to(ROOT))
    env = {**__import__("os").environ, "MOE_CPU_GEMM": "blas", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]


def _commanded_modules() -> dict[str, str]:
    """module -> the first page naming it in a ```bash block."""
    modules = {}
    for page in PAGES:
        for block in _blocks(page, "bash"):
            for line in block.splitlines():
                match = re.search(r"(?:^|\s)(?:python3? |torchrun .*?)-m ([\w.]+)", line.split("#")[0])
                if match and match.group(1) not in ("pip", "pytest", "venv"):
                    modules.setdefault(match.group(1), page.name)
    return modules


_HELP = """
import runpy, sys
failed = []
for module in {modules!r}:
    sys.argv = [module, "--help"]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        failed.append(module + ": no exit")
    except SystemExit as exit:
        if exit.code not in (0, None):
            failed.append(module + ": exit " + str(exit.code))
    except BaseException as error:
        failed.append(module + ": " + repr(error))
print("\\n".join("FAILED: " + line for line in failed))
"""


@pytest.mark.slow
def test_every_commanded_module_answers_help(tmp_path):
    modules = _commanded_modules()
    assert "recipes.gpt" in modules, "the README's main job is a python -m command"
    done = subprocess.run([sys.executable, "-c", _HELP.format(modules=sorted(modules))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "PYTHONPATH": str(ROOT)})
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED: ")]
    assert done.returncode == 0 and not failed, (failed, done.stderr[-2000:])


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links in code are code
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#")[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_text_tells_the_repositorys_history():
    found = []
    for path in _tracked_text_files():
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if re.search(rf"\b{HISTORY_WORD}s?\b", line, re.I) and line.strip() not in ALLOWED_USES:
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, found
