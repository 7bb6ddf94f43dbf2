"""Recovery checkpoints: torch.distributed.checkpoint (DCP) files plus our INDEX.json.

DCP has no content hash of its own. INDEX.json gives every file's sha256 and size, the step, the manifest
id and the world size, so a flipped byte, a truncated or missing file, or a checkpoint of another
experiment is refused before anything is loaded.

Publication is atomic: all ranks write into `step-NNNNNN.partial`, rank 0 hashes the files and writes the
INDEX, then renames the directory to `step-NNNNNN`. A crash leaves a `.partial` directory that no reader
takes for a checkpoint.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from .errors import BadInput
from .store import read_json, write_json_atomic

INDEX = "INDEX.json"


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:06d}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def write_index(ckpt: Path, step: int, manifest_id: str, world_size: int, contents: list[str]) -> dict:
    files = {}
    for p in sorted(ckpt.iterdir()):
        if p.is_file() and p.name != INDEX:
            files[p.name] = {"sha256": sha256_of(p), "bytes": p.stat().st_size}
    index = {"format": "dcp", "step": step, "manifest_id": manifest_id, "world_size": world_size,
             "contents": contents, "files": files}
    write_json_atomic(ckpt / INDEX, index)
    return index


def verify(ckpt: Path | str, manifest_id: str | None = None) -> dict:
    """Read every byte; raise BadInput naming the first bad file. Returns the index."""
    ckpt = Path(ckpt)
    if not ckpt.is_dir():
        raise BadInput(ckpt, "checkpoint directory not found")
    index = read_json(ckpt / INDEX)
    if not isinstance(index, dict) or not isinstance(index.get("files"), dict):
        raise BadInput(ckpt / INDEX, "not a checkpoint index", field="files")
    if manifest_id is not None and index.get("manifest_id") != manifest_id:
        raise BadInput(ckpt / INDEX, f"written for manifest {str(index.get('manifest_id'))[:12]}, "
                       f"not {manifest_id[:12]}", field="manifest_id")
    if ".metadata" not in index["files"]:
        raise BadInput(ckpt / INDEX, "lists no DCP .metadata file", field="files")
    for name, meta in sorted(index["files"].items()):
        p = ckpt / name
        if not p.is_file():
            raise BadInput(p, "checkpoint file is missing")
        size = p.stat().st_size
        if size != meta.get("bytes"):
            raise BadInput(p, f"size {size} differs from the index's {meta.get('bytes')} (truncated or altered)")
        if sha256_of(p) != meta.get("sha256"):
            raise BadInput(p, "sha256 differs from the index (corrupted)")
    extra = sorted(p.name for p in ckpt.iterdir() if p.is_file() and p.name != INDEX and p.name not in index["files"])
    if extra:
        raise BadInput(ckpt / extra[0], "file not listed in the index")
    return index


def status(ckpt: Path, manifest_id: str | None = None) -> tuple[bool, str]:
    try:
        index = verify(ckpt, manifest_id)
        n = len(index["files"])
        size = sum(f["bytes"] for f in index["files"].values())
        return True, f"ok ({n} files, {size} bytes, contents: {', '.join(index.get('contents', []))})"
    except BadInput as e:
        return False, str(e)


# ---------------------------------------------------------------- in the job (torch from here on)


def save(strategy, run_dir: Path, step: int, manifest_id: str, world_size: int, rank: int, bus, extra: dict):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = step_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    state = bus.emit("before_checkpoint", state=strategy.state_dict(), step=step)["state"]
    # per-rank entries (RNG) get per-rank keys: DCP writes replicated keys once, these it must keep apart
    state[f"rng/rank-{rank:05d}"] = torch.get_rng_state()
    state["progress"] = {"step": step, **extra}
    if rank == 0:
        partial.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    dist.barrier()
    if rank == 0:
        contents = sorted(k for k in state if not k.startswith("rng/"))
        write_index(partial, step, manifest_id, world_size, contents)
        os.replace(partial, final)
    dist.barrier()
    bus.emit("checkpoint", path=final, step=step)
    return final


def load(strategy, ckpt: Path, rank: int, manifest_id: str) -> dict:
    """Load a verified checkpoint into the strategy; returns its progress dict."""
    import torch
    import torch.distributed.checkpoint as dcp

    index = verify(ckpt, manifest_id)
    with_optim = "optim" in index.get("contents", [])
    # a template with the checkpoint's structure; DCP fills it in place
    state = getattr(strategy, "empty_state", strategy.state_dict)(with_optim)
    state[f"rng/rank-{rank:05d}"] = torch.get_rng_state()
    state["progress"] = {"step": 0}
    dcp.load(state, checkpoint_id=str(ckpt))
    strategy.load_state_dict(state)
    torch.set_rng_state(state[f"rng/rank-{rank:05d}"])
    return {**state["progress"], "with_optimizer": with_optim}


def read_index(ckpt: Path) -> dict:
    return read_json(Path(ckpt) / INDEX)
