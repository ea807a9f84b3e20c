"""Checkpoints that reshard: the one-process model's entries, each rank writing and reading only its share.

What is stored is the one-process view, not this layout's shards: `model/<name>` is each parameter
(the fp32 master when there is one) and `optim/<name>/<state>` each optimizer state, with stacked
expert parameters cut per global expert (`<name>#expert<g>`) and per-expert modules under their global
index. Each rank writes, through torch.distributed.checkpoint, the boxes of those entries that its
shard holds (a flat ZeRO-1/2 slice covers a run of a parameter's elements, cut into rectangular boxes;
a fully_shard shard is one box), straight from its own storage; values replicated over a group are
written by the group's first rank. Loading asks DCP for the boxes this layout's shard needs, read
straight into the master weights and optimizer states, so any (world size, ep size, ZeRO stage) loads
any checkpoint, and no rank gathers full parameters. Host memory beyond the model's own: saving
hands DCP host boxes without copying them (a box that is not contiguous, or one on a GPU, is copied
to the host, and DCP keeps each copy until its file is written); reading holds one stored piece at a
time (a whole parameter where the writer held it whole: stage 0, one process, or the first format). Counters, scaler, scheduler, param-group settings, client
state, every rank's RNG states and every rank's extra state (`register_extra_state`: the CPU products'
measured choices, under "gemm") go to `meta.pt`. Checkpoints written before the sharded layout
(one full chunk per entry) load the same way.

Atomicity: everything is written into `.<tag>.partial` and synced to disk; rank 0 then records every
file's size and CRC-32 in `manifest.json`, renames the folder to `<tag>` (syncing the directory) and
only then rewrites `latest`. Saving a tag that exists moves the old folder to `.<tag>.old` first and
deletes it last; loading reads `.<tag>.old` when a save stopped between the two renames. Loading
checks the manifest first, so a truncated or half-written checkpoint fails with a clear error and
the previous one, untouched, still loads. Files are read with `torch.load(weights_only=True)` and
DCP; nothing is unpickled as code.
"""

import contextlib
import json
import math
import os
import shutil
import warnings
import zlib

import torch
import torch.distributed as dist

from parallel import accelerator_name

__all__ = ["CheckpointError", "check_load_options", "consolidated_state_dict", "load", "register_extra_state",
           "save", "save_state_dict", "verify"]


class CheckpointError(RuntimeError):
    """A checkpoint refused: incomplete, corrupt, of another format, or of another model (raised on every rank)."""

_FORMAT = 1
_EXTRA_STATE: dict[str, tuple] = {}  # name -> (get, put), in the order registered (register_extra_state)
_META_ENTRIES = ("format", "global_steps", "micro_steps", "skipped_steps", "world_size", "stage", "scaler",
                 "lr_scheduler", "param_groups", "client_state", "rng", "per_element_states", "expert_axes")


def register_extra_state(name: str, get, put) -> None:
    """Keep a piece of per-process state with every checkpoint, as `meta.pt`'s entry `name`.

    Saving stores get() of every rank, a list by rank; loading calls put() with the entry of the rank
    this one continues (its rank modulo the saving world size), and skips an entry the checkpoint does
    not have or that is empty. The values must be what torch.load(weights_only=True) reads back. Saving
    gathers each entry over the ranks, so every rank registers the same names in the same order.

    Args:
        name: the entry's key in `meta.pt`; registering a name again replaces its functions.
        get: () -> this process's state. put: (a saved state) -> None.

    Raises:
        ValueError: `name` is one of the checkpoint's own entries.
    """
    if name in _META_ENTRIES:
        raise ValueError(f"name must not be one of meta.pt's own entries {_META_ENTRIES}, got {name!r}")
    _EXTRA_STATE[name] = (get, put)


def _dcp():
    """torch.distributed.checkpoint and this module's planners, imported when a checkpoint is written or
    read: importing DCP is slow, and every process that imports optim would pay for it otherwise."""
    import torch.distributed.checkpoint as dcp

    from optim import checkpoint_planners

    return dcp, checkpoint_planners


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when torch.distributed is not initialised: so do we."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _owner(engine, unit) -> bool:
    return unit.group_rank == 0 if unit.expert else engine.rank == 0


def _sharded_states(engine, unit) -> dict:
    """The optimizer's state for a unit's flat proxy: tensors shaped like its shard, and scalars (none where
    the optimizer steps on per-parameter views: `_view_entries`)."""
    state = engine.optimizer.state.get(unit.proxy, {}) if engine.optimizer.views is None else {}
    return {name: value for name, value in sorted(state.items()) if isinstance(value, torch.Tensor)}


def _is_sharded(unit, value: torch.Tensor) -> bool:
    return value.dim() >= 1 and value.shape == unit.weights.shape


def _unit_boxes(unit, local: torch.Tensor) -> list[tuple[str, tuple[int, ...], tuple[int, ...], torch.Tensor]]:
    """(entry key, entry size, offsets in the entry, view of `local`) for what `local` holds of each
    parameter; a stacked expert parameter's boxes are cut per global expert."""
    out = []
    for info, offsets, view in unit.boxes(local):
        shape = tuple(info.param.shape)
        if info.expert and info.axis is not None:
            axis, keys = info.axis, info.keys()
            size, rest = shape[:axis] + shape[axis + 1:], offsets[:axis] + offsets[axis + 1:]
            out += [(keys[offsets[axis] + i], size, rest, view.select(axis, i)) for i in range(view.shape[axis])]
        else:
            out.append((info.global_name, shape, offsets, view))
    return out


Boxes = dict[str, tuple[tuple[int, ...], dict[tuple[int, ...], torch.Tensor]]]  # key -> (size, {offsets: view})


def _add(boxes: Boxes, key: str, size: tuple[int, ...], offsets: tuple[int, ...], view: torch.Tensor) -> None:
    if view.numel() or math.prod(size) == 0:  # an empty parameter is one empty box
        boxes.setdefault(key, (tuple(size), {}))[1][tuple(offsets)] = view


def _boxes_to_write(engine) -> Boxes:
    """This rank's share of every entry: its slices of the masters and optimizer states, its units'
    scalar states and (rank 0) the module's buffers, as views of the live tensors."""
    boxes: Boxes = {}
    for unit in engine.units:
        if unit.counts_once():  # stage 0 replicates a group's slice: its first rank writes it
            for key, size, offsets, view in _unit_boxes(unit, unit.weights):
                _add(boxes, f"model/{key}", size, offsets, view)
        if _owner(engine, unit):  # parameters without elements hold no box of any slice: their owner writes one
            for info in unit.infos:
                if info.param.numel() == 0:
                    for key in info.keys():
                        shape = _entry_shape(info)
                        _add(boxes, f"model/{key}", shape, (0,) * len(shape), torch.empty(shape, dtype=unit.weights.dtype))
        for name, value in _sharded_states(engine, unit).items():
            if _is_sharded(unit, value):
                if unit.counts_once():
                    for key, size, offsets, view in _unit_boxes(unit, value):
                        _add(boxes, f"optim/{key}/{name}", size, offsets, view)
            elif _owner(engine, unit):  # a step counter: the same value under every parameter's key
                for info in unit.infos:
                    for key in info.keys():
                        _add(boxes, f"optim/{key}/{name}", tuple(value.shape), (0,) * value.dim(), value)
        if _owner(engine, unit):  # states of an optimizer that steps on whole parameters (optim.shaped)
            for key, value in _view_entries(engine, unit):
                _add(boxes, key, tuple(value.shape), (0,) * value.dim(), value)
    if engine.rank == 0:
        for name, buffer in _buffers(engine).items():
            _add(boxes, f"buffer/{name}", tuple(buffer.shape), (0,) * buffer.dim(), buffer.detach())
    return boxes


def _view_entries(engine, unit) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) of each state an optimizer stepping on per-parameter views holds, whole, under the
    parameter's first key; none for an optimizer stepping on flat proxies."""
    if engine.optimizer.views is None:
        return []
    return [(f"optim/{_view_key(infos[0])}/{name}", value) for infos, state in engine.optimizer.unit_states(unit)
            for name, value in sorted(state.items()) if isinstance(value, torch.Tensor)]


def _view_key(info) -> str:
    """The key of a whole parameter's optimizer states: its one-process name, with the span of global
    experts it stacks (so another expert-parallel layout finds none, rather than the wrong ones)."""
    if info.expert and info.axis is not None:
        return f"{info.global_name}#experts{info.ids[0]}-{info.ids[-1]}"
    return info.keys()[0]


def _buffers(engine) -> dict[str, torch.Tensor]:
    parameters = {name for name, _ in engine.module.named_parameters()}
    return {name: value for name, value in engine.module.state_dict().items() if name not in parameters}


def _global_view(engine, with_optimizer: bool = True) -> dict[str, torch.Tensor]:
    """The entries this rank owns, as full per-parameter tensors (collective over each unit's group)."""
    out = {}
    for unit in engine.units:
        owner = _owner(engine, unit)
        fulls = unit.gather(unit.weights)
        if owner:
            for info, full in zip(unit.infos, fulls):
                for key, piece in zip(info.keys(), info.split(full)):
                    out[f"model/{key}"] = piece.detach().cpu().contiguous()
        if not with_optimizer:
            continue
        if owner:
            out.update((key, value.detach().cpu().contiguous()) for key, value in _view_entries(engine, unit))
        for name, value in _sharded_states(engine, unit).items():
            pieces = unit.gather(value) if _is_sharded(unit, value) else [value] * len(unit.infos)
            if owner:
                for info, full in zip(unit.infos, pieces):
                    split = info.split(full) if _is_sharded(unit, value) else [full] * len(info.keys())
                    for key, piece in zip(info.keys(), split):
                        out[f"optim/{key}/{name}"] = piece.detach().cpu().contiguous()
    if engine.rank == 0:
        for name, buffer in _buffers(engine).items():
            out[f"buffer/{name}"] = buffer.detach().cpu().contiguous()
    return out


def _by_rank(engine, value) -> list:
    """`value` of every rank, a list by rank (collective under torch.distributed)."""
    if not _distributed():
        return [value]
    values = [None] * engine.world_size
    dist.all_gather_object(values, value)
    return values


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if accelerator_name() == "cuda":
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _manifest(folder: str) -> dict:
    entries = {}
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            entries[os.path.relpath(path, folder)] = _manifest_entry(path)
    return entries


def _fsync_dir(path: str) -> None:
    """Make the renames and new files in a folder durable (a no-op where folders cannot be opened)."""
    try:
        handle = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _write_meta(path: str, meta: dict) -> None:
    """meta.pt, on disk before its CRC is taken."""
    with open(path, "wb") as handle:
        torch.save(meta, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _write_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def save(engine, save_dir: str, tag: str | None, client_state: dict, save_latest: bool = True) -> str:
    """Write a checkpoint of `engine` under save_dir/tag (collective); returns its folder."""
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag must be a plain folder name, got {tag!r}")
    final, partial = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.partial")
    if engine.rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    dcp, planners = _dcp()
    with _single_process_quiet():
        dcp.save(_boxes_to_write(engine), storage_writer=dcp.FileSystemWriter(partial),
                 planner=planners.BoxSavePlanner(), no_dist=not _distributed())
    rng = _by_rank(engine, _rng_state())
    extra = {name: _by_rank(engine, get()) for name, (get, _) in _EXTRA_STATE.items()}
    if engine.rank == 0:
        meta = {
            "format": _FORMAT, "global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
            "skipped_steps": engine.skipped_steps, "world_size": engine.world_size, "stage": engine.stage,
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
            "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups],
            "client_state": client_state, "rng": rng, **extra,
            # optimizer states kept per element (shaped like the parameters), told apart from counters
            "per_element_states": sorted({name for unit in engine.units
                                          for name, value in _sharded_states(engine, unit).items()
                                          if _is_sharded(unit, value)}),
            # how stacked experts' entries (`<name>#expert<g>`) join into the one-process parameter
            "expert_axes": {info.global_name: info.axis for unit in engine.units for info in unit.infos
                            if info.expert and info.axis is not None},
        }
        _write_meta(os.path.join(partial, "meta.pt"), meta)
        _write_atomically(os.path.join(partial, "manifest.json"), json.dumps(_manifest(partial), indent=1))
        # same tag again: the old folder goes only once the new one is in place (between the two
        # renames loading reads `.<tag>.old`, see _resolve)
        old = os.path.join(save_dir, f".{tag}.old")
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            _fsync_dir(save_dir)
        os.replace(partial, final)
        _fsync_dir(save_dir)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            _write_atomically(os.path.join(save_dir, "latest"), tag)
    _barrier()
    return final


def verify(path: str) -> None:
    """Check a checkpoint folder against its manifest.

    Raises:
        CheckpointError: the folder, its manifest or a file is missing, or a file's size or CRC differs.
    """
    manifest_path = os.path.join(path, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no manifest.json (interrupted while writing?)")
    try:
        with open(manifest_path) as handle:
            manifest = json.load(handle)
    except ValueError:
        raise CheckpointError(f"checkpoint {path} is corrupt: manifest.json is unreadable (truncated?)") from None
    if not isinstance(manifest, dict) or not manifest:
        raise CheckpointError(f"checkpoint {path} is corrupt: manifest.json lists no files")
    for relative, expected in manifest.items():
        file = os.path.join(path, relative)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path} is incomplete: {relative} is missing")
        actual = _manifest_entry(file)
        if actual != expected:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {relative} has {actual['bytes']} bytes (CRC {actual['crc32']}), "
                f"the manifest says {expected['bytes']} bytes (CRC {expected['crc32']}); truncated or overwritten?"
            )


def read_client_state(load_dir: str, tag: str | None = None) -> dict:
    """The client state saved with a checkpoint (after verifying it), read without an engine.

    Raises:
        FileNotFoundError: no such checkpoint. CheckpointError: it is incomplete or corrupt.
    """
    path = _resolve(load_dir, tag)
    verify(path)
    return torch.load(os.path.join(path, "meta.pt"), weights_only=True)["client_state"]


def _manifest_entry(path: str) -> dict:
    crc = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": os.path.getsize(path), "crc32": crc}


def _resolve(load_dir: str, tag: str | None) -> str:
    if tag is None:
        latest = os.path.join(load_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"no checkpoint to load: {latest} does not exist; pass tag= or save first")
        with open(latest, "rb") as handle:
            raw = handle.read(4096)
        try:
            tag = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            tag = ""
        if not tag or "/" in tag or tag.startswith("."):
            raise CheckpointError(f"{latest} is corrupt: it should name a checkpoint folder, it holds {raw[:40]!r}; "
                               "pass tag= to load a checkpoint by name")
    path = os.path.join(load_dir, str(tag))
    old = os.path.join(load_dir, f".{tag}.old")
    if not os.path.isdir(path) and os.path.isdir(old):
        return old  # a save of the same tag stopped between its two renames: the previous one is whole
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return path


def _checked_path(engine, load_dir: str, tag: str | None) -> str:
    """Resolve and verify on rank 0; every rank raises the same error."""
    outcome = [None]
    if engine.rank == 0:
        try:
            path = _resolve(load_dir, tag)
            verify(path)
            outcome = [("ok", path)]
        except (OSError, RuntimeError, ValueError) as error:
            outcome = [(type(error).__name__, str(error))]
    if _distributed():
        dist.broadcast_object_list(outcome, src=0)
    kind, text = outcome[0]
    if kind == "FileNotFoundError":
        raise FileNotFoundError(text)
    if kind != "ok":
        raise CheckpointError(text)
    return text


def _expert_counts(shapes: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for key in shapes:
        if "#expert" in key:
            base = key.split("#expert")[0][len("model/"):]
            counts[base] = counts.get(base, 0) + 1
    return counts


def _model_mismatch(engine, stored, path: str) -> str | None:
    """The first difference between the checkpoint's parameters and this model's (collective), or None."""
    mine = {}
    for unit in engine.units:
        for info in unit.infos:
            for key in info.keys():
                mine[f"model/{key}"] = list(_entry_shape(info))
    parts = [mine]
    if _distributed():
        parts = [None] * engine.world_size
        dist.all_gather_object(parts, mine)
    expected = {key: shape for part in parts for key, shape in part.items()}
    saved = {key: list(entry.size) for key, entry in stored.items() if key.startswith("model/")}
    theirs, ours = _expert_counts(saved), _expert_counts(expected)
    for base in sorted(ours):
        if theirs.get(base, 0) != ours[base]:
            return (f"checkpoint {path} holds {theirs.get(base, 0)} experts for {base}, this model has {ours[base]} "
                    "(a different --num-experts or model?)")
    for key in sorted(expected):
        if key not in saved:
            return f"checkpoint {path} has no entry for parameter {key[6:]}: it was saved from a different model"
        if saved[key] != expected[key]:
            return (f"checkpoint {path} holds {key[6:]} with shape {saved[key]}, this model's is {expected[key]} "
                    "(a different model width or configuration?)")
    extra = sorted(set(saved) - set(expected))
    if extra:
        return (f"checkpoint {path} holds parameter {extra[0][6:]} that this model lacks ({len(extra)} such entries): "
                "it was saved from a different model (more layers or experts?)")
    return None


def _entry_shape(info) -> tuple[int, ...]:
    """The shape of each of a parameter's checkpoint entries (one expert's, for stacked experts)."""
    shape = list(info.param.shape)
    if info.expert and info.axis is not None:
        del shape[info.axis]
    return tuple(shape)


def _boxes_to_read(engine, stored, with_optimizer: bool, per_element: list[str] | None) -> tuple[Boxes, dict]:
    """The boxes this rank's shard needs, as views of where they go: the masters, the optimizer states
    (kept tensors where they fit, else new shard-sized ones) and the module's buffers. Also returns the
    optimizer state each unit will have, by unit index."""
    boxes: Boxes = {}
    states = {}
    for index, unit in enumerate(engine.units):
        for key, size, offsets, view in _unit_boxes(unit, unit.weights):
            _add(boxes, f"model/{key}", size, offsets, view)
        if with_optimizer and engine.optimizer.views is not None:
            states[index] = _view_states_to_read(engine, unit, stored, boxes)
        elif with_optimizer:
            states[index] = _state_to_read(engine, unit, stored, boxes, per_element)
    for name, buffer in _buffers(engine).items():
        entry = stored.get(f"buffer/{name}")
        if entry is None:
            continue
        if tuple(entry.size) != tuple(buffer.shape):
            raise CheckpointError(f"checkpoint holds buffer {name} with shape {list(entry.size)}, this model's is "
                               f"{list(buffer.shape)}: it was saved from a different model")
        _add(boxes, f"buffer/{name}", tuple(buffer.shape), (0,) * buffer.dim(), buffer)
    return boxes, states


def _state_to_read(engine, unit, stored, boxes: Boxes, per_element: list[str] | None) -> dict[str, torch.Tensor]:
    """The tensors a unit's optimizer state is read into: per-element states shaped like the unit's
    shard (this rank's boxes of them added to `boxes`), step counters as saved. `per_element` names
    the per-element states (meta.pt); for checkpoints that do not record them, a state whose entries
    have the parameter's shape, with at least one dimension, is one."""
    info = next((i for i in unit.infos if i.param.dim() >= 1), unit.infos[0])
    prefix = f"optim/{info.keys()[0]}/"
    held = engine.optimizer.state.get(unit.proxy, {})
    group = next(g for g in engine.optimizer.param_groups if any(p is unit.proxy for p in g["params"]))
    on_device = bool(group.get("fused") or group.get("capturable"))  # these keep their counters beside the weights
    state = {}
    for key in stored:
        if not key.startswith(prefix):
            continue
        name, entry = key[len(prefix):], stored[key]
        if (name in per_element if per_element is not None
                else len(entry.size) >= 1 and tuple(entry.size) == _entry_shape(info)):
            value = held.get(name)
            if not (isinstance(value, torch.Tensor) and value.shape == unit.weights.shape
                    and value.dtype == engine.state_dtype and value.device == unit.weights.device):
                value = torch.zeros(unit.weights.shape, dtype=engine.state_dtype, device=unit.weights.device)
            for entry_key, size, offsets, view in _unit_boxes(unit, value):
                _add(boxes, f"optim/{entry_key}/{name}", size, offsets, view)
        elif on_device:
            value = torch.empty(tuple(entry.size), dtype=torch.float32, device=unit.weights.device)
            _add(boxes, key, tuple(entry.size), (0,) * len(entry.size), value)
        else:
            value = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            _add(boxes, key, tuple(entry.size), (0,) * len(entry.size), value)
        state[name] = value
    return state


def _view_states_to_read(engine, unit, stored, boxes: Boxes) -> dict:
    """For an optimizer stepping on per-parameter views: the tensors each view's state is read into,
    whole, by view. A checkpoint holding optimizer states, but none for a parameter here (saved with
    other experts on this rank), fails."""
    states = {}
    anything = any(key.startswith("optim/") for key in stored)
    for info, view in engine.optimizer.views.of(unit):
        prefix = f"optim/{_view_key(info)}/"
        state = {}
        for key in (k for k in stored if k.startswith(prefix)):
            entry = stored[key]
            size = tuple(entry.size)
            value = torch.empty(size, dtype=entry.properties.dtype,
                                device="cpu" if not size else unit.weights.device)  # counters on the host
            _add(boxes, key, size, (0,) * len(size), value)
            state[key[len(prefix):]] = value
        if anything and not state:
            raise CheckpointError(f"checkpoint holds no optimizer state for {_view_key(info)}: an "
                               "optimizer that steps on whole parameters (Adafactor, Muon) resumes from its own "
                               "states at the expert-parallel layout it saved at; load with "
                               "load_optimizer_states=False to start its state afresh")
        states[id(view)] = (view, state)
    return states


def _agreed(problem: str | None, world_size: int) -> None:
    """Raise `problem` (a rank's own finding) on every rank, the first rank's that has one (collective)."""
    problems = [problem]
    if _distributed():
        problems = [None] * world_size
        dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise CheckpointError(found)


def load(engine, load_dir: str, tag: str | None, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    """Load a checkpoint into `engine` whatever layout wrote it (collective); returns (path, client_state).

    load_module_only: only the model (its master weights and buffers), as DeepSpeed's warm start: the
    optimizer, schedule, loss scale, step counters and random states stay as they are."""
    if load_module_only:
        load_optimizer_states = load_lr_scheduler_states = False
    path = _checked_path(engine, load_dir, tag)
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}, this version reads {_FORMAT}")
    dcp, planners = _dcp()
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    mismatch = _model_mismatch(engine, metadata.state_dict_metadata, path)
    if mismatch is not None:  # every rank raises it, before anything is read or overwritten
        raise CheckpointError(mismatch)
    problem = None
    try:
        boxes, states = _boxes_to_read(engine, metadata.state_dict_metadata, load_optimizer_states,
                                       meta.get("per_element_states"))
    except CheckpointError as error:  # a rank's own finding: every rank raises it, before anything is read
        problem = str(error)
    _agreed(problem, engine.world_size)
    with _single_process_quiet():
        dcp.load(boxes, storage_reader=reader, planner=planners.BoxLoadPlanner(), no_dist=not _distributed())
    for index, unit in enumerate(engine.units):
        unit.write_back()  # the model's copy of the master just read (all-gathered in stages 1-2)
        if load_optimizer_states and engine.optimizer.views is not None:
            for view, state in states[index].values():
                if state:
                    engine.optimizer.state[view] = state
        elif load_optimizer_states and states[index]:
            engine.optimizer.state[unit.proxy] = states[index]
    # the saving rank's extra state, e.g. its product choices: a resumed run multiplies as the straight run did
    for name, (_, put) in _EXTRA_STATE.items():
        if meta.get(name):
            put(meta[name][engine.rank % len(meta[name])])
    engine.zero_grad()
    if load_module_only:
        return path, meta["client_state"]
    engine.global_steps, engine.micro_steps = meta["global_steps"], meta["micro_steps"]
    engine.skipped_steps = meta["skipped_steps"]
    if engine.scaler is not None and meta["scaler"] is not None:
        engine.scaler.load_state_dict(meta["scaler"])
    if load_optimizer_states and len(meta["param_groups"]) == len(engine.optimizer.param_groups):
        for group, saved in zip(engine.optimizer.param_groups, meta["param_groups"]):
            group.update({k: v for k, v in saved.items() if k not in ("name", "moe")})
    if load_lr_scheduler_states and engine.lr_scheduler is not None and meta["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(meta["lr_scheduler"])
    rng = meta["rng"][engine.rank % len(meta["rng"])]
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and accelerator_name() == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    return path, meta["client_state"]


def consolidated_state_dict(engine) -> dict | None:
    """The full model state_dict on rank 0 (None elsewhere), as a one-process model names it (collective)."""
    view = _global_view(engine, with_optimizer=False)
    gathered = [None] * engine.world_size if engine.rank == 0 else None
    if _distributed():
        dist.gather_object(view, gathered, dst=0)
    else:
        gathered = [view]
    if engine.rank != 0:
        return None
    entries = {k: v for part in gathered for k, v in part.items()}
    out = {}
    for unit in engine.units:
        for info in unit.infos:
            if info.expert and info.axis is not None:
                prefix = f"model/{info.global_name}#expert"
                ids = sorted(int(k[len(prefix):]) for k in entries if k.startswith(prefix))
                value = torch.stack([entries[f"{prefix}{g}"] for g in ids], info.axis)
            else:
                value = entries[f"model/{info.global_name}"]
            out[info.global_name] = value
    for key, value in entries.items():
        if key.startswith("buffer/"):
            out[key[7:]] = value
        elif key.startswith("model/") and "#expert" not in key and key[6:] not in out:
            out[key[6:]] = value  # experts kept as per-expert modules on other ranks, by their global names
    return out


def check_load_options(load_module_strict: bool, custom_load_fn) -> None:
    """Refuse the options of DeepSpeed's load_checkpoint that this format cannot honour.

    Raises:
        ValueError: load_module_strict=False or a custom_load_fn.
    """
    if load_module_strict is not True:
        raise ValueError(f"load_module_strict must be True, got {load_module_strict!r}; load a partial model "
                         "with engine.module.load_state_dict(..., strict=False)")
    if custom_load_fn is not None:
        raise ValueError("custom_load_fn is not supported: checkpoints are read through "
                         "torch.distributed.checkpoint; pass custom_load_fn=None")


def save_state_dict(state: dict | None, dtype: torch.dtype, save_dir: str, save_filename: str, world_size: int) -> None:
    """Write rank 0's full state dict (`state`; None on the other ranks), floating entries cast to `dtype`,
    to save_dir/save_filename atomically (a temporary name, then a rename); every rank returns once the
    file is there (collective)."""
    if state is not None:
        state = {name: value.to(dtype) if value.is_floating_point() else value for name, value in state.items()}
        os.makedirs(save_dir, exist_ok=True)
        path = os.path.join(save_dir, save_filename)
        temporary = f"{path}.tmp{os.getpid()}"
        torch.save(state, temporary)
        os.replace(temporary, path)
    if world_size > 1:
        dist.barrier()
