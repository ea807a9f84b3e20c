"""The one-process model state dict from a checkpoint, without a process group (like DeepSpeed's
zero_to_fp32.py), for users who take a trained model elsewhere.

    python -m optim.consolidate CKPT OUT.pt           # CKPT: a checkpoint folder, or the folder holding `latest`
    python -m optim.consolidate CKPT OUT.safetensors  # when safetensors is installed

The checkpoint is verified against its manifest first. Entries are read one parameter at a time
(a stacked expert parameter is one entry per global expert, joined as the one-process model holds
it); the output holds every parameter in fp32 (the master weights where the run had them) and every
buffer as saved, under the names a one-process model with every expert uses: what
`engine.consolidated_state_dict()` returns.
"""

import argparse
import os
import re
import sys

import torch
import torch.distributed.checkpoint as dcp

from optim import checkpoint

__all__ = ["consolidate", "main"]

_EXPERT = re.compile(r"^(?P<name>.+)#expert(?P<id>\d+)$")


def consolidate(path: str) -> dict[str, torch.Tensor]:
    """The one-process state dict of the checkpoint folder `path` (or of `latest` under it).

    Raises:
        FileNotFoundError: no checkpoint there. RuntimeError: incomplete, corrupt, or of another format.
    """
    if not os.path.isfile(os.path.join(path, "manifest.json")) and os.path.isfile(os.path.join(path, "latest")):
        path = checkpoint._resolve(path, None)
    elif not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    checkpoint.verify(path)
    meta = torch.load(os.path.join(path, "meta.pt"), weights_only=True)
    axes = meta.get("expert_axes")
    reader = dcp.FileSystemReader(path)
    stored = reader.read_metadata().state_dict_metadata
    experts: dict[str, dict[int, str]] = {}
    order = {}  # output names, in the order of the stored entries
    for key in stored:
        if key.startswith("model/"):
            match = _EXPERT.match(key[6:])
            name = match["name"] if match else key[6:]
            if match:
                experts.setdefault(name, {})[int(match["id"])] = key
            order[name] = None
        elif key.startswith("buffer/"):
            order[key] = None
    if experts and axes is None:
        raise RuntimeError(f"checkpoint {path} does not record how its stacked experts join (saved by an older "
                           "version): load it into an engine and call engine.consolidated_state_dict() instead")
    out = {}
    for name in order:
        if name.startswith("buffer/"):
            out[name[7:]] = _read(reader, stored, [name])[0]
        elif name in experts:
            ids = sorted(experts[name])
            if ids != list(range(len(ids))):
                raise RuntimeError(f"checkpoint {path} holds experts {ids} of {name}, not 0..{len(ids) - 1}")
            out[name] = torch.stack(_read(reader, stored, [experts[name][g] for g in ids]), axes[name])
        else:
            out[name] = _read(reader, stored, [f"model/{name}"])[0]
    return out


def _read(reader, stored, keys: list[str]) -> list[torch.Tensor]:
    targets = {key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype, device="cpu")
               for key in keys}
    with checkpoint._single_process_quiet():
        dcp.load(targets, storage_reader=reader, no_dist=True)
    return [targets[key] for key in keys]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="optim.consolidate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder, or a checkpoint directory with a `latest` file")
    parser.add_argument("output", help="the file to write: .pt (torch.save) or .safetensors")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    safetensors = args.output.endswith(".safetensors")
    if safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            parser.exit(2, "optim.consolidate: error: writing .safetensors needs the safetensors package; "
                           "pip install safetensors, or name a .pt file\n")
    elif not args.output.endswith(".pt"):
        parser.exit(2, f"optim.consolidate: error: the output must end in .pt or .safetensors, got {args.output!r}\n")
    try:
        state = consolidate(args.checkpoint)
    except (FileNotFoundError, RuntimeError) as error:
        parser.exit(2, f"optim.consolidate: error: {error}\n")
    temporary = f"{args.output}.partial"
    if safetensors:
        save_file({k: v.contiguous() for k, v in state.items()}, temporary)
    else:
        torch.save(state, temporary)
    os.replace(temporary, args.output)
    print(f"wrote {len(state)} tensors ({sum(t.numel() for t in state.values()):,} elements) to {args.output}")


if __name__ == "__main__":
    main()
