"""What a user's evaluation script needs (public as `disttrace.api.load_checkpoint`, `print_metric`,
`data_sha256`; templates in docs/gate.md): load the weights the gate hands it into a plain model, and print
the metric line the gate reads.

    import disttrace.api as dt
    model = MyModel()
    dt.load_checkpoint(sys.argv[1], model)      # a run.checkpoint() directory, an HF output dir, a .ckpt
    dt.print_metric(eval_loss=score(model, sys.argv[2]))

Nothing in a checkpoint runs: a disttrace checkpoint is verified against its INDEX and read through the
project's DCP loader (run/job/safeload.py: allowlisted metadata, weights_only items); safetensors files are
read as tensors; torch pickles (`pytorch_model.bin`, a Lightning `.ckpt`) load with weights_only=True.
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import torch

from disttrace.errors import BadInput
from disttrace.gate.usereval import data_sha256  # noqa: F401  (public: the value a policy fixes)

INDEX = "INDEX.json"


def load_checkpoint(path: str | Path, model: torch.nn.Module, strict: bool = True) -> dict:
    """Load the model weights at `path` into `model` (plain, unwrapped, on any device) in place. `path` is:
    a disttrace checkpoint directory (run.checkpoint(), or the HF/Lightning callbacks' final one), a Hugging
    Face Trainer output or checkpoint-N directory (model.safetensors or pytorch_model.bin, sharded or
    not), a Lightning `.ckpt` file, or one `.safetensors`/`.pt`/`.bin` file of a state dict. Returns what it
    loaded: {"format": ..., "path": ..., "step": ... when known}. BadInput naming the file otherwise."""
    path = Path(path)
    if path.is_dir() and (path / INDEX).is_file():
        return _load_dcp(path, model, strict)
    if path.is_dir():
        return _load_hf_dir(path, model, strict)
    if path.is_file():
        state = _read_state_file(path)
        if path.suffix == ".ckpt":  # Lightning: the module's weights under "state_dict"
            if not isinstance(state.get("state_dict"), dict):
                raise BadInput(
                    path, "not a Lightning checkpoint (no state_dict)", field="state_dict"
                )
            _into(model, state["state_dict"], path, strict)
            return {"format": "lightning", "path": str(path), "step": state.get("global_step")}
        _into(model, state, path, strict)
        return {"format": path.suffix.lstrip("."), "path": str(path)}
    raise BadInput(path, "no checkpoint here (a directory or a file was expected)")


def print_metric(**metrics) -> None:
    """Print the metrics as one JSON object on one line (the last line the gate reads) and flush."""
    clean = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            v = v.item()
        clean[k] = v
    sys.stdout.write(orjson.dumps(clean, option=orjson.OPT_SERIALIZE_NUMPY).decode() + "\n")
    sys.stdout.flush()


def _load_dcp(path: Path, model, strict: bool) -> dict:
    from disttrace.run.job import safeload
    from disttrace.store import checkpoints

    index = checkpoints.verify(path)  # every file's sha256 against the INDEX, every pickle scanned
    if "model" not in index.get("contents", ["model"]):
        raise BadInput(path / INDEX, "holds no model state", field="contents")
    state = {"model": model.state_dict()}
    safeload.load(state, path, no_dist=True)  # consolidates every rank's shards
    model.load_state_dict(state["model"], strict=strict)
    return {"format": "disttrace", "path": str(path), "step": index.get("step")}


def _load_hf_dir(path: Path, model, strict: bool) -> dict:
    """save_pretrained's files: one weights file or an index naming its shards."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            _into(model, _read_state_file(path / name), path / name, strict)
            return {"format": "huggingface", "path": str(path)}
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        idx = path / name
        if idx.is_file():
            try:
                weight_map = orjson.loads(idx.read_bytes())["weight_map"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                raise BadInput(idx, "not a shard index", field="weight_map") from None
            state = {}
            for shard in sorted(set(weight_map.values())):
                f = (path / shard).resolve()
                if f.parent != path.resolve():
                    raise BadInput(idx, f"shard {shard!r} is outside the directory")
                state.update(_read_state_file(f))
            _into(model, state, idx, strict)
            return {"format": "huggingface", "path": str(path)}
    raise BadInput(
        path, "neither a disttrace checkpoint (INDEX.json) nor a Hugging Face model directory"
    )


def _read_state_file(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # an unpickler refusal or a torn file: its first line
        raise BadInput(
            path, f"does not load weights-only ({str(e).splitlines()[0][:160]})"
        ) from None
    if not isinstance(state, dict):
        raise BadInput(path, "does not hold a state dict")
    return state


def _into(model, state: dict, where: Path, strict: bool) -> None:
    try:
        model.load_state_dict(state, strict=strict)
    except RuntimeError as e:
        raise BadInput(where, f"does not fit the model: {str(e).splitlines()[0][:200]}") from None
