"""The GPT recipe's routing flags: a bias run resumes identically, MaxVio and the bias reach TensorBoard,
fine-grained and shared-expert models count their active parameters right, bad combinations stop."""

import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from recipes import gpt
from recipes.gpt_model import GPT
from tests.recipes.test_recipes import GPT_TINY, _same_curve


def test_bias_run_logs_max_vio_and_bias_and_resumes_exactly(tmp_path):
    args = GPT_TINY + ["--steps", "12", "--eval-interval", "6", "--log-interval", "6", "--log-dir", str(tmp_path),
                       "--run-name", "run", "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "6",
                       "--scoring-func", "sigmoid", "--bias-update-speed", "0.01", "--load-balancing-type", "none",
                       "--gradient-accumulation-steps", "2"]
    straight = gpt.main(args)
    assert [s for s, _ in straight["history"]["max_vio"]] == list(range(1, 13))
    assert all(v >= 0 for _, v in straight["history"]["max_vio"])
    board = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    board.Reload()
    scalars = set(board.Tags()["scalars"])
    assert {"MoE/max_vio", "MoE/blocks.1.ffn/max_vio", "MoE/blocks.1.ffn/bias_min", "MoE/blocks.1.ffn/bias_max"} <= scalars
    bias_max = [e.value for e in board.Scalars("MoE/blocks.1.ffn/bias_max")]
    assert bias_max[0] == pytest.approx(0.01) and max(bias_max) > 0  # one step of u after step 1

    (tmp_path / "ckpt" / "latest").write_text("global_step6")
    resumed = gpt.main(["--resume", "--checkpoint-dir", str(tmp_path / "ckpt")])
    _same_curve(resumed["history"]["train"], straight["history"]["train"][6:])
    _same_curve(resumed["history"]["max_vio"], straight["history"]["max_vio"][6:])
    _same_curve(resumed["history"]["val"], straight["history"]["val"][1:])


@pytest.mark.parametrize("flags, routed_per_token", [
    (["--num-experts", "16", "--top-k", "8"], 8),                               # 16 experts of 1/8 width, top-8
    (["--n-shared-experts", "1", "--top-k", "1", "--expert-ffn", "32"], 1),    # 1 shared + top-1, each 1/2 width
    (["--routing", "expert_choice", "--capacity-factor", "2"], 2),             # 2 experts per token on average
])
def test_active_parameters_match_the_dense_twin(flags, routed_per_token):
    dense = GPT(gpt.model_config(gpt.TrainConfig(**_cfg(GPT_TINY + ["--dense"]))))
    model = GPT(gpt.model_config(gpt.TrainConfig(**_cfg(GPT_TINY + flags))))
    _, dense_active = dense.parameter_counts()
    total, active = model.parameter_counts()
    routers = sum(p.numel() for n, p in model.named_parameters() if ".gate." in n or "shared_expert_gate" in n)
    n_moe = sum(1 for b in model.blocks if hasattr(b.ffn, "deepspeed_moe"))
    # experts carry a second-layer bias each: (routed_per_token - 1) extra biases of width n_embd per MoE block,
    # a shared expert one more
    extra_biases = (routed_per_token - 1 + ("--n-shared-experts" in flags)) * 32 * n_moe
    assert active - routers - extra_biases == dense_active
    assert total > active


def _cfg(argv):
    parser = gpt.flag_parser(gpt.TrainConfig, "")
    return vars(parser.parse_args(argv))


@pytest.mark.parametrize("argv, message", [
    (["--n-group", "3", "--topk-group", "1"], r"--n-group \(3\) must divide --num-experts \(4\)"),
    (["--routing", "expert_choice", "--dropless"], r"dropless must be False"),
    (["--scoring-func", "tanh"], r"argument --scoring-func: invalid choice: 'tanh'"),
    (["--n-group", "2", "--topk-group", "1", "--top-k", "3"],
     r"--topk-group \* \(--num-experts / --n-group\) = 1 \* 2"),
])
def test_a_bad_routing_combination_stops_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        gpt.main(GPT_TINY + ["--steps", "1"] + argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
