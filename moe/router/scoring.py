"""Scoring: the logits a policy takes (checked, in fp32) and the scores it ranks experts by.

Shape legend: S tokens, E experts.

A score per (token, expert) is softmax(logits) over the experts or sigmoid(logits) (`SCORING_FUNCS`).
Everything computes in fp32 whatever the model dtype (float64 inputs stay float64, for gradient
checks). On the CPU the softmax of fewer than 16 experts is taken in the order of a full SIMD vector
(`expert_softmax`): last bits may differ from F.softmax's on AVX-512, and are the same on AVX2 and
AVX-512. Sigmoid is torch.sigmoid, taken where the policy needs it (`moe.router.selection.topkgating`).
"""

import torch
import torch.nn.functional as F

from kernels import sync_checks

__all__ = ["SCORING_FUNCS", "expert_softmax"]

SCORING_FUNCS = ("softmax", "sigmoid")


def _gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every model dtype; float64 stays float64 (gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def _check_logits(logits: torch.Tensor, k: int) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [S, E], got {list(logits.shape)}")
    num_experts = logits.shape[1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k ({k}) must be between 1 and num_experts ({num_experts})")
    logits = logits.to(_gate_dtype(logits.dtype))
    if sync_checks() and not bool(torch.isfinite(logits).all()):  # a host sync: opt-in (kernels.backend)
        raise ValueError("logits contain non-finite values (inf or nan); check the gate input")
    return logits


# On the CPU the part of a softmax row that does not fill a SIMD vector (16 fp32 lanes with AVX-512, 8
# with AVX2) takes a slow partial-vector path that also sums in another order than a full vector does;
# a row shorter than one vector is all such a part
SOFTMAX_ROW = 16


def expert_softmax(logits_SE: torch.Tensor) -> torch.Tensor:
    """softmax over experts (dim 1), differentiable; on the CPU rows of fewer than SOFTMAX_ROW experts
    are padded with -inf to SOFTMAX_ROW lanes (but for 8 fp32 experts under AVX2 kernels, whose plain
    softmax already has the padded row's bits: `_full_avx2_row`).

    The padded lanes add exact zeros, so this is softmax(logits) up to the order of the row's sum
    (within 1e-6 relative of F.softmax), and the same bits on AVX-512 and AVX2 kernels (where
    F.softmax of 8 experts differs in the last bit between the two); each token's gates depend on its
    logits alone, not on the batch or the thread count. The padded row also runs on the full-vector
    path, which is faster than the partial-vector path a short row takes in F.softmax.

    Returns:
        gates_SE: contiguous, shape and dtype of logits_SE.
    """
    num_experts = logits_SE.shape[1]
    if logits_SE.device.type != "cpu" or num_experts >= SOFTMAX_ROW or _full_avx2_row(logits_SE):
        return F.softmax(logits_SE, dim=1)
    padded_SX = F.pad(logits_SE, (0, SOFTMAX_ROW - num_experts), value=float("-inf"))
    return F.softmax(padded_SX, dim=1).narrow(1, 0, num_experts).contiguous()


# torch's CPU kernels in this process ("AVX2", "AVX512", "DEFAULT", ...; ATEN_CPU_CAPABILITY lowers
# it): read once at import, a plain value that torch.compile traces through
_CPU_CAPABILITY = torch.backends.cpu.get_cpu_capability()


def _full_avx2_row(logits_SE: torch.Tensor) -> bool:
    """Rows of 8 fp32 logits under torch's AVX2 kernels: one full vector, whose softmax has the bits of
    the padded row (the padding's second vector adds zeros), without the cost of that second vector."""
    return logits_SE.shape[1] == 8 and logits_SE.dtype == torch.float32 and _CPU_CAPABILITY == "AVX2"
