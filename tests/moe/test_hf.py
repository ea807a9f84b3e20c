"""moe.hf: tiny random transformers MoE models give the same logits and gradients on our layer, and back;
they train under the engine at ZeRO stage 3 as at stage 0, DeepSeek-V3's expert bias moves after each
step, and an engine checkpoint saved at ep_size 2 loads at ep_size 1 and saves back for transformers."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_distributed

transformers = pytest.importorskip("transformers")

from moe import split_params_into_different_moe_groups_for_optimizer  # noqa: E402
from moe.hf import DEEPSEEK_V3_BIAS_UPDATE_SPEED, HFMoEBlock, convert, restore  # noqa: E402
from optim import initialize  # noqa: E402
from parallel import reset_groups  # noqa: E402

FP32 = {"atol": 1e-5, "rtol": 0}
TRAINED = {"rtol": 1e-5, "atol": 1e-6}  # fp32 training in another layout: the design's 1e-5 relative
ARCHITECTURES = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "olmoe", "gpt_oss"]
VOCAB = 64
SHAPE = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
GPT_OSS_LIMIT = 0.1  # below the gate and up projections' typical size here, so the clamps act


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
        "gpt_oss": transformers.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                             swiglu_limit=GPT_OSS_LIMIT),
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
            if hasattr(module, "gate_up_proj_bias"):  # GPT-OSS's expert biases start at zero: make them count
                module.gate_up_proj_bias.normal_(0, 0.1)
                module.down_proj_bias.normal_(0, 0.1)
    return model


def _ids(seed: int = 1):
    return torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def _expert_tensors(experts, e: int, model_type: str, grad: bool = False) -> dict[str, torch.Tensor]:
    """Expert e of a block's stacked tensors (or of their gradients), under our expert module's names."""
    value = (lambda t: t.grad) if grad else (lambda t: t)
    if model_type == "gpt_oss":  # [E, M, 2H] with gate and up columns interleaved; [E, H, M]; biases
        gate_up, bias = value(experts.gate_up_proj)[e], value(experts.gate_up_proj_bias)[e]
        return {"gate_proj.weight": gate_up[:, 0::2].t(), "gate_proj.bias": bias[0::2],
                "up_proj.weight": gate_up[:, 1::2].t(), "up_proj.bias": bias[1::2],
                "down_proj.weight": value(experts.down_proj)[e].t(), "down_proj.bias": value(experts.down_proj_bias)[e]}
    gate, up = value(experts.gate_up_proj)[e].chunk(2)  # [E, 2H, M]: gate rows, then up rows; [E, M, H]
    return {"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": value(experts.down_proj)[e]}


def _expected_grads(reference, converted) -> dict[str, torch.Tensor]:
    """The reference's gradients under the converted model's parameter names (this rank's experts)."""
    blocks = {name: block for name, block in converted.named_modules() if isinstance(block, HFMoEBlock)}
    want = {name: p.grad for name, p in reference.named_parameters()
            if not any(name.startswith(f"{block}.") for block in blocks)}
    for name, block in blocks.items():
        original, moe, prefix = reference.get_submodule(name), block.moe, f"{name}.moe."
        router = original.router if block.model_type == "gpt_oss" else original.gate
        want[f"{prefix}deepspeed_moe.gate.wg.weight"] = router.weight.grad
        if block.model_type == "gpt_oss":
            want[f"{prefix}deepspeed_moe.gate.wg.bias"] = router.bias.grad
        first = moe.ep_rank * moe.num_local_experts
        grads = [_expert_tensors(original.experts, first + local, block.model_type, grad=True)
                 for local in range(moe.num_local_experts)]
        if moe.deepspeed_moe.experts.stacked:  # weight1: each expert's gate rows, then its up rows
            want[f"{prefix}deepspeed_moe.experts.weight1"] = torch.stack(
                [torch.cat([g["gate_proj.weight"], g["up_proj.weight"]]) for g in grads])
            want[f"{prefix}deepspeed_moe.experts.weight2"] = torch.stack([g["down_proj.weight"] for g in grads])
        else:
            for local, expert_grads in enumerate(grads):
                for key, grad in expert_grads.items():
                    want[f"{prefix}deepspeed_moe.experts.deepspeed_experts.{local}.{key}"] = grad
        shared = getattr(original, "shared_expert", None) or getattr(original, "shared_experts", None)
        for key, p in (shared.named_parameters() if shared is not None else ()):
            want[f"{prefix}shared_expert.{key}"] = p.grad
        if hasattr(original, "shared_expert_gate"):
            want[f"{prefix}shared_expert_gate.weight"] = original.shared_expert_gate.weight.grad
    return want


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_converted_model_gives_the_same_logits_and_gradients(name):
    model = _model(name)
    converted = convert(copy.deepcopy(model))
    blocks = [m for m in converted.modules() if isinstance(m, HFMoEBlock)]
    assert blocks and all(b.moe.deepspeed_moe.experts.stacked == (name != "gpt_oss") for b in blocks)  # SwiGLU: stacked
    ids, weight = _ids(), torch.randn(2, 7, VOCAB, generator=torch.Generator().manual_seed(2))
    expected, got = model(ids).logits, converted(ids).logits
    torch.testing.assert_close(got, expected, **FP32)
    (expected * weight).sum().backward()
    (got * weight).sum().backward()
    want = _expected_grads(model, converted)
    have = {key: p.grad for key, p in converted.named_parameters()}
    assert sorted(have) == sorted(want)
    for key, grad in want.items():
        torch.testing.assert_close(have[key], grad, **FP32, msg=key)


@pytest.mark.slow
def test_gpt_oss_clamps_act_and_its_block_returns_the_routing_weights():
    model = _model("gpt_oss")
    block = model.model.layers[0].mlp
    x = torch.randn(14, 32, generator=torch.Generator().manual_seed(3))
    gate_up = torch.einsum("sm,emx->esx", x, block.experts.gate_up_proj.detach())
    assert (gate_up.abs() > GPT_OSS_LIMIT).float().mean() > 0.2  # the test models exercise both clamps
    converted = convert(copy.deepcopy(model)).model.layers[0].mlp
    out, scores = converted(x.view(2, 7, 32))
    want_out, want_scores = block(x.view(2, 7, 32))
    torch.testing.assert_close(out, want_out, **FP32)
    torch.testing.assert_close(scores, want_scores, **FP32)


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


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_output_router_logits_is_replaced_by_l_aux_and_refused_in_a_forward(name):
    """transformers' load-balancing loss reads logits recorded from its own router modules, which a
    converted model no longer has: a config asking for it converts (warned, set to False until restore,
    the same logits), a forward asking for it fails with the reason, and the restored model has both back."""
    model = _model(name)
    model.config.output_router_logits = True
    ids = _ids()
    expected = model(ids).logits
    with pytest.warns(UserWarning, match="config sets output_router_logits.*set to False until restore"):
        converted = convert(copy.deepcopy(model))
    assert converted.config.output_router_logits is False
    out = converted(ids, labels=ids)
    torch.testing.assert_close(out.logits, expected, **FP32)
    assert out.loss.isfinite()
    refused = "output_router_logits=True: transformers records router logits, for its load-balancing loss"
    with pytest.raises(ValueError, match=refused):
        converted(ids, output_router_logits=True)
    with pytest.raises(ValueError, match=refused):  # the base model inside
        converted.model(ids, output_router_logits=True)
    converted.config.output_router_logits = True  # set after convert
    with pytest.raises(ValueError, match=refused):
        converted(ids)
    converted.config.output_router_logits = False
    restored = restore(converted)
    assert restored.config.output_router_logits is True
    torch.testing.assert_close(restored(ids, output_router_logits=True).logits, expected, **FP32)


def test_a_bias_update_speed_for_a_model_without_an_expert_bias_is_refused():
    with pytest.raises(ValueError, match=r"bias_update_speed \(0.001\) moves an expert bias, which of the "
                                         r"supported architectures only deepseek_v3 has; mixtral has none"):
        convert(_model("mixtral"), bias_update_speed=1e-3)


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
    have = {key: p.grad for key, p in converted.named_parameters() if ".deepspeed_moe.experts." in key}
    want = {key: grad for key, grad in _expected_grads(reference, converted).items() if key in have}
    assert len(want) == len(have) > 0
    for key, grad in want.items():
        torch.testing.assert_close(have[key], grad, **FP32, msg=f"{name}: {key}")


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


# Training under the engine: a next-token loss, AdamW, a few steps of each rank's own batches.
STEPS = 3


class _LM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _engine(name: str, ep_size: int, stage: int, **convert_kwargs):
    reset_groups()
    wrapped = _LM(convert(_model(name), ep_size=ep_size, **convert_kwargs)).train()
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(wrapped.parameters()), "name": "dense"})
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = initialize(wrapped, model_parameters=groups, config=config)
    return engine


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _train(engine, ranks: list[int]) -> list[float]:
    """STEPS steps on the batches of `ranks`; the losses averaged over the data-parallel world."""
    losses = []
    for step in range(STEPS):
        loss = engine(torch.cat([_batch(step, rank) for rank in ranks]))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
    return losses


def _stage3_against_stage0(rank, world, folder):
    runs = {}
    for stage in (0, 3):
        engine = _engine("deepseek_v3", 2, stage)
        runs[stage] = (_train(engine, [rank]), engine.consolidated_state_dict())
    engine.save_checkpoint(folder, tag="ep2")  # stage 3's
    with pytest.raises(ValueError, match=r"restore needs whole parameters, and this model's are sharded \(ZeRO "
                                         r"stage 3\): load engine.consolidated_state_dict\(\)"):
        restore(engine.module.model)
    if rank == 0:
        (losses0, state0), (losses3, state3) = runs[0], runs[3]
        torch.testing.assert_close(losses3, losses0, **TRAINED)
        assert sorted(state3) == sorted(state0)
        for key, value in state0.items():
            torch.testing.assert_close(state3[key], value, **TRAINED, msg=key)
        torch.save({"losses": losses3, "state": state3}, os.path.join(folder, "ep2.pt"))


@pytest.mark.slow
def test_stage_3_trains_a_converted_model_as_stage_0_and_its_checkpoint_loads_at_ep_1(tmp_path):
    """DeepSeek-V3 (shared experts, a dense first layer, the moving expert bias), AdamW, 3 steps: 2 ranks at
    ep_size 2, stage 3 and stage 0, and one process at stage 3 on both ranks' batches give the same losses
    and weights (1e-5 relative); restore refuses stage 3's sharded parameters; its checkpoint loads into one
    process at ep_size 1 with every weight and the bias as saved, and restored and saved, transformers reads
    it back."""
    folder = str(tmp_path)
    run_distributed(_stage3_against_stage0, 2, folder)
    saved = torch.load(os.path.join(folder, "ep2.pt"), weights_only=True)
    alone = _engine("deepseek_v3", 1, 3)
    torch.testing.assert_close(_train(alone, [0, 1]), saved["losses"], **TRAINED)
    state = alone.consolidated_state_dict()
    for key, value in saved["state"].items():
        torch.testing.assert_close(state[key], value, **TRAINED, msg=key)

    loaded = _engine("deepseek_v3", 1, 0)
    loaded.load_checkpoint(folder, tag="ep2")
    state = loaded.consolidated_state_dict()
    assert sorted(state) == sorted(saved["state"])
    for key, value in saved["state"].items():
        assert torch.equal(state[key], value), key
    bias = saved["state"]["model.model.layers.1.mlp.moe.deepspeed_moe.gate.expert_bias"]
    model = restore(loaded.module.model).eval()
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias)
    ids = _ids()
    expected = model(ids).logits
    model.save_pretrained(tmp_path / "hf")
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reread.config._attn_implementation = "eager"
    torch.testing.assert_close(reread(ids).logits, expected, **FP32)


@pytest.mark.slow
@pytest.mark.parametrize("speed", [DEEPSEEK_V3_BIAS_UPDATE_SPEED, 0.0])
def test_deepseek_v3_expert_bias_moves_after_each_engine_step_and_restore_writes_it_back(speed):
    """By default (DeepSeek-V3's speed) each step moves every expert's bias by -u, 0 or +u, against its
    load; at speed 0 it stays where the model had it."""
    engine = _engine("deepseek_v3", 1, 0, **({} if speed else {"bias_update_speed": 0.0}))
    gate = engine.module.model.model.layers[1].mlp.moe.deepspeed_moe.gate
    assert gate.config.bias_update_speed == speed
    initial = _model("deepseek_v3").model.layers[1].mlp.gate.e_score_correction_bias
    bias = gate.expert_bias.clone()
    assert torch.equal(bias, initial)
    for step in range(2):
        loss = engine(_batch(step, 0))
        counts = gate.step_counts.clone()  # the step's routed choices per expert
        engine.backward(loss)
        engine.step()
        moved = gate.expert_bias - bias
        if speed:
            want = speed * torch.sign(counts.double().mean() - counts.double()).float()
            torch.testing.assert_close(moved, want, atol=1e-7, rtol=0)
            assert moved.abs().max() > 0
        else:
            assert torch.equal(moved, torch.zeros_like(moved))
        bias = gate.expert_bias.clone()
    restored = restore(engine.module.model)
    assert torch.equal(restored.model.layers[1].mlp.gate.e_score_correction_bias, bias)
