"""Every tensor factory in the library names its device, so nothing lands on the CPU by default.

A factory without `device=` makes a CPU tensor; on a GPU run that tensor would meet CUDA tensors (an
error) or reach NCCL (refused). The simulated GPU tier runs the padded layouts end to end; this scan
covers every path, including the packed and grouped layouts whose split sizes meta cannot supply.
Exceptions are listed with the reason: host-side work by design.
"""

import ast
import pathlib

FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace",
             "eye", "empty_strided", "as_tensor"}
PACKAGES = ("moe", "kernels", "parallel", "optim")
ROOT = pathlib.Path(__file__).resolve().parents[1]
# (file, function): why a CPU tensor is right there
HOST_SIDE = {
    ("kernels/cpu/gemm.py", "_onednn_op"): "a one-off probe of the CPU's oneDNN",
    ("kernels/cpu/workspace.py", None): "the CPU pool; it serves CPU requests only",
    ("kernels/grouped_gemm.py", "_torch_grouped_mm_runs"): "a probe on the device it is asked about",
    ("optim/checkpoint.py", None): "checkpoints are written and read on the host",
    ("optim/schedulers.py", None): "learning rates are host floats",
    ("optim/monitor.py", "_load_histogram"): "TensorBoard pictures are drawn on the host",
    ("optim/monitor.py", "load_heatmap"): "TensorBoard pictures are drawn on the host",
}


class _Scan(ast.NodeVisitor):
    """Factory calls without device=, each with its innermost enclosing function."""

    def __init__(self, relative: str):
        self.relative, self.stack, self.found = relative, [None], []

    def visit_FunctionDef(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node):
        func = node.func
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch"
                and func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords)
                and (self.relative, self.stack[-1]) not in HOST_SIDE and (self.relative, None) not in HOST_SIDE):
            self.found.append(f"{self.relative}:{node.lineno} torch.{func.attr} in {self.stack[-1] or 'module'}")
        self.generic_visit(node)


def _missing_device(path: pathlib.Path) -> list[str]:
    scan = _Scan(path.relative_to(ROOT).as_posix())
    scan.visit(ast.parse(path.read_text()))
    return scan.found


def test_every_tensor_factory_names_its_device():
    missing = sorted({m for package in PACKAGES for path in (ROOT / package).rglob("*.py") for m in _missing_device(path)})
    assert not missing, "tensor factories without device=:\n" + "\n".join(missing)
