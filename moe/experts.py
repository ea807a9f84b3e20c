"""Experts: L local copies of the user's expert module, run on the rows routed to each.

Shape legend: N rows of the dispatch buffer, M model dim, H expert hidden dim, L local experts,
C capacity.

Any `nn.Module` works: it is deep-copied per local expert (DeepSpeed's behaviour) and called once per
expert on that expert's rows. Two forms are instead held as stacked weights and run without a module
call per expert:

- a plain MLP, nn.Sequential(Linear, elementwise activation, Linear): weight1 [L, H, M], bias1 [L, H],
  weight2 [L, M, H], bias2 [L, M];
- a gated MLP, `SwiGLU` (down(act(gate(x)) * up(x)), no biases): weight1 [L, 2H, M], each expert's
  gate rows then its up rows, so that one product makes both, and weight2 [L, M, H]; no biases.

The gated form is recognised by its type, `SwiGLU` exactly: a module that merely has gate_proj,
up_proj and down_proj may compute something else with them, and a stacked run must equal its loop.
Either form runs in one of these layouts:

- packed: rows sorted by expert with no padding; products per expert on its slice, or one grouped
  GEMM for all experts (`kernels.grouped_gemm`), so empty capacity slots cost nothing
  (`moe.grouped_mlp`).
- padded: the [L, C, M] capacity buffer, batched products (`baddbmm`); no host sync, suits GPUs.

Both equal the per-module loop. State dicts load either way: a stacked layer accepts the per-expert
keys of the loop form (and DeepSpeed's), and a loop layer accepts the stacked keys.
"""

import copy

import torch
from torch import nn

from moe.autocast import autocast_dtype
from moe.grouped_mlp import apply_activation, grouped_mlp
from parallel import tag_expert_ids, tag_expert_parameters, tag_template_copy

__all__ = ["Experts", "SwiGLU"]

# Elementwise activation modules the stacked path runs itself, by name.
_ACTIVATIONS = {nn.ReLU: "relu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Tanh: "tanh", nn.Sigmoid: "sigmoid"}
# each stacked tensor and the module parameters it holds, per expert concatenated on dim 0, by form
_MODULE_KEYS = {
    "plain": {"weight1": ("0.weight",), "bias1": ("0.bias",), "weight2": ("2.weight",), "bias2": ("2.bias",)},
    "gated": {"weight1": ("gate_proj.weight", "up_proj.weight"), "weight2": ("down_proj.weight",)},
}


class SwiGLU(nn.Module):
    """A gated MLP expert, as Mixtral, Qwen-MoE, DeepSeek-V3 and OLMoE have them: down(act(gate(x)) * up(x)),
    no biases. With an activation module among nn.ReLU, GELU, SiLU, Tanh and Sigmoid, `Experts` holds its
    copies as stacked weights; with any other, as module copies.

    Args:
        hidden_size: M.
        intermediate_size: H.
        act_fn: the activation module (default nn.SiLU()).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act_fn: nn.Module | None = None):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = nn.SiLU() if act_fn is None else act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _stackable(expert: nn.Module):
    """(form, activation name, gelu approximation, has biases) when `expert` is a plain or a gated MLP the
    stacked path runs, else None."""
    mlp = _plain_mlp(expert)
    if mlp is not None:
        first, name, approximate, _ = mlp
        return "plain", name, approximate, first.bias is not None
    if type(expert) is not SwiGLU or type(expert.act_fn) not in _ACTIVATIONS:
        return None
    gate, up, down = expert.gate_proj, expert.up_proj, expert.down_proj
    if any(type(p) is not nn.Linear or p.bias is not None for p in (gate, up, down)):
        return None
    if gate.weight.shape != up.weight.shape or down.in_features != gate.out_features:
        return None
    return "gated", _ACTIVATIONS[type(expert.act_fn)], getattr(expert.act_fn, "approximate", "none"), False


def _plain_mlp(expert: nn.Module):
    """(linear1, activation name, gelu approximation, linear2) when `expert` is Linear-act-Linear, else None."""
    if type(expert) is not nn.Sequential or len(expert) != 3:
        return None
    first, act, second = expert
    if type(first) is not nn.Linear or type(second) is not nn.Linear or type(act) not in _ACTIVATIONS:
        return None
    if first.out_features != second.in_features or (first.bias is None) != (second.bias is None):
        return None
    approximate = getattr(act, "approximate", "none")
    return first, _ACTIVATIONS[type(act)], approximate, second


def _batched_linear(x_LCI: torch.Tensor, weight_LOI: torch.Tensor, bias_LO: torch.Tensor | None) -> torch.Tensor:
    """Per-expert x @ W^T + b over the capacity buffer, one batched product."""
    if bias_LO is None:
        return torch.bmm(x_LCI, weight_LOI.transpose(1, 2))
    return torch.baddbmm(bias_LO.unsqueeze(1), x_LCI, weight_LOI.transpose(1, 2))


def _copy_expert(expert: nn.Module, seed: tuple[int, int] | None, local: int) -> nn.Module:
    """A deep copy; with a seed, re-initialised from (seed, global id) without touching the global RNG."""
    module = copy.deepcopy(expert)
    if seed is not None:
        base, first = seed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(base * 1_000_003 + first + local)
            for sub in module.modules():
                if hasattr(sub, "reset_parameters"):
                    sub.reset_parameters()
    return module


class Experts(nn.Module):
    """The local experts of one MoE layer.

    Args:
        expert: the expert module; deep-copied `num_local_experts` times.
        num_local_experts: L.
        expert_group_name: name of the expert-data-parallel group, set on every parameter as
            `group_name` (with `allreduce = False`) so the optimizer can find them.
        stacked: hold a plain MLP expert as stacked weights (True), as module copies (False), or
            decide by the expert's type ("auto").
        seed: (seed, first global expert id): re-initialise local expert l from (seed, first + l)
            with its modules' reset_parameters, so weights do not depend on the expert-parallel
            layout; None keeps DeepSpeed's identical deep copies.
        first_expert: the global id of local expert 0 (tagged on the parameters for checkpoints).
        use_data_before_expert_parallel: the rank layout of the expert groups (tagged on the parameters).
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None,
                 stacked: bool | str = "auto", seed: tuple[int, int] | None = None, first_expert: int = 0,
                 use_data_before_expert_parallel: bool = False):
        super().__init__()
        if not isinstance(expert, nn.Module):
            raise TypeError(f"expert must be an nn.Module, got {type(expert).__name__}")
        if stacked not in (True, False, "auto"):
            raise ValueError(f"stacked must be True, False or 'auto', got {stacked!r}")
        form = _stackable(expert)
        if stacked is True and form is None:
            raise ValueError(
                f"stacked=True needs an nn.Sequential(Linear, activation, Linear) or a moe.SwiGLU expert without "
                f"biases, with an activation among {sorted(_ACTIVATIONS.values())}, got {type(expert).__name__}"
            )
        self.num_local_experts = num_local_experts
        self.stacked = form is not None and stacked in (True, "auto")
        self.gated = self.stacked and form[0] == "gated"
        copies = [_copy_expert(expert, seed, e) for e in range(num_local_experts)]
        if self.stacked:
            _, self.activation, self.approximate, has_bias = form
            self.bias1 = self.bias2 = None
            keys = _MODULE_KEYS[form[0]]
            for key in ("weight1", "weight2", "bias1", "bias2") if has_bias else ("weight1", "weight2"):
                parts = [torch.cat([c.get_parameter(name).detach() for name in keys[key]]) for c in copies]
                setattr(self, key, nn.Parameter(torch.stack(parts)))
        else:
            self.deepspeed_experts = nn.ModuleList(copies)
        self._tags = (expert_group_name, seed[1] if seed is not None else first_expert, use_data_before_expert_parallel)
        self._tag()
        if seed is None:  # expert_init="copy": initialize starts every rank's copies from rank 0's template
            for param in self.parameters():
                tag_template_copy(param)
        self._register_load_state_dict_pre_hook(self._convert_state_dict)

    def place(self, first_expert: int, expert: nn.Module | None = None, seed: int | None = None) -> None:
        """Hold global experts first_expert ... first_expert + L - 1 (once the expert-parallel rank is known).

        Re-tags the parameters; with `seed` (expert_init="per_expert_seed") the local experts are
        re-initialised from (seed, first_expert + l) on a fresh deep copy of `expert`.
        """
        group_name, first, data_before = self._tags
        if first_expert == first:
            return
        if seed is not None:
            fresh = Experts(expert, self.num_local_experts, group_name, "auto" if self.stacked else False,
                            (seed, first_expert), first_expert, data_before)
            with torch.no_grad():
                for mine, new in zip(self.parameters(), fresh.parameters()):
                    mine.copy_(new)
        self._tags = (group_name, first_expert, data_before)
        self._tag()

    def __setstate__(self, state):
        """Re-tag after deepcopy or unpickling: nn.Parameter's deepcopy drops its attributes."""
        super().__setstate__(state)
        self._tag()

    def _tag(self) -> None:
        """Tag the parameters as expert parameters of their group, and with the global experts they hold."""
        group_name, first, data_before = self._tags
        if group_name is not None:
            tag_expert_parameters(self.parameters(), group_name, data_before)
        ids = tuple(range(first, first + self.num_local_experts))
        if self.stacked:
            for param in self.parameters():
                tag_expert_ids(param, ids, 0)
            return
        for local, expert in enumerate(self.deepspeed_experts):
            for name, param in expert.named_parameters():
                tag_expert_ids(param, (first + local,), None, f"deepspeed_experts.{local}.{name}",
                               f"deepspeed_experts.{first + local}.{name}")

    def forward(self, buffer_NM: torch.Tensor, counts: list[int] | None = None, grouped_gemm: bool | None = False
                ) -> torch.Tensor:
        """Run every expert on its rows.

        Args:
            buffer_NM: rows sorted by expert, shape [N, M]: packed (N = sum(counts)) when counts is
                given, else the padded capacity buffer (N = L * C).
            counts: rows per local expert for the packed layout, a list of L ints; for stacked experts
                with grouped_gemm also an int tensor [L] on the device, the rows after them padding.
            grouped_gemm: for stacked experts on packed rows, one grouped GEMM per layer (True), products
                per expert (False), or on the CPU whichever was measured faster (None).

        Returns:
            y_NM: the experts' outputs, shape [N, M_out].
        """
        if counts is None:
            if buffer_NM.shape[0] % self.num_local_experts:
                raise ValueError(
                    f"the padded buffer's rows ({buffer_NM.shape[0]}) must be divisible by the number of local "
                    f"experts ({self.num_local_experts})"
                )
            if self.stacked:
                return self._padded(buffer_NM)
            counts = [buffer_NM.shape[0] // self.num_local_experts] * self.num_local_experts
        if isinstance(counts, torch.Tensor):
            if not (self.stacked and grouped_gemm):
                raise ValueError("counts on the device need stacked experts and grouped_gemm=True; pass a list")
        elif len(counts) != self.num_local_experts or sum(counts) != buffer_NM.shape[0]:
            raise ValueError(f"counts {counts} must have {self.num_local_experts} entries summing to {buffer_NM.shape[0]}")
        if self.stacked:
            weights = (self.weight1, self.bias1, self.weight2, self.bias2)
            dtype = autocast_dtype(buffer_NM.device)
            if dtype is not None:  # autocast does not reach the grouped products
                buffer_NM = buffer_NM.to(dtype)
                weights = tuple(w.to(dtype) if w is not None else None for w in weights)
            return grouped_mlp(buffer_NM, *weights, counts, self.activation, self.approximate, grouped_gemm, self.gated)
        outputs = []
        for expert, chunk in zip(self.deepspeed_experts, torch.split(buffer_NM, counts)):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs)

    def _padded(self, buffer_NM: torch.Tensor) -> torch.Tensor:
        x_LCM = buffer_NM.view(self.num_local_experts, -1, buffer_NM.shape[1])
        h_LCH = _batched_linear(x_LCM, self.weight1, self.bias1)
        a_LCH = apply_activation(h_LCH, self.activation, self.approximate, self.gated)  # gated: h is [gate | up]
        y_LCM = _batched_linear(a_LCH, self.weight2, self.bias2)
        return y_LCM.reshape(-1, y_LCM.shape[2])

    def expert_tensors(self, local: int) -> dict[str, torch.Tensor]:
        """Local expert `local`'s parameters under its module's names ("0.weight", "gate_proj.weight", ...):
        the module's own when held as copies; when stacked, views of the stacked weights (writes under
        no_grad reach the layer)."""
        if not self.stacked:
            return dict(self.deepspeed_experts[local].named_parameters())
        tensors = {}
        for key, names in _MODULE_KEYS[self._form].items():
            stacked = getattr(self, key)
            if stacked is not None:
                tensors.update(zip(names, stacked[local].chunk(len(names))))
        return tensors

    @property
    def _form(self) -> str:
        """The module form whose keys the experts' state dict converts to and from: "gated" or "plain"."""
        if self.stacked:
            return "gated" if self.gated else "plain"
        return "gated" if hasattr(self.deepspeed_experts[0], "gate_proj") else "plain"

    def _convert_state_dict(self, state_dict, prefix, *args):
        """Accept the other layout's keys: per-expert module keys into stacked ones, or the reverse."""
        keys, experts = _MODULE_KEYS[self._form], range(self.num_local_experts)
        if self.stacked and f"{prefix}deepspeed_experts.0.{keys['weight1'][0]}" in state_dict:
            for key, names in keys.items():
                parts = [[state_dict.pop(f"{prefix}deepspeed_experts.{e}.{name}", None) for name in names]
                         for e in experts]
                if all(p is not None for expert in parts for p in expert):
                    state_dict[prefix + key] = torch.stack([torch.cat(expert) for expert in parts])
        elif not self.stacked and f"{prefix}weight1" in state_dict:
            for key, names in keys.items():
                stacked = state_dict.pop(prefix + key, None)
                if stacked is not None:
                    for e in experts:
                        for name, part in zip(names, stacked[e].chunk(len(names))):
                            state_dict[f"{prefix}deepspeed_experts.{e}.{name}"] = part
