"""Sparse upcycling: turn a dense model's MLPs into MoE layers whose experts are copies of the MLP.

Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints": every
expert of an upcycled layer starts as the dense MLP it replaces, and only the router is new. With the
kept combine weights renormalised to sum to one (norm_topk_prob=True) and no choice dropped
(dropless), a token's output is sum_k w_k * mlp(x) = mlp(x): before training, the upcycled model
computes the dense model's function, up to the rounding of that weighted sum.

The MLPs are found by name and shape, never by class, so this module needs no model library: any
nn.Sequential(Linear, activation, Linear) and any module with gate_proj, up_proj and down_proj (the
SwiGLU MLP of Llama, Qwen2, Mistral in `transformers`) qualifies. It must not import `transformers` or
`recipes`: the copies are made by `moe.Experts`, which deep-copies any module and holds the forms it
knows as stacked weights: the plain MLP, and the gated `moe.SwiGLU`; a library's own gated MLP class,
whose forward `moe.Experts` cannot vouch for, stays module copies.
"""

from collections.abc import Callable

import torch
from torch import nn

from moe.layer import MoE

__all__ = ["UpcycledMLP", "upcycle"]

MLP_NAMES = ("mlp", "ffn")
ROUTER_INITS = ("normal", "zeros")
# moe.MoE arguments upcycle sets itself: the experts are copies, and the exactness needs these
_FIXED = ("hidden_size", "expert", "num_experts", "k", "expert_init")


class UpcycledMLP(nn.Module):
    """An MoE layer in an MLP's place: forward returns the output tensor alone, as the MLP did.

    The layer's load-balancing loss of the last forward is `l_aux` (and its router z-loss `z_loss`),
    for the training loop to add to the loss; `moe` is the `moe.MoE` layer.
    """

    def __init__(self, moe: MoE):
        super().__init__()
        self.moe = moe
        self.l_aux = self.exp_counts = None

    @property
    def z_loss(self) -> torch.Tensor | None:
        return self.moe.z_loss

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output, self.l_aux, self.exp_counts = self.moe(hidden_states)
        return output

    def __getstate__(self):
        """Copied without the last forward's loss and counts: they hold the forward's graph."""
        state = self.__dict__.copy()
        state.update(l_aux=None, exp_counts=None)
        return state


def _is_dense_mlp(module: nn.Module) -> bool:
    """An nn.Sequential(Linear, activation, Linear), or a gated MLP with gate_proj, up_proj and down_proj."""
    if type(module) is nn.Sequential and len(module) == 3:
        first, _, second = module
        return type(first) is nn.Linear and type(second) is nn.Linear
    return all(isinstance(getattr(module, name, None), nn.Linear) for name in ("gate_proj", "up_proj", "down_proj"))


def _hidden_size(module: nn.Module) -> int | None:
    """The input width of the MLP: its first Linear's in_features."""
    if isinstance(getattr(module, "gate_proj", None), nn.Linear):
        return module.gate_proj.in_features
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    return None if first is None else first.in_features


def _selector(modules) -> Callable[[str, nn.Module], bool]:
    """The predicate (qualified name, module) -> bool that `modules` describes."""
    if modules is None:
        return lambda name, module: name.rpartition(".")[2] in MLP_NAMES and _is_dense_mlp(module)
    if callable(modules):
        return modules
    if isinstance(modules, str) or not all(isinstance(name, str) for name in modules):
        raise TypeError(f"modules must be None, a sequence of module names or a callable, got {modules!r}")
    names = set(modules)
    return lambda name, module: name in names or name.rpartition(".")[2] in names


def _find_mlps(model: nn.Module, select) -> list[tuple[str, nn.Module]]:
    """The selected modules, outermost first; none inside another selected one."""
    found = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if select(name, module):
            found.append((name, module))
    return found


@torch.no_grad()
def _add_noise(experts: nn.Module, expert_noise: float, generator: torch.Generator) -> None:
    """Multiply every expert weight by (1 + expert_noise * N(0, 1)), elementwise: noise relative to the weight."""
    for param in experts.parameters():
        noise = torch.randn(param.shape, generator=generator, device=generator.device, dtype=torch.float32)
        param.mul_(1 + expert_noise * noise.to(device=param.device, dtype=param.dtype))


@torch.no_grad()
def _init_router(router: nn.Linear, router_init: str, router_std: float, generator: torch.Generator) -> None:
    if router_init == "zeros":
        router.weight.zero_()
        return
    weight = torch.randn(router.weight.shape, generator=generator, device=generator.device, dtype=torch.float32)
    router.weight.copy_(weight * router_std)


def _check(num_experts, k, expert_noise, router_init, router_std, moe_kwargs) -> None:
    """Bad arguments fail here, before any module is replaced."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k ({k!r}) must be an int between 1 and num_experts ({num_experts})")
    if not expert_noise >= 0:
        raise ValueError(f"expert_noise must be >= 0, got {expert_noise!r}")
    if router_init not in ROUTER_INITS:
        raise ValueError(f"router_init must be one of {ROUTER_INITS}, got {router_init!r}")
    if not router_std >= 0:
        raise ValueError(f"router_std must be >= 0, got {router_std!r}")
    fixed = sorted(set(moe_kwargs) & set(_FIXED))
    if fixed:
        raise ValueError(f"upcycle sets {fixed} itself (the experts are copies of each MLP); do not pass them")


def upcycle(model: nn.Module, num_experts: int, k: int = 2, *, modules=None, expert_noise: float = 0.0,
            router_init: str = "normal", router_std: float = 0.02, seed: int = 0, return_tuple: bool = False,
            **moe_kwargs) -> nn.Module:
    """Replace the dense MLPs of `model`, in place, by MoE layers whose experts are copies of each MLP.

    Stages, per MLP found: build `moe.MoE(hidden_size, mlp, num_experts, k=k, expert_init="copy",
    norm_topk_prob=True, dropless=True, **moe_kwargs)`, whose experts are deep copies of the MLP; move
    it to the MLP's device; perturb the copies when expert_noise > 0; initialise the router; put it in
    the MLP's place.

    At the defaults every token's kept combine weights sum to one and no choice is dropped, so the
    upcycled model gives the dense model's outputs (to rounding) until its first update. Overriding
    norm_topk_prob=False, dropless=False with drop_tokens=True, expert_noise > 0, use_residual or shared
    experts gives that up. The paper trains a new router from a random start, and so does the default:
    a zero-mean normal of std router_std (Mesh TensorFlow's and Flaxformer's router initialiser).
    router_init="zeros" starts from uniform scores; then every top-k ties and, ties going to the lowest
    index, all tokens pick experts 0 ... k-1 at the start, so the other experts receive no gradient
    until the router learns to send tokens to them.

    Args:
        model: the dense model; changed in place and returned.
        num_experts: E, experts per upcycled layer.
        k: choices per token.
        modules: which modules to upcycle: None (modules named `mlp` or `ffn` that are an
            nn.Sequential(Linear, activation, Linear) or have gate_proj, up_proj and down_proj), a
            sequence of names (a qualified name as `named_modules` gives it, or its last component), or a
            callable (qualified name, module) -> bool. Modules inside a selected one are not considered.
        expert_noise: multiply each expert weight by (1 + expert_noise * N(0, 1)), independently per
            element and expert; 0 keeps exact copies.
        router_init: "normal" (std router_std) or "zeros".
        router_std: the standard deviation of the "normal" router initialisation.
        seed: seeds the noise and the router weights (a generator of its own; the global RNG is untouched).
        return_tuple: put the `moe.MoE` itself in place, whose forward returns (output, l_aux,
            exp_counts), for models whose forward collects the tuple (recipes.gpt_model's blocks);
            False puts an `UpcycledMLP` there, which returns the output alone and keeps `l_aux`.
        **moe_kwargs: further `moe.MoE` arguments (ep_size, capacity_factor, noisy_gate_policy, ...).

    Returns:
        model, with its MLPs replaced.

    Raises:
        ValueError: k is not within 1 ... num_experts; a bad expert_noise, router_init or router_std;
            moe_kwargs names an argument upcycle sets; or no module of `model` matches `modules`.
        TypeError: modules is of another type.
    """
    _check(num_experts, k, expert_noise, router_init, router_std, moe_kwargs)
    found = _find_mlps(model, _selector(modules))
    if not found:
        wanted = f"modules named {list(MLP_NAMES)} that are dense MLPs" if modules is None else f"modules={modules!r}"
        raise ValueError(f"no MLP to upcycle in {type(model).__name__}: no module matches {wanted}")
    options = dict(norm_topk_prob=True, dropless=True) | moe_kwargs
    generator = torch.Generator().manual_seed(seed)
    for name, mlp in found:
        hidden_size = _hidden_size(mlp)
        if hidden_size is None:
            raise ValueError(f"module {name!r} has no nn.Linear to read its hidden size from")
        device = next(mlp.parameters()).device
        layer = MoE(hidden_size, mlp, num_experts, k=k, expert_init="copy", **options).to(device=device)
        if expert_noise:
            _add_noise(layer.deepspeed_moe.experts, expert_noise, generator)
        _init_router(layer.deepspeed_moe.gate.wg, router_init, router_std, generator)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer if return_tuple else UpcycledMLP(layer))
    return model
