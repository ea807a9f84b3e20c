"""The router's scores: expert_softmax is softmax over experts, with the same bits whatever the batch,
the thread count or the CPU's kernels.
"""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from moe.router.scoring import expert_softmax

ROOT = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("num_experts", [1, 2, 7, 8, 15, 16, 20])
def test_expert_softmax_is_softmax_and_each_token_gets_its_gates_whatever_the_batch(num_experts):
    torch.manual_seed(num_experts)
    logits = torch.randn(1027, num_experts) * 3
    gates = expert_softmax(logits)
    assert gates.is_contiguous() and gates.shape == logits.shape
    torch.testing.assert_close(gates, F.softmax(logits, 1), rtol=1e-6, atol=1e-12)
    assert torch.equal(expert_softmax(logits[:1024]), gates[:1024]), "a token's gates depend on the batch size"
    assert torch.equal(expert_softmax(logits[517:518]), gates[517:518]), "a lone token gets other gates"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = expert_softmax(logits)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, gates), "the gates depend on the thread count"
    # differentiable, with softmax's gradient (float64: the padding keeps any dtype)
    x = torch.randn(6, num_experts, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(expert_softmax, (x,))


def test_expert_softmax_of_eight_experts_has_the_padded_rows_bits():
    # with AVX2 kernels a row of 8 fp32 logits is one full vector and takes plain F.softmax (a third of
    # the padded form's cost): its bits must be the padded row's, extreme and tied logits included
    torch.manual_seed(0)
    logits = torch.cat([torch.randn(4096, 8) * 3, torch.randn(512, 8) * 60, torch.zeros(64, 8),
                        torch.randint(-2, 3, (512, 8)).float(), torch.randn(64, 8) * 1e-30])
    padded = F.softmax(F.pad(logits, (0, 8), value=float("-inf")), dim=1).narrow(1, 0, 8)
    assert torch.equal(expert_softmax(logits), padded)
    # the kernels' capability is a plain value read at import: a compiled gate traces through it in one graph
    compiled = torch.compile(expert_softmax, backend="eager", fullgraph=True)
    assert torch.equal(compiled(logits[:64]), expert_softmax(logits[:64]))


_KERNEL_GATES = """
import hashlib, torch
from moe.router.scoring import expert_softmax
torch.manual_seed(0)
print(hashlib.sha256(expert_softmax(torch.randn(4099, 8) * 3).numpy().tobytes()).hexdigest())
"""


@pytest.mark.slow
def test_expert_softmax_gives_the_same_bits_with_avx2_kernels():
    # torch picks AVX-512, AVX2 or scalar kernels by the CPU (ATEN_CPU_CAPABILITY forces a lower one); on
    # an AVX-512 CPU this compares the two kernels, which give F.softmax of 8 experts different last bits
    def run(env):
        done = subprocess.run([sys.executable, "-c", _KERNEL_GATES], capture_output=True, text=True, timeout=120,
                              env={**os.environ, **env}, cwd=ROOT)  # this checkout's moe, not an installed one
        assert done.returncode == 0, done.stderr
        return done.stdout

    assert run({"ATEN_CPU_CAPABILITY": "avx2"}) == run({})
