"""Sparse upcycling: an upcycled model computes its dense model's function before training, then trains.

Models: recipes.gpt_model's GPT with no MoE blocks (Linear-GELU-Linear feed-forward, held as stacked
experts), a small net with a `moe.SwiGLU` MLP (held as stacked gated experts) and a tiny random
`transformers` Llama and Qwen2 (their own SwiGLU MLP classes, held as module copies). Exact
means the same logits to EXACT (max absolute difference): the combine weights sum to one, so only the
rounding of the weighted sum of identical expert outputs separates the two.
"""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import moe
from moe import MoE, SwiGLU, upcycle
from moe.upcycling import UpcycledMLP
from recipes.gpt_model import GPT, GPTConfig

EXACT = 1e-6
AUX_WEIGHT = 0.01


def _gpt(seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(moe_every=0, n_layer=2, n_head=2, n_embd=16, ffn=32, block_size=16, vocab_size=32))


def _tokens(vocab=32, seed=1) -> torch.Tensor:
    return torch.randint(0, vocab, (4, 16), generator=torch.Generator().manual_seed(seed))


def _llama(kind="llama"):
    transformers = pytest.importorskip("transformers")
    options = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**options)).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**options)).eval()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("k", [1, 2])
def test_upcycled_gpt_gives_the_dense_logits(k):
    dense = _gpt().eval()
    model = upcycle(copy.deepcopy(dense), num_experts=4, k=k, return_tuple=True).eval()
    assert all(isinstance(block.ffn, MoE) for block in model.blocks)
    assert model.blocks[0].ffn.deepspeed_moe.experts.stacked
    idx = _tokens()
    with torch.no_grad():
        logits, l_aux, _ = model(idx)
        assert _max_diff(logits, dense(idx)[0]) <= EXACT
    assert l_aux > 0  # the blocks collect the layers' load-balancing losses


def test_upcycled_gpt_in_an_adapter_gives_the_dense_logits_and_keeps_l_aux():
    dense = _gpt().eval()
    model = upcycle(copy.deepcopy(dense), num_experts=4, k=2).eval()
    idx = _tokens()
    with torch.no_grad():
        logits, l_aux, _ = model(idx)
        assert _max_diff(logits, dense(idx)[0]) <= EXACT
    assert l_aux == 0  # the block sees a tensor, as from its dense MLP
    adapters = [block.ffn for block in model.blocks]
    assert all(isinstance(a, UpcycledMLP) and a.l_aux > 0 for a in adapters)


@pytest.mark.slow
def test_expert_noise_changes_the_function_and_the_seed_repeats_it():
    dense = _gpt().eval()
    noisy = upcycle(copy.deepcopy(dense), num_experts=4, k=2, expert_noise=0.1, return_tuple=True).eval()
    again = upcycle(copy.deepcopy(dense), num_experts=4, k=2, expert_noise=0.1, return_tuple=True).eval()
    idx = _tokens()
    with torch.no_grad():
        assert _max_diff(noisy(idx)[0], dense(idx)[0]) > 1e-4
        assert torch.equal(noisy(idx)[0], again(idx)[0])
    weight1 = noisy.blocks[0].ffn.deepspeed_moe.experts.weight1
    assert not torch.equal(weight1[0], weight1[1])  # each copy gets its own noise


def test_router_initialisation():
    model = upcycle(_gpt(), num_experts=4, k=2, router_init="zeros", return_tuple=True)
    assert torch.count_nonzero(model.blocks[0].ffn.deepspeed_moe.gate.wg.weight) == 0
    model = upcycle(_gpt(), num_experts=4, k=2, router_std=0.02, return_tuple=True)
    weight = model.blocks[0].ffn.deepspeed_moe.gate.wg.weight
    assert weight.dtype == torch.float32 and 0.005 < weight.std().item() < 0.05


class _GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.mlp = SwiGLU(8, 12)

    def forward(self, x):
        return self.mlp(self.inp(x))


def test_a_swiglu_mlp_upcycles_into_stacked_gated_experts_with_the_dense_outputs():
    dense = _GatedNet().eval()
    model = upcycle(copy.deepcopy(dense), num_experts=4, k=2).eval()
    experts = model.mlp.moe.deepspeed_moe.experts
    assert experts.stacked and experts.gated and experts.weight1.shape == (4, 24, 8)
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_diff(model(x), dense(x)) <= EXACT


def _expert_grads_gpt(model) -> list[torch.Tensor]:
    experts = [block.ffn.deepspeed_moe.experts for block in model.blocks]
    return [e.weight1.grad[i] for e in experts for i in range(e.num_local_experts)]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_upcycled_gpt_trains_and_every_expert_and_router_learns(k):
    model = upcycle(_gpt(), num_experts=4, k=k, return_tuple=True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx, losses = _tokens(), []
    for step in range(6):
        logits, l_aux, _ = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()) + AUX_WEIGHT * l_aux
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            assert all(g.abs().sum() > 0 for g in _expert_grads_gpt(model))
            assert all(block.ffn.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0 for block in model.blocks)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 2])
def test_upcycled_transformers_model_gives_the_dense_logits(kind, k):
    dense = _llama(kind)
    model = upcycle(copy.deepcopy(dense), num_experts=4, k=k).eval()
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(isinstance(mlp, UpcycledMLP) for mlp in mlps)
    assert not mlps[0].moe.deepspeed_moe.experts.stacked  # SwiGLU: module copies
    idx = _tokens()
    with torch.no_grad():
        assert _max_diff(model(idx).logits, dense(idx).logits) <= EXACT
        noisy = upcycle(copy.deepcopy(dense), num_experts=4, k=k, expert_noise=0.1).eval()
        assert _max_diff(noisy(idx).logits, dense(idx).logits) > 1e-4


@pytest.mark.slow
def test_upcycled_llama_trains_and_every_expert_and_router_learns():
    model = upcycle(_llama(), num_experts=4, k=2).train()
    adapters = [layer.mlp for layer in model.model.layers]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx, losses = _tokens(), []
    for step in range(6):
        loss = model(idx, labels=idx).loss + AUX_WEIGHT * sum(a.l_aux for a in adapters)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            for adapter in adapters:
                for expert in adapter.moe.deepspeed_moe.experts.deepspeed_experts:
                    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in expert.parameters())
                assert adapter.moe.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_modules_selects_by_name_or_predicate():
    model = upcycle(_gpt(), num_experts=2, k=1, modules=["blocks.1.ffn"], return_tuple=True)
    assert isinstance(model.blocks[1].ffn, MoE) and isinstance(model.blocks[0].ffn, nn.Sequential)
    model = upcycle(_gpt(), num_experts=2, k=1, modules=lambda name, module: name == "blocks.0.ffn")
    assert isinstance(model.blocks[0].ffn, UpcycledMLP) and isinstance(model.blocks[1].ffn, nn.Sequential)


def test_bad_arguments_fail_with_one_message():
    with pytest.raises(ValueError, match=r"k \(5\) must be an int between 1 and num_experts \(4\)"):
        upcycle(_gpt(), num_experts=4, k=5)
    with pytest.raises(ValueError, match=r"no MLP to upcycle in Sequential: no module matches modules named"):
        upcycle(nn.Sequential(nn.Linear(4, 4)), num_experts=4, k=2)
    with pytest.raises(ValueError, match=r"no MLP to upcycle in GPT: no module matches modules=\['mlp2'\]"):
        upcycle(_gpt(), num_experts=4, k=2, modules=["mlp2"])
    with pytest.raises(ValueError, match=r"router_init must be one of \('normal', 'zeros'\), got 'uniform'"):
        upcycle(_gpt(), num_experts=4, k=2, router_init="uniform")
    with pytest.raises(ValueError, match=r"upcycle sets \['expert_init'\] itself"):
        upcycle(_gpt(), num_experts=4, k=2, expert_init="per_expert_seed")
    with pytest.raises(TypeError, match="modules must be None, a sequence of module names or a callable"):
        upcycle(_gpt(), num_experts=4, k=2, modules="ffn")


@pytest.mark.slow
def test_upcycle_is_exported_and_import_moe_needs_no_transformers():
    assert "upcycle" in moe.__all__ and moe.upcycle is upcycle
    code = "import sys, moe; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
