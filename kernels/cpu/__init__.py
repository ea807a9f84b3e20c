"""CPU-only performance machinery, in one place, behind the small interface the layers call.

    products  linear, linear_tn, by_rows_class      each product through the backend measured fastest
                                                    for its shape class (gemm.py)
    choices   backend (a CpuBackend)                the measured choices of this process: plans too
                                                    (`backend.choose`, `backend.kept`), saved with
                                                    checkpoints (`backend.choices`, `backend.adopt`);
                                                    shape_key, class_rows, measuring, widened_only,
                                                    worth_measuring (choices.py, gemm.py)
    workers   run_each, workers, openmp_team        independent items side by side on single-threaded
                                                    workers: torch's OpenMP team, or a pool (threads.py)
    memory    empty, empty_like, allocator_reuses,  reusable memory for large temporaries, and the
              keep_freed_memory                     allocator asked to keep freed memory (workspace.py)

None of it changes results: every choice is measured once per shape class and kept for the process,
workers run each item on one thread whichever worker takes it, and pooled memory is handed out only
when no tensor uses it. On other devices and under torch.compile each call is the plain torch one.
"""

from kernels.cpu import choices, gemm, threads, workspace
from kernels.cpu.choices import CpuBackend, backend, class_rows, cpu_model, shape_key
from kernels.cpu.gemm import by_rows_class, linear, linear_tn, measuring, widened_only, worth_measuring
from kernels.cpu.threads import openmp_team, run_each, workers
from kernels.cpu.workspace import allocator_reuses, empty, empty_like, keep_freed_memory

__all__ = ["CpuBackend", "allocator_reuses", "backend", "by_rows_class", "choices", "class_rows", "cpu_model", "empty",
           "empty_like", "gemm", "keep_freed_memory", "linear", "linear_tn", "measuring", "openmp_team", "run_each",
           "shape_key", "threads", "widened_only", "workers", "workspace", "worth_measuring"]
