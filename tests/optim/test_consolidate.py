"""`python -m optim.consolidate`: the one-process state dict from a checkpoint, without a process group,
equal (bitwise) to `engine.consolidated_state_dict()` at stages 0-3 and ep 1 and 2 (2 processes)."""

import os

import pytest
import torch

from optim import consolidate, initialize
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, config, engine_steps


def _save_each_layout(rank, world, folder):
    for stage in (0, 1, 2, 3):
        for ep in (1, 2):
            reset_groups()
            engine, *_ = initialize(Net(ep_size=ep, dense_width=4), config=config(stage, 1, 0.05))
            engine_steps(engine, 1, rank, 1)
            path = engine.save_checkpoint(os.path.join(folder, f"s{stage}ep{ep}"))
            state = engine.consolidated_state_dict()
            if rank == 0:
                torch.save(state, os.path.join(folder, f"s{stage}ep{ep}.pt"))
                assert os.path.isdir(path)


@pytest.mark.slow
def test_consolidate_equals_the_engines_view_at_every_layout(tmp_path, capsys):
    run_distributed(_save_each_layout, 2, str(tmp_path), timeout_s=300)
    names = set(Net(dense_width=4).state_dict())
    for stage in (0, 1, 2, 3):
        for ep in (1, 2):
            expected = torch.load(tmp_path / f"s{stage}ep{ep}.pt", weights_only=True)
            out = tmp_path / f"s{stage}ep{ep}-out.pt"
            consolidate.main([str(tmp_path / f"s{stage}ep{ep}"), str(out)])  # the folder holding `latest`
            written = torch.load(out, weights_only=True)
            assert set(written) == set(expected) == names, (stage, ep, set(written) ^ names)
            for name, value in expected.items():
                assert written[name].dtype == value.dtype and torch.equal(written[name], value), (stage, ep, name)
    assert "wrote " in capsys.readouterr().out


def test_bad_arguments_get_one_line(tmp_path, capsys):
    for argv, message in [([str(tmp_path / "none"), str(tmp_path / "x.pt")], "does not exist"),
                          ([str(tmp_path), str(tmp_path / "x.bin")], "must end in .pt or .safetensors")]:
        with pytest.raises(SystemExit) as stopped:
            consolidate.main(argv)
        assert stopped.value.code == 2
        assert message in capsys.readouterr().err
