"""moe.hf: tiny random transformers MoE models give the same logits and gradients on our layer, and back."""

import copy

import pytest
import torch

from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")

from moe.hf import HFMoEBlock, convert, restore  # noqa: E402
from parallel import reset_groups  # noqa: E402

FP32 = {"atol": 1e-5, "rtol": 0}
ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe"]
VOCAB = 64
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _configs():
    return {
        "mixtral": transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
        "qwen2_moe": transformers.Qwen2MoeConfig(**SHAPE, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                                 num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        "qwen3_moe": transformers.Qwen3MoeConfig(**SHAPE, moe_intermediate_size=24, num_experts=8, head_dim=8,
                                                 num_experts_per_tok=2, norm_topk_prob=True),
        "deepseek_v3": transformers.DeepseekV3Config(
            **{**SHAPE, "num_key_value_heads": 4}, moe_intermediate_size=24, first_k_dense_replace=1,
            n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8),
        "olmoe": transformers.OlmoeConfig(**SHAPE, num_experts=8, num_experts_per_tok=2),
    }


def _model(name: str, seed: int = 0):
    config = _configs()[name]
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for module in model.modules():  # a bias that steers selection, as a trained DeepSeek-V3 has
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.normal_(0, 0.1)
    return model


def _ids(seed: int = 1):
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def _hf_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient under transformers' names (a converted block's in the original's layout)."""
    grads = {name: p.grad for name, p in model.named_parameters() if ".moe." not in name}
    for name, block in model.named_modules():
        if not isinstance(block, HFMoEBlock):
            continue
        moe = block.moe
        experts = moe.deepspeed_moe.experts.deepspeed_experts
        grads[f"{name}.gate.weight"] = moe.deepspeed_moe.gate.wg.weight.grad
        grads[f"{name}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([e.gate_proj.weight.grad, e.up_proj.weight.grad]) for e in experts])
        grads[f"{name}.experts.down_proj"] = torch.stack([e.down_proj.weight.grad for e in experts])
        shared = "shared_expert" if block.block_class.__name__.startswith("Qwen2") else "shared_experts"
        for key, p in (moe.shared_expert.named_parameters() if moe.shared_expert is not None else ()):
            grads[f"{name}.{shared}.{key}"] = p.grad
        if moe.shared_expert_gate is not None:
            grads[f"{name}.shared_expert_gate.weight"] = moe.shared_expert_gate.weight.grad
        for key in [k for k in grads if k.startswith(f"{name}.moe.")]:
            del grads[key]
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_converted_model_gives_the_same_logits_and_gradients(name):
    model = _model(name)
    converted = convert(copy.deepcopy(model))
    assert any(isinstance(m, HFMoEBlock) for m in converted.modules())
    ids, weight = _ids(), torch.randn(2, 7, VOCAB, generator=torch.Generator().manual_seed(2))
    expected, got = model(ids).logits, converted(ids).logits
    torch.testing.assert_close(got, expected, **FP32)
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    have = _hf_grads(converted)
    assert sorted(have) == sorted(want)
    for key, grad in want.items():
        torch.testing.assert_close(have[key], grad, **FP32, msg=key)


@pytest.mark.slow
def test_deepseek_v3_keeps_its_dense_first_layer():
    converted = convert(_model("deepseek_v3"))
    assert type(converted.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert isinstance(converted.model.layers[1].mlp, HFMoEBlock)
    assert converted.model.layers[1].mlp.moe.expert_bias is not None


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_restored_model_saves_a_checkpoint_that_loads_with_the_same_logits(name, tmp_path):
    model = _model(name)
    ids = _ids()
    converted = convert(copy.deepcopy(model))
    with torch.no_grad():  # trained weights: restore must carry what the converted layer holds
        converted.model.layers[1].mlp.moe.deepspeed_moe.gate.wg.weight.mul_(1.5)
    trained = converted(ids).logits
    restored = restore(converted)
    assert not any(isinstance(m, HFMoEBlock) for m in restored.modules())
    torch.testing.assert_close(restored(ids).logits, trained, **FP32)
    restored.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    loaded.config._attn_implementation = "eager"
    torch.testing.assert_close(loaded(ids).logits, trained, **FP32)


def test_unsupported_model_is_refused():
    config = transformers.LlamaConfig(**SHAPE)
    with pytest.raises(ValueError, match="convert supports transformers models of mixtral, qwen2_moe"):
        convert(transformers.AutoModelForCausalLM.from_config(config))


def test_gpt_oss_is_refused_with_its_reason():
    model = torch.nn.Module()
    model.config = transformers.GptOssConfig(**SHAPE, num_local_experts=4)
    with pytest.raises(ValueError, match="gpt_oss is not supported: its router has a bias"):
        convert(model)


def _expert_parallel(rank, world):
    for name in ARCHITECTURES:
        _expert_parallel_one(rank, world, name)


def _expert_parallel_one(rank, world, name):
    reset_groups()
    reference = _model(name)
    converted = convert(copy.deepcopy(reference), ep_size=2)
    ids = torch.cat([_ids(seed) for seed in range(world)])  # each rank's batch, and the reference's whole one
    mine = ids.chunk(world)[rank]
    got, expected = converted(mine).logits, reference(ids).logits
    torch.testing.assert_close(got, expected.chunk(world)[rank], **FP32)
    got.sum().backward()
    expected.sum().backward()  # our expert gradients sum over every rank's tokens, as the reference's
    for name, block in converted.named_modules():
        if isinstance(block, HFMoEBlock):
            local = block.moe.deepspeed_moe.experts.deepspeed_experts
            first = block.moe.ep_rank * len(local)
            original = reference.get_submodule(name).experts
            for i, expert in enumerate(local):
                grad_gate, grad_up = original.gate_up_proj.grad[first + i].chunk(2)
                torch.testing.assert_close(expert.gate_proj.weight.grad, grad_gate, **FP32)
                torch.testing.assert_close(expert.up_proj.weight.grad, grad_up, **FP32)
                torch.testing.assert_close(expert.down_proj.weight.grad, original.down_proj.grad[first + i], **FP32)


@pytest.mark.slow
def test_every_architecture_at_ep_size_2_equals_one_process():
    run_distributed(_expert_parallel, 2)


def _restore_expert_parallel(rank, world):
    reset_groups()
    for name in ARCHITECTURES:
        reference = _model(name)
        restored = restore(convert(copy.deepcopy(reference), ep_size=2))
        assert not any(isinstance(m, HFMoEBlock) for m in restored.modules())
        want, have = reference.state_dict(), restored.state_dict()
        assert sorted(have) == sorted(want), name
        for key, value in want.items():
            torch.testing.assert_close(have[key], value, atol=0, rtol=0, msg=f"{name}: {key}")


@pytest.mark.slow
def test_restore_at_ep_size_2_gathers_every_expert():
    run_distributed(_restore_expert_parallel, 2)
