"""Checkpoints: exact resume in a new process group, loading at other layouts, atomic writes.

Resume: 6 steps straight equal 3 steps, save, a new process group loading, 3 more steps (bitwise,
same layout, with a WarmupLR schedule running). Resharding: a checkpoint saved at world 4 / ep 2 /
stage 2 loads at world 2 / ep 1 / stage 3 and at world 2 / ep 2 / stage 1, and training goes on to
equal one process that ran the same micro-batches throughout (fp32, 1e-5 relative). A checkpoint
cut short is refused with a clear error while the previous one still loads.
"""

import os

import pytest
import torch

from optim import initialize
from optim.memory import LiveBytes
from parallel import reset_groups
from tests.distributed import run_distributed
from tests.optim.models import Net, batch, config, engine_steps, loss_of, reference_steps

FP32 = {"rtol": 1e-5, "atol": 1e-6}
ACCUMULATION, CLIP = 2, 0.05
SCHEDULE = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 10}}


def _engine(ep_size, stage, **extra):
    reset_groups()
    engine, *_ = initialize(Net(ep_size=ep_size), config=config(stage, ACCUMULATION, CLIP, **extra))
    return engine


def _save_then_continue(rank, world, folder):
    engine = _engine(2, 2, scheduler=SCHEDULE)
    engine_steps(engine, 3, rank, ACCUMULATION)
    engine.save_checkpoint(folder, tag="step3", client_state={"epoch": 7})
    engine_steps(engine, 3, rank, ACCUMULATION, first_step=3)
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save({"state": state, "lr": engine.get_lr()}, os.path.join(folder, "straight.pt"))


def _load_and_continue(rank, world, folder):
    engine = _engine(2, 2, scheduler=SCHEDULE)
    path, client_state = engine.load_checkpoint(folder)
    assert path == os.path.join(folder, "step3") and client_state == {"epoch": 7}
    assert engine.global_steps == 3 and engine.micro_steps == 3 * ACCUMULATION
    engine_steps(engine, 3, rank, ACCUMULATION, first_step=3)
    state = engine.consolidated_state_dict()
    if rank == 0:
        straight = torch.load(os.path.join(folder, "straight.pt"), weights_only=True)
        assert engine.get_lr() == straight["lr"]
        for name, value in straight["state"].items():
            assert torch.equal(state[name], value), f"{name} differs after resuming"


def _reshard_and_continue(rank, world, folder, ep_size, stage):
    engine = _engine(ep_size, stage)
    engine.load_checkpoint(folder, tag="step3")
    engine_steps(engine, 3, rank, ACCUMULATION, first_step=3)
    state = engine.consolidated_state_dict()
    if rank == 0:
        reference = Net(ep_size=1)
        optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1)
        # world 4, then world 2, the same micro-batches as the engines saw. Step k runs at the
        # schedule's lr(max(k - 1, 0)) (DeepSpeed's WarmupLR); after loading without a schedule the
        # lr stays what the checkpoint held, lr(2).
        for step in range(6):
            _set_lr(optimizer, _warmup_lr(max(min(step, 3) - 1, 0)))
            reference_steps(reference, optimizer, 1, 4 if step < 3 else world, ACCUMULATION, CLIP, first_step=step)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, **FP32, msg=lambda m: f"{name}: {m}")


def _warmup_lr(step):
    import math

    return 0.001 + (0.01 - 0.001) * math.log(step + 1) / math.log(10)


def _set_lr(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


@pytest.mark.slow
def test_resume_and_reshard(tmp_path):
    folder = str(tmp_path)
    run_distributed(_save_then_continue, 4, folder, timeout_s=300)
    run_distributed(_load_and_continue, 4, folder, timeout_s=300)
    run_distributed(_reshard_and_continue, 2, folder, 1, 3, timeout_s=300)
    run_distributed(_reshard_and_continue, 2, folder, 2, 1, timeout_s=300)


def test_truncated_checkpoint_is_refused_and_the_previous_one_loads(tmp_path):
    engine = _engine(1, 0)
    engine_steps(engine, 1, 0, ACCUMULATION)
    engine.save_checkpoint(str(tmp_path), tag="good")
    saved = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine_steps(engine, 1, 0, ACCUMULATION, first_step=1)
    engine.save_checkpoint(str(tmp_path), tag="cut")
    assert (tmp_path / "latest").read_text() == "cut"
    files = [f for f in (tmp_path / "cut").iterdir() if f.suffix == ".distcp"]
    biggest = max(files, key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as handle:
        handle.truncate(biggest.stat().st_size // 2)
    with pytest.raises(RuntimeError, match=r"checkpoint .*cut is corrupt: .*distcp has \d+ bytes"):
        engine.load_checkpoint(str(tmp_path))
    (tmp_path / ".interrupted.partial").mkdir()  # a save that died before its rename is never read
    path, _ = engine.load_checkpoint(str(tmp_path), tag="good")
    assert path.endswith("good") and engine.global_steps == 1
    for name, value in engine.consolidated_state_dict().items():
        assert torch.equal(value, saved[name]), name
    manifest = tmp_path / "good" / "manifest.json"
    manifest.write_text(manifest.read_text()[:10])
    with pytest.raises(RuntimeError, match="manifest.json is unreadable"):
        engine.load_checkpoint(str(tmp_path), tag="good")
    os.remove(manifest)
    with pytest.raises(RuntimeError, match="incomplete: it has no manifest.json"):
        engine.load_checkpoint(str(tmp_path), tag="good")
    with pytest.raises(FileNotFoundError, match="missing_tag does not exist"):
        engine.load_checkpoint(str(tmp_path), tag="missing_tag")


def test_a_resumed_run_multiplies_with_the_saved_runs_products(tmp_path):
    """The product implementations measured before a save are adopted on load: a resume that measured
    afresh could pick others and leave the straight run's numbers (in the last bits)."""
    from kernels.cpu import backend

    saved_choices = {"linear|4096|512x2048|float32|nn-": "onednn", "mlp|8192|16x512x2048x512|float32|n": "grouped"}
    backend.clear()
    try:
        backend.adopt(saved_choices)
        engine = _engine(1, 0)
        engine_steps(engine, 1, 0, ACCUMULATION)
        engine.save_checkpoint(str(tmp_path), tag="one")
        assert torch.load(tmp_path / "one" / "meta.pt", weights_only=True)["gemm"] == [backend.choices()]
        backend.clear()  # a new process: nothing measured yet
        _engine(1, 0).load_checkpoint(str(tmp_path))
        assert backend.choices() == saved_choices
    finally:
        backend.clear()


def test_registered_extra_state_is_saved_by_rank_and_given_back_on_load(tmp_path, monkeypatch):
    """A piece of per-process state registered by name travels in meta.pt beside the CPU products' choices;
    a checkpoint without its entry loads without calling it, and meta.pt's own entries cannot be taken."""
    from optim import checkpoint

    monkeypatch.setattr(checkpoint, "_EXTRA_STATE", dict(checkpoint._EXTRA_STATE))
    given = []
    checkpoint.register_extra_state("counter", lambda: {"calls": 7}, given.append)
    assert list(checkpoint._EXTRA_STATE) == ["gemm", "counter"]
    engine = _engine(1, 0)
    engine_steps(engine, 1, 0, ACCUMULATION)
    engine.save_checkpoint(str(tmp_path), tag="one")
    meta = torch.load(tmp_path / "one" / "meta.pt", weights_only=True)
    assert meta["counter"] == [{"calls": 7}] and "gemm" in meta
    _engine(1, 0).load_checkpoint(str(tmp_path))
    assert given == [{"calls": 7}]
    checkpoint.register_extra_state("other", dict, given.append)  # no such entry in the checkpoint: not called
    _engine(1, 0).load_checkpoint(str(tmp_path))
    assert given == [{"calls": 7}] * 2
    with pytest.raises(ValueError, match="name must not be one of meta.pt's own entries .*, got 'rng'"):
        checkpoint.register_extra_state("rng", dict, given.append)


def test_loss_backward_and_output_backward_equal_engine_backward():
    """fp16 scaling and accumulation reach plain loss.backward() and out.backward(grad) through the outputs."""
    results = []
    for mode in ("engine", "loss", "output"):
        engine = _engine(1, 1, fp16={"enabled": True, "initial_scale_power": 8})
        for step in range(2):
            for micro in range(ACCUMULATION):
                x, y = batch(step, micro, 0)
                logits, l_aux = engine(x)
                if mode == "engine":
                    engine.backward(loss_of((logits, l_aux), y))
                elif mode == "loss":
                    loss_of((logits, l_aux), y).backward()
                else:
                    probe = logits.detach().float().requires_grad_()
                    loss_of((probe, l_aux.detach()), y).backward()
                    torch.autograd.backward([logits, l_aux], [probe.grad.to(logits.dtype), torch.tensor(0.01)])
                engine.step()
        assert engine.loss_scale == 256 and not engine.was_step_skipped()
        results.append(engine.consolidated_state_dict())
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name
        torch.testing.assert_close(results[2][name], value, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _evaluate_then_save(rank, world, folder, grad_mode):
    engine = _engine(2, 3)
    engine_steps(engine, 1, rank, ACCUMULATION)
    engine.eval()
    with torch.set_grad_enabled(grad_mode):  # a validation pass leaves no backward to reshard the model
        engine(batch(9, 0, rank)[0])
    engine.train()
    engine.save_checkpoint(folder, tag="after_eval")
    engine_steps(engine, 1, rank, ACCUMULATION, first_step=1)
    state = engine.consolidated_state_dict()
    if rank == 0:
        assert all(torch.isfinite(v).all() for v in state.values())


@pytest.mark.slow
@pytest.mark.parametrize("world, grad_mode", [(2, False), (4, False), (2, True)])
def test_stage3_saves_after_an_evaluation_pass(tmp_path, world, grad_mode):
    run_distributed(_evaluate_then_save, world, str(tmp_path), grad_mode, timeout_s=90)
    assert os.path.isdir(tmp_path / "after_eval")


def _replace_then_train(rank, world, folder, how):
    engine = _engine(2, 3)
    engine_steps(engine, 1, rank, ACCUMULATION)
    if how == "assign":  # new storage for every parameter, the same values
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        engine.module.load_state_dict(state, assign=True)
    elif how == "apply":
        engine.module.double().float()
    engine_steps(engine, 2, rank, ACCUMULATION, first_step=1)
    state = engine.consolidated_state_dict()
    if rank == 0:
        torch.save(state, os.path.join(folder, f"{how}.pt"))


@pytest.mark.slow
def test_stage3_optimizer_follows_parameters_whose_storage_was_replaced(tmp_path):
    """The optimizer steps on fully_shard's local shards: after load_state_dict(assign=True) or a dtype
    round trip gave them new storage, training goes on exactly as without it."""
    for how in ("none", "assign", "apply"):
        run_distributed(_replace_then_train, 2, str(tmp_path), how, timeout_s=120)
    straight = torch.load(tmp_path / "none.pt", weights_only=True)
    for how in ("assign", "apply"):
        replaced = torch.load(tmp_path / f"{how}.pt", weights_only=True)
        for name, value in straight.items():
            assert torch.equal(replaced[name], value), f"{how}: {name} differs"


class _LinearExperts(torch.nn.Module):
    """An MoE layer whose expert is one nn.Linear (DeepSpeed's CIFAR tutorial): experts stay per-expert modules."""

    def __init__(self, ep_size):
        super().__init__()
        from moe import MoE

        torch.manual_seed(0)
        self.moe = MoE(8, torch.nn.Linear(8, 8), num_experts=4, ep_size=ep_size, k=1, min_capacity=0, use_rts=False,
                       expert_init="per_expert_seed", seed=7)

    def forward(self, x):
        return self.moe(x)[0].square().mean()


def _linear_engine(ep_size, stage):
    reset_groups()
    engine, *_ = initialize(_LinearExperts(ep_size=ep_size), config=config(stage, 1, 0.0))
    assert not engine.module.moe.deepspeed_moe.experts.stacked, "the experts should be per-expert modules"
    return engine


def _linear_step(engine, step, rank):
    engine.backward(engine(torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))))
    engine.step()


def _assert_states_close(actual, expected, what):
    assert set(actual) == set(expected), what
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, **FP32, msg=lambda m: f"{what}, {name}: {m}")


def _linear_experts_consolidate_and_reload(rank, world, folder):
    """Saved at ep 2, loaded at ep 1: the same weights, and the next step (AdamW, from the loaded moments)
    equals the ep-2 run going on; saved at ep 1, loaded at ep 2: the next step equals ep 1's."""
    engine = _linear_engine(2, 2)
    _linear_step(engine, 0, rank)
    state = engine.consolidated_state_dict()
    engine.save_checkpoint(folder, tag="linear")
    _linear_step(engine, 1, rank)
    straight = engine.consolidated_state_dict()
    if rank == 0:
        names = set(_LinearExperts(ep_size=1).state_dict())
        assert set(state) == names, f"missing {sorted(names - set(state))}, extra {sorted(set(state) - names)}"
        torch.save(state, os.path.join(folder, "consolidated.pt"))
    other = _linear_engine(1, 1)
    other.load_checkpoint(folder, tag="linear")
    reloaded = other.consolidated_state_dict()
    if rank == 0:
        for name, value in torch.load(os.path.join(folder, "consolidated.pt"), weights_only=True).items():
            assert torch.equal(reloaded[name], value), f"{name} differs after loading at ep 1"
    _linear_step(other, 1, rank)
    after = other.consolidated_state_dict()
    if rank == 0:
        moved = [name for name in after if "experts" in name and not torch.equal(after[name], reloaded[name])]
        assert len(moved) == 8, f"every expert weight and bias should move in the step, moved: {moved}"
        _assert_states_close(after, straight, "the step after loading at ep 1 against ep 2 going on")

    other.save_checkpoint(folder, tag="linear_ep1")
    _linear_step(other, 2, rank)
    ep1_next = other.consolidated_state_dict()
    back = _linear_engine(2, 2)
    back.load_checkpoint(folder, tag="linear_ep1")
    _linear_step(back, 2, rank)
    ep2_next = back.consolidated_state_dict()
    if rank == 0:
        _assert_states_close(ep2_next, ep1_next, "the step after loading at ep 2 against ep 1 going on")


def test_per_expert_linear_experts_consolidate_and_reshard(tmp_path):
    run_distributed(_linear_experts_consolidate_and_reload, 2, str(tmp_path), timeout_s=120)


def _net_engine(ep_size, stage):
    reset_groups()
    engine, *_ = initialize(Net(ep_size=ep_size), config=config(stage, 1, 0.0))
    return engine


def _net_step(engine, step, rank):
    x, y = batch(step, 0, rank)
    engine.backward(loss_of(engine(x), y))
    engine.step()


def _stage3_at_ep2_against_stage2(rank, world, folder):
    """At world 2 / ep 2, per-module and stacked experts: a checkpoint of stage 2 loaded at stage 3, and one of
    stage 3 loaded at stage 2; the next step equals the saving run going on."""
    kinds = (("Linear experts", _linear_engine, _linear_step), ("stacked experts", _net_engine, _net_step))
    for kind, make, step in kinds:
        for saved, loaded in ((2, 3), (3, 2)):
            tag = f"{kind[0]}{saved}{loaded}"
            engine = make(2, saved)
            step(engine, 0, rank)
            engine.save_checkpoint(folder, tag=tag)
            step(engine, 1, rank)
            going_on = engine.consolidated_state_dict()
            other = make(2, loaded)
            other.load_checkpoint(folder, tag=tag)
            step(other, 1, rank)
            after = other.consolidated_state_dict()
            if rank == 0:
                _assert_states_close(after, going_on, f"{kind}, saved at stage {saved}, next step at stage {loaded}")


@pytest.mark.slow
def test_stage3_at_ep2_resumes_a_stage2_checkpoint_and_the_reverse(tmp_path):
    run_distributed(_stage3_at_ep2_against_stage2, 2, str(tmp_path), timeout_s=180)


FORMAT1 = os.path.join(os.path.dirname(__file__), os.pardir, "data", "checkpoint_v1")


def _format1_loads_at_stage3_and_saves_sharded(rank, world, folder):
    expected = torch.load(os.path.join(FORMAT1, "expected.pt"), weights_only=True)
    engine = _engine(2, 3)
    _, client_state = engine.load_checkpoint(FORMAT1)
    assert client_state == {"epoch": 3} and engine.global_steps == 2
    state = engine.consolidated_state_dict()
    if rank == 0:
        for name, value in expected["loaded"].items():
            assert torch.equal(state[name], value), f"{name} differs after loading the format-1 checkpoint"
    engine.save_checkpoint(folder, tag="resaved")


def test_a_checkpoint_written_before_the_sharded_layout_still_loads(tmp_path):
    """tests/data/checkpoint_v1: saved at world 2 / ep 2 / stage 2 by the version that wrote one full
    chunk per entry, with what loading it at world 1 / stage 0 and one more step gave then.

    Loading is pure data, compared bit for bit. The recorded next step was computed on another CPU,
    whose products round differently (AVX2 against AVX-512 kernels), so it is compared within fp32
    tolerance; the next step after the sharded round trip equals this machine's direct one bit for bit.
    """
    expected = torch.load(os.path.join(FORMAT1, "expected.pt"), weights_only=True)
    engine = _engine(1, 0)
    engine.load_checkpoint(FORMAT1)
    loaded = engine.consolidated_state_dict()
    for name, value in expected["loaded"].items():
        assert torch.equal(loaded[name], value), f"{name} differs after loading the format-1 checkpoint"
    engine_steps(engine, 1, 0, ACCUMULATION, first_step=2)
    direct = engine.consolidated_state_dict()
    _assert_states_close(direct, expected["after_one_step"], "the step after loading the format-1 checkpoint")
    # through stage 3 at world 2, saved again in the sharded layout, back at world 1: the same step
    run_distributed(_format1_loads_at_stage3_and_saves_sharded, 2, str(tmp_path), timeout_s=120)
    engine = _engine(1, 0)
    engine.load_checkpoint(str(tmp_path), tag="resaved")
    engine_steps(engine, 1, 0, ACCUMULATION, first_step=2)
    for name, value in engine.consolidated_state_dict().items():
        assert torch.equal(value, direct[name]), f"{name} differs after the sharded round trip"


def _sharded_save(rank, world, folder, stage):
    reset_groups()
    engine, *_ = initialize(Net(ep_size=1, dense_width=1024), config=config(stage, ACCUMULATION, CLIP))
    engine_steps(engine, 1, rank, ACCUMULATION)
    tracker = LiveBytes()
    with tracker:
        engine.save_checkpoint(folder, tag="sharded")
    largest = max(p.numel() * p.element_size() for p in Net(dense_width=1024).parameters())  # 32 kB
    # nothing is copied out of the flat buffer (DCP would keep every copy until the file is written: the
    # whole share, ~100 kB here); DCP's own plans take 20-30 kB per rank
    assert tracker.peak <= largest + 40 * 1024, f"rank {rank}: {tracker.peak} bytes during save (a parameter: {largest})"
    tracker = LiveBytes()
    with tracker:
        engine.load_checkpoint(folder, tag="sharded")
    # DCP's read buffers (a stored piece or two) and plans vary by ~20 kB; every entry in full: ~220 kB
    assert tracker.peak <= largest + 96 * 1024, f"rank {rank}: {tracker.peak} bytes during load"
    if rank == 0:
        import torch.distributed.checkpoint as dcp

        stored = dcp.FileSystemReader(os.path.join(folder, "sharded")).read_metadata()
        files = {}
        for index, info in stored.storage_data.items():
            files.setdefault(info.relative_path, set()).add(index.fqn)
        total = sum(os.path.getsize(os.path.join(folder, "sharded", f)) for f in files)
        for name in files:  # each rank wrote its half of every parameter and state
            size = os.path.getsize(os.path.join(folder, "sharded", name))
            assert 0.35 < size / total < 0.65, f"{name}: {size} of {total} bytes"
        split = [k for k, v in stored.state_dict_metadata.items() if k.startswith("model/") and len(v.chunks) > 1]
        assert split, "no parameter was written by both ranks"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_each_rank_writes_and_reads_only_its_share(tmp_path, stage):
    """Saving and loading at world 2 allocate no more than one parameter beyond the model (measured by
    LiveBytes; the format-1 save gathered every parameter and state on rank 0, about 3x the model)."""
    run_distributed(_sharded_save, 2, str(tmp_path), stage, timeout_s=120)


class _Crash(Exception):
    pass


@pytest.mark.slow
def test_a_save_stopped_at_any_point_leaves_the_previous_or_the_new_checkpoint(tmp_path, monkeypatch):
    """Every file-system step of a save (DCP's writes, meta.pt, the manifest, fsyncs, the renames, the
    removal of the replaced folder, `latest`) fails in turn, as a process killed there would stop; a fresh engine then loads the folder and
    finds the checkpoint before the save or the one it was writing, whole, never neither."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from optim import checkpoint

    engine = _engine(1, 0)
    engine_steps(engine, 1, 0, ACCUMULATION)
    pristine = tmp_path / "pristine"
    engine.save_checkpoint(str(pristine), tag="t")
    before = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    engine_steps(engine, 1, 0, ACCUMULATION, first_step=1)
    after = {k: v.clone() for k, v in engine.consolidated_state_dict().items()}
    steps = [(os, "replace"), (os, "rename"), (os, "makedirs"), (shutil, "rmtree"), (checkpoint, "_write_meta"),
             (checkpoint, "_fsync_dir"), (dcp, "save")]
    calls = []

    def save_failing_at(folder, tag, fail_at):
        """Save into `folder`, raising at the fail_at-th file-system step (0: none); True if it stopped."""
        calls.clear()
        with monkeypatch.context() as patch:
            for owner, name in steps:
                def wrapper(*args, _original=getattr(owner, name), _name=name, **kwargs):
                    calls.append(_name)
                    if len(calls) == fail_at:
                        raise _Crash(f"stopped at {_name}")
                    return _original(*args, **kwargs)
                patch.setattr(owner, name, wrapper)
            try:
                engine.save_checkpoint(str(folder), tag=tag)
            except (Exception, CheckpointException):  # DCP wraps what its writers raise (a BaseException)
                assert len(calls) >= fail_at > 0, f"the save failed on its own after {calls}"
                return True
        return False

    for tag in ("t", "u"):  # the same tag again (the old folder is replaced), a new one
        shutil.copytree(pristine, tmp_path / f"count-{tag}")
        save_failing_at(tmp_path / f"count-{tag}", tag, 0)
        total = len(calls)
        assert {"save", "_write_meta", "replace", "rmtree", "_fsync_dir"} <= set(calls), calls
        for fail_at in range(1, total + 1):
            folder = tmp_path / f"{tag}-{fail_at}"
            shutil.copytree(pristine, folder)
            assert save_failing_at(folder, tag, fail_at), f"step {fail_at} of {total} did not run"
            loaded = _engine(1, 0)
            path, _ = loaded.load_checkpoint(str(folder))
            state = loaded.consolidated_state_dict()
            same = [all(torch.equal(state[k], v) for k, v in ref.items()) for ref in (before, after)]
            assert any(same), f"a save of tag {tag} stopped at {calls[-1]} (step {fail_at}) left {path} matching neither"


@pytest.mark.parametrize("saved,loading,message", [
    ({}, {"experts": 8}, r"holds 4 experts for moe\.deepspeed_moe\.experts\.\S+, this model has 8"),
    ({}, {"hidden": 32}, r"holds moe\.\S+ with shape \[\d+(, \d+)*\], this model's is"),
    ({}, {"dense_width": 4}, r"has no entry for parameter block\.0\.bias: it was saved from a different model"),
    ({"dense_width": 4}, {}, r"holds parameter block\.0\.bias that this model lacks \(4 such entries\)"),
])
def test_a_checkpoint_of_another_model_is_refused_before_anything_changes(tmp_path, saved, loading, message):
    reset_groups()
    engine, *_ = initialize(Net(**saved), config=config(1, ACCUMULATION, CLIP))
    engine.save_checkpoint(str(tmp_path), tag="other")
    reset_groups()
    target, *_ = initialize(Net(**loading), config=config(1, ACCUMULATION, CLIP))
    before = {k: v.clone() for k, v in target.consolidated_state_dict().items()}
    for optimizer_states in (True, False):
        with pytest.raises(RuntimeError, match=message):
            target.load_checkpoint(str(tmp_path), load_optimizer_states=optimizer_states)
    after = target.consolidated_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load changed the model"


class _OneDimensionalExperts(torch.nn.Module):
    """A stacked expert parameter of one dimension (a per-expert scale): each expert's entry is 0-d."""

    def __init__(self):
        super().__init__()
        from parallel import tag_expert_ids, tag_expert_parameters

        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 4)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 2.0, 4))
        tag_expert_parameters([self.scale], "ep_size_1")
        tag_expert_ids(self.scale, (0, 1, 2, 3), 0)

    def forward(self, x):
        return (self.linear(x) * self.scale).square().mean()


def test_per_expert_optimizer_states_of_one_dimensional_experts_reload(tmp_path):
    """Their states' entries are 0-d like a step counter: meta.pt tells them apart."""
    def engine():
        reset_groups()
        return initialize(_OneDimensionalExperts(), config=config(0, 1, 0.0))[0]

    def train(e, steps, seed):
        for step in range(steps):
            e.backward(e(torch.randn(6, 8, generator=torch.Generator().manual_seed(seed + step))))
            e.step()

    straight = engine()
    train(straight, 2, 0)
    straight.save_checkpoint(str(tmp_path), tag="two")
    train(straight, 2, 2)
    resumed = engine()
    resumed.load_checkpoint(str(tmp_path), tag="two")
    train(resumed, 2, 2)
    for name, value in straight.consolidated_state_dict().items():
        assert torch.equal(resumed.consolidated_state_dict()[name], value), name
