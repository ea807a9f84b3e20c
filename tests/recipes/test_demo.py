"""recipes.demo: the experts learn the mixture in one process and under torchrun; bad flags stop in one line."""

import re
import subprocess
import sys

import pytest

from recipes import demo


@pytest.mark.slow
def test_demo_trains_and_the_moe_beats_its_dense_twin():
    result = demo.main(["--steps", "400", "--batch", "256", "--log-interval", "50"])
    assert result["moe"] < result["dense"]


@pytest.mark.slow
def test_demo_under_torchrun_with_expert_parallelism(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "recipes.demo", "--experts", "4", "--ep-world-size", "2", "--steps", "20", "--log-interval", "10"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.findall(r"^rank (\d): holds experts (\d+)\.\.(\d+); its tokens went to experts \[([0-9, ]+)\] in the "
                       r"last step$", done.stdout, re.MULTILINE)  # whole lines: rank 0 prints every rank's
    assert [int(rank) for rank, *_ in found] == [0, 1], done.stdout  # once each, in rank order
    held = {int(rank): (int(first), int(last), [int(c) for c in counts.split(",")])
            for rank, first, last, counts in found}
    assert [held[rank][:2] for rank in (0, 1)] == [(0, 1), (2, 3)]  # blocks of experts / ep_size, in rank order
    for _, _, counts in held.values():  # a rank's tokens, by global expert: at most one choice per token (k = 1)
        assert len(counts) == 4 and 0 < sum(counts) <= 512
    bad = subprocess.run([sys.executable, "-m", "recipes.demo", "--ep-world-size", "3"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--ep-world-size (3) must divide" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("argv, message", [
    (["--ep-world-size", "0"], "--ep-world-size must be at least 1, got 0"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--k", "0"], "--k must be at least 1, got 0"),
    (["--k", "5"], "--k (5) must be at most --experts (4)"),
    (["--capacity-factor", "-1"], "--capacity-factor must be a positive finite number, got -1.0"),
])
def test_demo_bad_flags_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        demo.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
