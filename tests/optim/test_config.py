"""Config parsing, in one process: batch sizes, bad and unknown keys named by their path, optimizer and
scheduler params checked before training, compatibility and deprecated keys, offload without an
accelerator, and the TensorBoard and data-loader settings through `initialize`. The loss scaler's rules
have their tests in test_scaler.py, DeepSpeed's schedules in test_schedulers.py."""

import json
import warnings

import pytest
import torch

from optim import ConfigTypeError, initialize, parse_config
from tests.optim.models import Net


def _parse(extra, world=1):
    return parse_config({"train_batch_size": 8, **extra}, world)


def test_batch_sizes_imply_each_other():
    config = parse_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4)
    assert config.gradient_accumulation_steps == 2
    config = parse_config({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3}, 2)
    assert config.train_batch_size == 24
    config = parse_config({"train_batch_size": 16, "gradient_accumulation_steps": 2}, 4)
    assert config.train_micro_batch_size_per_gpu == 2
    message = (r"train_batch_size \(30\) must equal train_micro_batch_size_per_gpu \(4\) \* "
               r"gradient_accumulation_steps \(2\) \* world size \(4\)")
    with pytest.raises(ValueError, match=message):
        parse_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 4)


@pytest.mark.parametrize("extra, error, match", [
    ({"zero_optimization": {"stage": 5}}, ValueError, r"zero_optimization.stage must be 0, 1, 2 or 3, got 5"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, ValueError,
     r"zero_optimization.reduce_bucket_size must be >= 1, got 0"),
    ({"zero_optimization": {"stage": "2"}}, TypeError, r"zero_optimization.stage must be int, got str '2'"),
    ({"zero_optimization": {"stages": 2}}, ValueError, r"unknown config key zero_optimization.stages"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, ValueError, r"unknown config key fp16.loss_scale_windw"),
    ({"fp16": {"enabled": "yes"}}, TypeError, r"fp16.enabled must be bool"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ValueError, r"fp16.enabled and bf16.enabled"),
    ({"bf16": {"enabled": True, "bf16_optimizer_states": True}}, ValueError, r"bf16.bf16_optimizer_states"),
    ({"optimizer": {"type": "Lamb"}}, ValueError, r"optimizer.type must be Adam, AdamW or SGD, got 'Lamb'"),
    ({"scheduler": {"type": "Cosine"}}, ValueError, r"scheduler.type must be one of"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, ValueError, r"offload device must be"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, ValueError, r"offload_param needs stage 3"),
    ({"gradient_clipping": -1.0}, ValueError, r"gradient_clipping must be >= 0"),
    ({"tensorboard": {"enabled": True, "outputpath": "x"}}, ValueError, r"unknown config key tensorboard.outputpath"),
])
def test_bad_values_name_their_key(extra, error, match):
    with pytest.raises(error, match=match):
        _parse(extra)


def test_unknown_keys_pass_where_deepspeed_passes_them_with_one_warning(tmp_path):
    # DeepSpeed 0.19.8 reads its top level and optimizer/scheduler's type and params by dict lookups
    # (other keys pass unseen) and validates its other sections with pydantic models that forbid extras
    config = {"train_batch_size": 4, "_comment": "a course's note", "_precision_comment": "fp32 on a CPU",
              "_zero_comment": "stage 2", "zero_optimization": {"stage": 2}, "flops_profiler": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.01}, "_comment": "AdamW"},
              "scheduler": {"type": "WarmupLR", "params": {}, "_note": "warm up"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.warns(UserWarning) as caught:
        parsed = parse_config(str(path), 1)
    messages = [str(w.message) for w in caught]
    assert "config keys neither DeepSpeed nor this engine reads, ignored as DeepSpeed ignores them: _comment, " \
           "_precision_comment, _zero_comment, optimizer._comment, scheduler._note" in messages
    assert "config keys accepted for compatibility, without effect here: flops_profiler" in messages
    assert parsed.zero_optimization.stage == 2 and parsed.optimizer.params == {"lr": 0.01}


def test_deepspeeds_own_keys_are_not_taken_for_misspellings_and_bfloat16_is_bf16():
    with pytest.warns(UserWarning, match=r"without effect here: sparse_gradients, gradient_accumulation_dtype"):
        parse_config({"train_batch_size": 4, "sparse_gradients": False, "gradient_accumulation_dtype": "fp32"}, 1)
    with pytest.warns(DeprecationWarning, match=r"bfloat16 -> bf16"):
        parsed = parse_config({"train_batch_size": 4, "bfloat16": {"enabled": True}}, 1)
    assert parsed.bf16.enabled and parsed.low_precision == "bf16"
    with pytest.raises(ValueError, match=r'bfloat16 \({"enabled": true}\) and bf16 \({"enabled": false}\) disagree'):
        parse_config({"train_batch_size": 4, "bfloat16": {"enabled": True}, "bf16": {"enabled": False}}, 1)


@pytest.mark.parametrize("config, match", [
    ({"train_batch_size": 4, "train_batch_sizee": 8}, r"unknown config key train_batch_sizee; did you mean train_batch_size\?"),
    ({"train_batch_size": 4, "gradient_acumulation_steps": 2},
     r"unknown config key gradient_acumulation_steps; did you mean gradient_accumulation_steps\?"),
    ({"train_batch_size": 4, "optimizer": {"type": "SGD", "parmas": {"lr": 1}}},
     r"unknown config key optimizer.parmas; did you mean optimizer.params\?"),
    ({"train_batch_size": 4, "zero_optimization": {"stage": 1, "_comment": "x"}},
     r"unknown config key zero_optimization._comment \(DeepSpeed refuses it too\); valid keys here: "),
    ({"train_batch_size": 4, "bf16": {"enabeld": True}}, r"unknown config key bf16.enabeld; did you mean bf16.enabled\?"),
])
def test_misspelled_keys_and_unknown_keys_in_strict_sections_fail(config, match):
    with pytest.raises(ValueError, match=match):
        parse_config(config, 1)


def test_a_config_file_that_repeats_a_key_fails(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 4, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ValueError, match=r"config file repeats the key\(s\) stage; give each key once"):
        parse_config(str(path), 1)


def test_bad_optimizer_and_scheduler_params_fail_before_training():
    with pytest.raises(ValueError, match=r"unknown config key optimizer.params.learning_rate"):
        initialize(Net(), config={"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"learning_rate": 1}}})
    with pytest.raises(ValueError, match=r"unknown config key scheduler.params.warmup_steps"):
        initialize(Net(), config={"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                  "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 3}}})
    with pytest.raises(ValueError, match="no optimizer"):
        initialize(Net(), config={"train_batch_size": 4})


def test_optimizer_and_scheduler_params_of_the_wrong_kind_name_their_key():
    def build(optimizer_params, scheduler_params):
        return initialize(Net(), config={"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": optimizer_params},
                                         "scheduler": {"type": "WarmupLR", "params": scheduler_params}})
    for optimizer_params, scheduler_params, match in [
        ({"lr": "fast"}, {}, r"optimizer.params.lr for AdamW must be a number, got str 'fast'"),
        ({"lr": [0.1, 0.2]}, {}, r"optimizer.params.lr for AdamW must be a number, got list"),
        ({"betas": [0.9]}, {}, r"optimizer.params.betas for AdamW must be a list of 2 numbers"),
        ({"amsgrad": 1}, {}, r"optimizer.params.amsgrad for AdamW must be true or false, got int 1"),
        ({}, {"warmup_num_steps": "ten"}, r"scheduler.params.warmup_num_steps for WarmupLR must be a number"),
        ({}, {"warmup_type": 3}, r"scheduler.params.warmup_type for WarmupLR must be a string, got int 3"),
        ({}, {"warmup_num_steps": [10]}, r"scheduler.params.warmup_num_steps for WarmupLR must be a number, got list"),
    ]:
        with pytest.raises(ConfigTypeError, match=match):
            build(optimizer_params, scheduler_params)
    # a param without a default, by its annotation; DeepSpeed's own Adam switches
    with pytest.raises(ConfigTypeError, match=r"scheduler.params.total_num_steps for WarmupDecayLR must be a number"):
        initialize(Net(), config={"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                  "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "10"}}})
    with pytest.raises(ConfigTypeError, match=r"optimizer.params.adam_w_mode for Adam must be true or false"):
        initialize(Net(), config={"train_batch_size": 4,
                                  "optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}})
    # what DeepSpeed takes still builds: ints for floats, a value per param group, lists for tuples
    engine, *_ = build({"lr": 1, "betas": [0.9, 0.99], "fused": False}, {"warmup_max_lr": [0.01, 0.02], "warmup_num_steps": 2.0})
    assert engine.optimizer.param_groups[0]["betas"] == (0.9, 0.99)


def test_json_path_and_compatibility_keys_warn_once(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2, "overlap_comm": True,
                                "reduce_bucket_size": 5e8, "contiguous_gradients": True,
                                "offload_optimizer": {"device": "cpu", "buffer_count": 2}}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parse_config(str(path), 1)
    assert config.zero_optimization.stage == 2 and config.zero_optimization.offload_optimizer.device == "cpu"
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    for key in ("zero_optimization.contiguous_gradients", "zero_optimization.offload_optimizer.buffer_count"):
        assert key in messages[0]
    assert "overlap_comm" not in messages[0] and "reduce_bucket_size" not in messages[0]  # stage 2 uses them
    assert config.zero_optimization.reduce_bucket_size == 500_000_000 and config.zero_optimization.overlap_comm


def test_offload_on_a_cpu_only_machine_is_reported_without_effect():
    config = {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    with pytest.warns(UserWarning, match="offload_optimizer has no effect"):
        initialize(Net(), config=config)


def test_tensorboard_dataloader_and_a_given_optimizer(tmp_path):
    dataset = torch.utils.data.TensorDataset(torch.randn(10, 8), torch.randint(0, 5, (10,)))
    model = Net()
    given = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    engine, optimizer, loader, scheduler = initialize(
        model, config={"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
                       "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}},
        training_data=dataset, optimizer=given)
    assert optimizer.optimizer is given and optimizer.param_groups[0]["momentum"] == 0.5
    assert [g["moe"] for g in optimizer.param_groups] == [False, True] and scheduler is None
    assert [len(x) for x, _ in loader] == [4, 4, 2]
    for x, y in loader:
        logits, l_aux = engine(x)
        engine.backward(torch.nn.functional.cross_entropy(logits, y) + 0.01 * l_aux)
        engine.step()
    assert engine.global_steps == 3 and engine.get_lr() == [0.05, 0.05]
    engine.monitor.flush()
    assert list((tmp_path / "run").glob("events.out.tfevents.*"))


# DeepSpeed 0.19.8's deprecated zero_optimization keys (deepspeed/runtime/zero/config.py): cpu_offload ->
# offload_optimizer {device: cpu} when true, cpu_offload_param -> offload_param likewise,
# stage3_gather_fp16_weights_on_model_save -> stage3_gather_16bit_weights_on_model_save, and
# cpu_offload_use_pin_memory, which sets nothing there either.
@pytest.mark.parametrize("zero, section, device", [
    ({"stage": 2, "cpu_offload": True}, "offload_optimizer", "cpu"),
    ({"stage": 2, "cpu_offload": False}, "offload_optimizer", "none"),
    ({"stage": 3, "cpu_offload_param": True}, "offload_param", "cpu"),
    ({"stage": 3, "cpu_offload_param": False}, "offload_param", "none"),
    ({"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
     "offload_optimizer", "cpu"),
])
def test_deprecated_offload_keys_read_as_current_ones(zero, section, device):
    old = next(key for key in zero if key.startswith("cpu_offload"))
    with pytest.warns(DeprecationWarning, match=rf"zero_optimization.{old} -> zero_optimization.{section}"):
        config = _parse({"zero_optimization": zero})
    assert getattr(config.zero_optimization, section).device == device
    assert config.zero_optimization.stage == zero["stage"]


def test_deprecated_keys_without_a_conversion_are_reported():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = _parse({"zero_optimization": {"stage": 3, "cpu_offload_use_pin_memory": False,
                                               "stage3_gather_fp16_weights_on_model_save": True}})
    assert config.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    [message] = [str(w.message) for w in caught if w.category is DeprecationWarning]
    # the current key is one DeepSpeed knows and this engine does not need: reported as such
    assert any("without effect here: zero_optimization.stage3_gather_16bit_weights_on_model_save" in str(w.message)
               for w in caught if w.category is UserWarning)
    assert "zero_optimization.cpu_offload_use_pin_memory (without effect" in message
    assert ("zero_optimization.stage3_gather_fp16_weights_on_model_save -> "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save") in message


def test_cpu_offload_false_just_works_through_initialize():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = initialize(Net(), config={"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                                               "zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert [w.category for w in caught] == [DeprecationWarning]
    assert engine.stage == 2 and engine.config.zero_optimization.offload_optimizer.device == "none"


def test_without_deprecated_keys_there_is_no_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        _parse({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}}})


@pytest.mark.parametrize("zero, error, match", [
    ({"cpu_offload": True, "offload_optimizer": {"device": "none"}}, ValueError,
     r'zero_optimization.cpu_offload \(true\) and zero_optimization.offload_optimizer \(\{"device": "none"\}\) '
     r"disagree; keep only offload_optimizer"),
    ({"cpu_offload": False, "offload_optimizer": {"device": "cpu"}}, ValueError,
     r"zero_optimization.cpu_offload \(false\) and zero_optimization.offload_optimizer .* disagree"),
    ({"stage": 3, "cpu_offload_param": True, "offload_param": {}}, ValueError,
     r"zero_optimization.cpu_offload_param \(true\) and zero_optimization.offload_param \(\{\}\) disagree"),
    ({"stage3_gather_fp16_weights_on_model_save": True, "stage3_gather_16bit_weights_on_model_save": False},
     ValueError, r"zero_optimization.stage3_gather_fp16_weights_on_model_save \(true\) and "
                 r"zero_optimization.stage3_gather_16bit_weights_on_model_save \(false\) disagree"),
    ({"cpu_offload": "yes"}, TypeError, r"zero_optimization.cpu_offload must be bool, got str 'yes'"),
])
def test_deprecated_keys_disagreeing_with_current_ones_fail_naming_both(zero, error, match):
    with pytest.raises(error, match=match):
        _parse({"zero_optimization": zero})
