"""The MoE layer: DeepSpeed-MoE's `MoE` surface over index-based dispatch.

Shape legend: S tokens, M model dim, E experts, L local experts, K choices per token, C capacity,
N rows of the dispatch buffer.

Forward, in five steps:
    1. route:         the gate (fp32) returns a Routing plan: expert, slot and weight per (token, choice).
    2. dispatch:      each kept choice gets a row, tokens are copied into their rows by index (never an
                      [S, E, C] tensor) and, under expert parallelism, travel to their experts' ranks
                      (a dispatcher of moe.dispatch, chosen by the layout and the exchange).
    3. experts:       each local expert runs on its rows.
    4. combine:       outputs return to their tokens by index, weighted, accumulated in fp32. Dropped
                      choices contribute zeros.
    5. shared expert: a dense MLP on every token, added (MoE.forward; its parameters are dense).
The residual connection is the model's business.
"""

import copy
import warnings

import torch
import torch.distributed as dist
from torch import nn

from kernels import cpu
from kernels.grouped_gemm import torch_backend_runs
from moe.autocast import autocast_dtype
from moe.dispatch import Dispatcher, make_dispatcher
from moe.experts import Experts, _plain_mlp
from moe.router.gate import TopKGate
from parallel import expert_groups, init_distributed

__all__ = ["MoE", "MOELayer"]

EXPERT_LAYOUTS = ("auto", "packed", "grouped", "padded")
EXPERT_INIT = ("copy", "per_expert_seed")
EXCHANGES = ("per_choice", "per_rank")


class MOELayer(nn.Module):
    """Route, dispatch, experts and combine for one process (DeepSpeed's `MOELayer`).

    Args:
        gate: the TopKGate.
        experts: the Experts holding this process's experts.
        ep_group_name: name of the expert-parallel group ("ep_size_<n>").
        ep_size: expert-parallel size.
        num_local_experts: L.
        ep_group: the expert-parallel process group (None when ep_size is 1).
        expert_layout: "packed" (rows sorted by expert, no padding, products per expert), "grouped"
            (the same rows, one grouped GEMM per layer), "padded" (the capacity
            buffer, batched products, no host sync) or "auto": on the CPU packed rows, where empty slots
            would cost product time, with per-expert or grouped products as measured (kernels.cpu.gemm);
            elsewhere grouped when dropless, and when dropping grouped too in bf16 where torch's own
            grouped GEMM runs for one process's stacked experts (no host sync either, and no empty
            slots multiplied), else padded.
        exchange: under expert parallelism, "per_choice" sends a token once per choice, "per_rank" once
            per destination rank (moe.dispatch.per_rank; packed or grouped layouts).

    The dispatcher for each resolved layout is made at its first forward and kept (`dispatcher(device,
    dtype)`); a new expert-parallel group replaces them.
    """

    def __init__(self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int,
                 expert_layout: str = "auto", ep_group=None, exchange: str = "per_choice"):
        super().__init__()
        if expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}, got {expert_layout!r}")
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if exchange == "per_rank" and expert_layout == "padded":
            raise ValueError("exchange='per_rank' sends variable rows per rank; expert_layout must be 'auto', "
                             "'packed' or 'grouped', got 'padded'")
        self.exchange = exchange
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.expert_layout = expert_layout
        self.ep_group = ep_group
        self.l_aux = self.exp_counts = self.z_loss = self.routing = None
        cpu.keep_freed_memory()  # before a compiled model's first step (see kernels.cpu.workspace)

    @property
    def ep_group(self):
        return self._ep_group

    @ep_group.setter
    def ep_group(self, group) -> None:
        self._ep_group = group
        self._dispatchers: dict[tuple, Dispatcher] = {}  # made again for the new group

    def __getstate__(self):
        """Pickled and deep-copied without the last forward's plan and losses: they hold the forward's graph
        and the plan's capacity resolver (a closure), which neither copies."""
        state = self.__dict__.copy()
        state.update(routing=None, l_aux=None, exp_counts=None, z_loss=None)
        return state

    def _layout(self, device: torch.device, dtype: torch.dtype) -> str:
        """The expert layout for a forward on `device` with inputs of `dtype`: "auto" resolves by device,
        by dropping and by what torch's grouped GEMM runs. Padded suits small layers on a GPU better
        than grouped (see docs/results.md), hence bf16 and torch's grouped GEMM only."""
        if self.expert_layout != "auto":
            return self.expert_layout
        if device.type == "cpu":
            return "packed"
        if not (self.gate.config.drop_tokens and self.exchange == "per_choice"):
            return "grouped"
        dtype = autocast_dtype(device) or dtype
        # fp32 and fp16 keep the padded layout until a GPU run times them
        experts = self.experts
        if (dtype == torch.bfloat16 and self.ep_size == 1 and experts.stacked
                and torch_backend_runs(device, dtype, (*experts.weight1.shape[1:], *experts.weight2.shape[1:]))):
            return "grouped"
        return "padded"

    def dispatcher(self, device: torch.device, dtype: torch.dtype) -> Dispatcher:
        """The dispatcher for a forward on `device` with inputs of `dtype`."""
        layout = self._layout(device, dtype)
        # every setting the choice reads is in the key: one changed after a forward makes a new dispatcher
        key = (layout, self.exchange, self.ep_size, self.expert_layout == "auto", self.experts.stacked,
               self.gate.config.drop_tokens)
        if key not in self._dispatchers:
            self._dispatchers[key] = make_dispatcher(
                layout, self.exchange, self.ep_size, self.ep_group, measured=key[3], stacked=key[4],
                equal_tokens=key[5])
        return self._dispatchers[key]

    def host_read(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why a forward on `device` with inputs of `dtype` reads a device value on the host (buffers sized
        by the routing, which a CUDA graph cannot capture), or None when it reads nothing."""
        layout = self._layout(device, dtype)
        if self.dispatcher(device, dtype).reads_counts:
            return (f"the {layout} layout{' under expert parallelism' if self.ep_size > 1 else ''} reads its "
                    "row counts on the host")
        if layout == "padded" and not self.gate.config.drop_tokens:
            return "the padded layout without dropping sizes its capacity from the routing"
        return None

    def forward(self, x_SM: torch.Tensor, used_token: torch.Tensor | None = None, seq_len: int | None = None
                ) -> torch.Tensor:
        # Host syncs: none in the gate and the padded layout with dropping; none for grouped stacked
        # experts in one process (a buffer of fixed size S * K, the counts stay on the device); one
        # otherwise (the dropless capacity, or the row counts that slice sizes and splits need).
        routing = self.gate(x_SM, used_token, seq_len)  # 1. route
        dispatcher = self.dispatcher(x_SM.device, x_SM.dtype)
        dispatched = dispatcher.dispatch(x_SM, routing)  # 2. dispatch
        y_NM = self.experts(dispatched.rows_NM, dispatched.counts, grouped_gemm=dispatcher.grouped_gemm)  # 3. experts
        out_SM = dispatcher.combine(y_NM, dispatched)  # 4. combine
        self.routing, self.l_aux, self.exp_counts, self.z_loss = routing, routing.l_aux, routing.exp_counts, routing.z_loss
        return out_SM


class MoE(nn.Module):
    """A Mixture-of-Experts layer with DeepSpeed-MoE's constructor and forward contract.

    Args:
        hidden_size: M, the token width.
        expert: the expert module (tokens [n, M] -> [n, M]); deep-copied per local expert. A plain
            nn.Sequential(Linear, ReLU/GELU/SiLU/Tanh/Sigmoid, Linear) and a gated `moe.SwiGLU` (no
            biases, one of those activations) run as stacked weights.
        num_experts: E, experts in the layer (over all expert-parallel ranks).
        ep_size: expert-parallel size; E must be divisible by it.
        k: choices per token (1: top-1, 2: top-2, more: top-k).
        capacity_factor: capacity factor in training.
        eval_capacity_factor: capacity factor in eval mode.
        min_capacity: the least number of slots per expert.
        use_residual: Residual MoE: out = moe_out * c0 + mlp_out * c1 with c = softmax(Linear(M, 2)(x)).
        noisy_gate_policy: None, "Jitter" or "RSample"; noise is applied in training only. DeepSpeed's MoE
            also takes the string "None" (what a script's `--noisy-gate-policy None` flag gives): so does
            this constructor, as None; the gate itself takes None only.
        drop_tokens: drop choices beyond capacity; False makes capacity the largest expert count.
        use_rts: random token selection over capacity (top-1, training only).
        use_tutel: accepted for compatibility; dispatch here is always index based.
        enable_expert_tensor_parallelism: must be False (expert tensor parallelism is not supported).
        top2_2nd_expert_sampling: Gumbel-sample the second expert for top-2 (training only).
        drop_policy: for k > 2, "probs" (keep the largest gates) or "position" (keep the first tokens).
        expert_layout: "auto", "packed", "grouped" or "padded"; see MOELayer. (`expert_compute`, its
            earlier name, is still accepted with a DeprecationWarning.)
        dropless: route every choice (implies drop_tokens=False) and pack tokens by expert with no
            padding on every device; experts run on variable-sized groups (MegaBlocks-style).
        expert_init: "copy" (DeepSpeed: every expert a deep copy of `expert`) or "per_expert_seed"
            (global expert g re-initialised from (seed, g): the same weights at any ep_size).
        seed: the seed for expert_init="per_expert_seed".
        use_data_before_expert_parallel: DeepSpeed's alternative rank layout (see parallel.groups).
        scoring_func, norm_topk_prob, routed_scaling_factor, bias_update_speed, load_balancing_type,
        n_group, topk_group, routing, router_bias: the router (see `TopKGateConfig`, `topkgating`,
            `moe.router.balancing`, `moe.router.expert_choice`). With bias_update_speed > 0 or global_aux_loss,
            the engine advances the gate after each optimizer step; a plain-torch loop calls
            `moe.update_routing(model)`.
            routing="expert_choice" uses other tokens of the batch to route each one, so in a causal
            language model it leaks information across positions.
        n_shared_experts: n > 0 adds a dense MLP of n experts' width (a plain-MLP `expert` is widened
            n times), applied to every token and added to the routed output (DeepSeekMoE, Qwen-MoE).
            Its parameters are dense: replicated, not expert-parallel.
        shared_expert: a module to use as the shared expert instead ([..., M] -> [..., M]).
        shared_expert_gate: scale the shared expert's output by sigmoid(Linear(M, 1)(x)) (Qwen's form).
        exchange: with ep_size > 1, "per_choice" (a token's row travels once per choice) or "per_rank"
            (once per destination rank, its choices expanded there: fewer bytes when a token picks
            several experts of one rank, as group-limited routing with n_group = ep_size arranges).

    With ep_size > 1 (under torchrun), this rank holds global experts ep_rank * L ... ep_rank * L + L - 1
    (L = num_experts / ep_size) and tokens travel to them by all-to-all within its expert-parallel
    group. The layer may be built before the process group exists, as DeepSpeed scripts do: its groups
    are made by `optim.initialize` or at its first forward (see `set_deepspeed_parallelism`).

    After each forward, `z_loss` holds the router z-loss (ST-MoE) of that forward, and
    `deepspeed_moe.routing` the full Routing plan.
    """

    def __init__(
        self, hidden_size: int, expert: nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
        capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
        use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
        use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True, *, drop_policy: str = "probs", expert_layout: str = "auto",
        dropless: bool = False, expert_init: str = "copy", seed: int = 0, use_data_before_expert_parallel: bool = False,
        scoring_func: str = "softmax", norm_topk_prob: bool | None = None, routed_scaling_factor: float = 1.0,
        bias_update_speed: float = 0.0, load_balancing_type: str = "aux_loss", n_group: int | None = None,
        topk_group: int | None = None, routing: str = "token_choice", n_shared_experts: int = 0,
        shared_expert: nn.Module | None = None, shared_expert_gate: bool = False, exchange: str = "per_choice",
        expert_compute: str | None = None, router_bias: bool = False,
    ):
        super().__init__()
        if noisy_gate_policy == "None":  # DeepSpeed's MoE takes the string too
            noisy_gate_policy = None
        if expert_compute is not None and expert_layout not in ("auto", expert_compute):
            raise ValueError(f"expert_compute is the earlier name of expert_layout; pass one, got expert_layout="
                             f"{expert_layout!r} and expert_compute={expert_compute!r}")
        if expert_compute is not None:  # the earlier name of expert_layout
            warnings.warn("MoE(expert_compute=...) is renamed expert_layout; expert_compute will be removed",
                          DeprecationWarning, stacklevel=2)
            expert_layout = expert_compute
        if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
            raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
        if isinstance(num_experts, int) and num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if enable_expert_tensor_parallelism:
            raise ValueError("enable_expert_tensor_parallelism=True is not supported; use False")
        if use_tutel:
            warnings.warn("use_tutel has no effect: dispatch is always index based", stacklevel=2)
        if dropless:
            if routing == "expert_choice":
                raise ValueError("routing='expert_choice' fills every expert with exactly C tokens; dropless must be False")
            if expert_layout == "padded":
                raise ValueError(
                    "dropless=True packs tokens without padding; expert_layout must be 'auto', 'packed' or 'grouped'"
                )
            drop_tokens = False
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
        if exchange == "per_rank" and expert_layout == "padded":
            raise ValueError("exchange='per_rank' sends variable rows per rank; expert_layout must be 'auto', "
                             "'packed' or 'grouped', got 'padded'")
        if expert_init not in EXPERT_INIT:
            raise ValueError(f"expert_init must be one of {EXPERT_INIT}, got {expert_init!r}")
        gate = TopKGate(  # validates the gating arguments before any group is built
            hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
            noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling, drop_policy,
            scoring_func=scoring_func, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor,
            bias_update_speed=bias_update_speed, load_balancing_type=load_balancing_type, n_group=n_group,
            topk_group=topk_group, routing=routing, router_bias=router_bias,
        )
        _check_expert_width(expert, hidden_size)
        shared = _shared_expert(expert, n_shared_experts, shared_expert, use_residual)
        # DeepSpeed builds the layer before any process group exists and makes its groups in
        # initialize: without torch.distributed the groups wait for initialize or the first forward
        joined = dist.is_available() and dist.is_initialized()
        groups = expert_groups(ep_size, use_data_before_expert_parallel) if ep_size > 1 and joined else None
        ep_group = gate.ep_group = groups.ep_group if groups else None
        self._pending = ep_size > 1 and groups is None
        self._use_data_before_expert_parallel = use_data_before_expert_parallel
        # the template and seed that re-initialise per-expert-seeded experts once the ep rank is known
        self._template = (expert, seed) if self._pending and expert_init == "per_expert_seed" else None
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        self.dropless = dropless
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_rank = groups.ep_rank if groups else 0
        first_expert = self.ep_rank * self.num_local_experts
        experts = Experts(
            expert, self.num_local_experts, self.expert_group_name,
            seed=(seed, first_expert) if expert_init == "per_expert_seed" else None, first_expert=first_expert,
            use_data_before_expert_parallel=use_data_before_expert_parallel,
        )
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, expert_layout, ep_group, exchange
        )
        # the experts' versions as built: a write before the groups exist would be lost to their re-initialisation
        self._built_versions = [p._version for p in experts.parameters()] if self._template else None
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self.shared_expert = shared
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared_expert_gate and shared else None
        if shared_expert_gate and shared is None:
            raise ValueError("shared_expert_gate=True needs a shared expert: set n_shared_experts or shared_expert")

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool | None = None) -> None:
        """Make this layer's expert-parallel groups (DeepSpeed's name; `optim.initialize` calls it).

        A layer built before torch.distributed was initialised waits for its groups: `initialize`, or
        its first forward, joins the process group torchrun describes and calls this. Then the layer
        takes its expert-parallel rank's experts (re-tagged, and re-initialised for
        expert_init="per_expert_seed"). Nothing happens for a layer that has its groups.

        Args:
            use_data_before_expert_parallel_: DeepSpeed's alternative rank layout; None keeps the
                layer's own `use_data_before_expert_parallel`.

        Raises:
            RuntimeError: torch.distributed is not initialised; or, with expert_init="per_expert_seed", the
                experts' weights were written since the layer was built on a rank that holds other experts.
            ValueError: ep_size does not divide the world size, or the layout differs from the layer's.
        """
        if not self._pending:
            return
        layout = self._use_data_before_expert_parallel
        if use_data_before_expert_parallel_ is not None and bool(use_data_before_expert_parallel_) != layout:
            raise ValueError(f"use_data_before_expert_parallel_ ({use_data_before_expert_parallel_}) differs from "
                             f"the layer's use_data_before_expert_parallel ({layout}); the experts were tagged with it")
        groups = expert_groups(self.ep_size, layout)
        self.ep_rank = groups.ep_rank
        experts = self.deepspeed_moe.experts
        if self._template and self.ep_rank and [p._version for p in experts.parameters()] != self._built_versions:
            raise RuntimeError("the experts' weights were written before the expert-parallel groups existed, and "
                               "expert_init='per_expert_seed' re-initialises them for this rank's global experts: "
                               "load weights after optim.initialize (or the first forward)")
        expert, seed = self._template or (None, None)
        experts.place(self.ep_rank * self.num_local_experts, expert, seed)
        self.deepspeed_moe.ep_group = self.deepspeed_moe.gate.ep_group = groups.ep_group
        self._pending, self._template = False, None

    def _join(self) -> None:
        """At a forward before the groups exist: join torchrun's process group and make them, or fail."""
        init_distributed()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"this MoE layer has ep_size ({self.ep_size}) > 1 and no process group: launch the script with "
                "torchrun (optim.initialize or the layer's first forward then joins it), or call "
                "parallel.init_distributed() before the first forward")
        self.set_deepspeed_parallelism()

    @property
    def expert_bias(self) -> torch.Tensor | None:
        """The gate's expert bias [E] (auxiliary-loss-free balancing), None when off."""
        return self.deepspeed_moe.gate.expert_bias

    @property
    def z_loss(self) -> torch.Tensor | None:
        return self.deepspeed_moe.z_loss

    @property
    def routing_stats(self) -> dict[str, torch.Tensor] | None:
        """The last forward's routing as detached data for loggers, None before any forward.

        Keys: `l_aux` and `z_loss` (scalars), `exp_counts` (int64 [E], choices per expert before
        dropping) and `kept_counts` (int64 [E], after dropping); counts cover this rank's tokens.
        """
        routing = self.deepspeed_moe.routing
        if routing is None:
            return None
        return {"l_aux": routing.l_aux.detach(), "z_loss": routing.z_loss.detach(),
                "exp_counts": routing.exp_counts.detach(), "kept_counts": routing.kept_counts()}

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Route, run and combine.

        Args:
            hidden_states: tokens of any leading shape, [..., M].
            used_token: optional mask with one entry per token ([...]); tokens where it is 0 are not routed.

        Returns:
            output: shaped like hidden_states.
            l_aux: the load-balancing loss, an fp32 scalar.
            exp_counts: int64 choices per expert before dropping, shape [E].

        Raises:
            ValueError: if the last dimension is not hidden_size, or as the gate raises.
        """
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(
                f"hidden_states must have shape [..., {self.hidden_size}], got {list(hidden_states.shape)}"
            )
        if not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states must be a floating-point tensor, got {hidden_states.dtype}")
        if self._pending:
            self._join()
        x_SM = hidden_states.reshape(-1, self.hidden_size)
        seq_len = hidden_states.shape[-2] if hidden_states.dim() == 3 else None  # [batch, seq, hidden]
        out_SM = self.deepspeed_moe(x_SM, used_token, seq_len)  # steps 1-4
        output = out_SM.view(hidden_states.shape)
        if self.shared_expert is not None:  # 5. shared expert
            shared = self.shared_expert(hidden_states)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
            output = output + shared
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]
            coef = torch.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


def _check_expert_width(expert: nn.Module, hidden_size: int) -> None:
    """A plain nn.Sequential expert's first and last nn.Linear must take and give hidden_size features."""
    # only plain Sequentials run their modules in order (a subclass may have its own forward, as a
    # SwiGLU does); a lazy Linear has no width until its first call
    if type(expert) is not nn.Sequential or not len(expert):
        return
    first, last = expert[0], expert[-1]
    if type(first) is nn.Linear and first.in_features != hidden_size:
        raise ValueError(f"the expert's first Linear takes {first.in_features} features; it must take hidden_size "
                         f"({hidden_size})")
    if type(last) is nn.Linear and last.out_features != hidden_size:
        raise ValueError(f"the expert's last Linear gives {last.out_features} features; it must give hidden_size "
                         f"({hidden_size})")


def _shared_expert(expert: nn.Module, n_shared_experts: int, shared_expert: nn.Module | None,
                   use_residual: bool) -> nn.Module | None:
    """The dense shared expert: the given module, or the plain-MLP expert widened n_shared_experts times."""
    if isinstance(n_shared_experts, bool) or not isinstance(n_shared_experts, int) or n_shared_experts < 0:
        raise ValueError(f"n_shared_experts must be an int >= 0, got {n_shared_experts!r}")
    if shared_expert is not None and n_shared_experts:
        raise ValueError(f"give n_shared_experts ({n_shared_experts}) or shared_expert, not both")
    if (shared_expert is not None or n_shared_experts) and use_residual:
        raise ValueError("use_residual=True (Residual MoE) and a shared expert both add a dense MLP; choose one")
    if shared_expert is not None or not n_shared_experts:
        return shared_expert
    mlp = _plain_mlp(expert)
    if mlp is None:
        raise ValueError(f"n_shared_experts={n_shared_experts} widens a plain nn.Sequential(Linear, activation, Linear) "
                         f"expert, got {type(expert).__name__}; pass shared_expert=<module> instead")
    first, _, _, second = mlp
    width = first.out_features * n_shared_experts
    bias = first.bias is not None
    return nn.Sequential(
        nn.Linear(first.in_features, width, bias=bias, device=first.weight.device, dtype=first.weight.dtype),
        copy.deepcopy(expert[1]),
        nn.Linear(width, second.out_features, bias=bias, device=first.weight.device, dtype=first.weight.dtype),
    )
