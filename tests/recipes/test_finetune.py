"""recipes.finetune: a tiny random Mixtral fine-tuned on our layer, logged, and saved back for transformers, in
one process and under torchrun at ep 2 with ZeRO stages 2 and 3 (the same training, the same saved model)."""

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from recipes import finetune  # noqa: E402

VOCAB = 64
TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2}


def _saved_mixtral(folder) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.MixtralConfig(**TINY)).eval()
    model.save_pretrained(folder)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits


def _loads_changed(out, original) -> torch.Tensor:
    """The saved model's logits (finite, not the original's)."""
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    got = _logits(tuned, ids)
    assert got.isfinite().all()
    assert not torch.allclose(got, _logits(original, ids))
    return got


@pytest.mark.slow
def test_finetune_lowers_the_loss_logs_and_saves_a_model_transformers_loads(tmp_path):
    original = _saved_mixtral(tmp_path / "tiny")
    result = finetune.main(["--hf", str(tmp_path / "tiny"), "--steps", "8", "--seq-len", "16", "--lr", "1e-2",
                            "--stage", "3", "--log-dir", str(tmp_path / "runs"), "--run-name", "run",
                            "--out", str(tmp_path / "out")])
    losses = [loss for _, loss in result["losses"]]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert list((tmp_path / "runs" / "run").glob("events.out.tfevents.*"))
    _loads_changed(tmp_path / "out", original)


def test_finetune_without_hf_stops_with_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune.main([])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == ("recipes.finetune: error: --hf is needed: a transformers MoE model's "
                                               "folder (save_pretrained's) or hub name")


def test_finetune_with_a_negative_bias_update_speed_stops_with_one_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune.main(["--hf", "somewhere", "--bias-update-speed", "-0.1"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == "recipes.finetune: error: --bias-update-speed must be 0 or more, got -0.1"


@pytest.mark.parametrize("where, message", [
    ("config.json", "is a file: give the folder save_pretrained wrote, or a hub name"),
    ("missing", "is no folder here, nor a hub name (name or namespace/name)"),
])
def test_finetune_with_an_hf_path_that_is_no_model_folder_stops_with_one_line(tmp_path, capsys, where, message):
    (tmp_path / "config.json").write_text("{}")
    path = str(tmp_path / where)
    with pytest.raises(SystemExit) as stopped:
        finetune.main(["--hf", path])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == f"recipes.finetune: error: --hf {path} {message}"


def test_finetune_with_a_bias_update_speed_for_a_model_without_an_expert_bias_stops_with_one_line(tmp_path, capsys):
    _saved_mixtral(tmp_path / "tiny")
    with pytest.raises(SystemExit) as stopped:
        finetune.main(["--hf", str(tmp_path / "tiny"), "--bias-update-speed", "0.5"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "recipes.finetune: error: --bias-update-speed 0.5 moves an expert bias, which only deepseek_v3 models "
        "have; this one is mixtral: leave the flag out")


def test_finetune_of_a_model_whose_config_asks_for_router_logits_trains_and_saves_the_flag_back(tmp_path):
    """Fine-tuning configs often set output_router_logits; our l_aux replaces transformers' loss."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**TINY, output_router_logits=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "tiny")
    with pytest.warns(UserWarning, match="output_router_logits"):
        result = finetune.main(["--hf", str(tmp_path / "tiny"), "--steps", "2", "--seq-len", "16",
                                "--log-dir", str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert len(result["losses"]) == 2
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").output_router_logits is True


def _torchrun(folder, stage: int):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "recipes.finetune", "--hf", str(folder / "tiny"), "--steps", "4", "--seq-len", "16",
               "--lr", "1e-2", "--ep-world-size", "2", "--stage", str(stage), "--log-dir", str(folder / "runs"),
               "--run-name", f"stage{stage}", "--out", str(folder / f"out{stage}")]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"2 process(es), ep 2, ZeRO stage {stage}" in done.stdout


@pytest.mark.slow
def test_finetune_under_torchrun_with_expert_parallelism_saves_a_loadable_model_at_stages_2_and_3(tmp_path):
    """The same 4 steps at stage 2 and stage 3 (which shards the weights) save the same model (fp32, 1e-5)."""
    original = _saved_mixtral(tmp_path / "tiny")
    _torchrun(tmp_path, 2)
    _torchrun(tmp_path, 3)
    stage2 = _loads_changed(tmp_path / "out2", original)
    torch.testing.assert_close(_loads_changed(tmp_path / "out3", original), stage2, rtol=1e-5, atol=1e-5)


def test_the_recipes_page_lists_every_finetune_flag():
    import dataclasses
    import pathlib
    import re

    page = (pathlib.Path(__file__).parents[2] / "docs" / "recipes.md").read_text()
    start = page.index("| flags | what |", page.index("## `recipes.finetune`"))
    listed = set(re.findall(r"--[a-z][a-z-]*", page[start:page.index("\n## ", start)]))
    flags = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(finetune.FinetuneConfig)}
    assert flags == listed
