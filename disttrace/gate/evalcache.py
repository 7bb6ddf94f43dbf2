"""Which held-out evaluations the gate may reuse instead of scoring again (a fresh process, ~5 s).

A run store is written by someone else (docs/design.md, "Trust"): its `eval.json` is the gate's record of
what it scored, never evidence the gate reads back. Anything in the store can be forged, hashes and seal
included, so reuse is keyed on what the evaluation read and kept where the store's writer does not
write: a cache in the user's own cache directory, keyed by the sha256 of
  the lock (manifest and resolved data paths), the final checkpoint's INDEX after every file verified
  against it, the data and tokenizer bytes, the evaluating code (every disttrace source file) and torch's
  version.
A hit is therefore the gate's own evaluation of these same bytes; a forged `eval.json` is never read.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from pathlib import Path

import orjson

from disttrace.store import checkpoints as checkpoint
from disttrace.store.rundir import Run
from disttrace.store.writers import write_json_atomic

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """`DISTTRACE_CACHE_DIR`, else `$XDG_CACHE_HOME/disttrace`, else `~/.cache/disttrace`; `eval/` inside."""
    root = (
        os.environ.get("DISTTRACE_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "disttrace"
    )
    return Path(root) / "eval"


def _code_digest() -> str:
    """Every source file of the package: a change to the model, the data split or the scorer is a new key."""
    h = hashlib.sha256()
    for p in sorted(PACKAGE_ROOT.rglob("*.py")):
        h.update(str(p.relative_to(PACKAGE_ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    try:
        h.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:
        pass
    return h.hexdigest()


def evaluation_key(run: Run, ckpt: Path, data_from: Run | None = None) -> str:
    """The sha256 naming one evaluation (of `run`'s checkpoint on `data_from`'s held-out split); raises
    BadInput (naming the file) when the checkpoint does not verify, as the evaluation itself would."""
    checkpoint.verify(ckpt, run.manifest_id)  # every file's bytes match the INDEX hashed below
    data_from = data_from or run
    resolved = data_from.lock_info.resolved or {}
    inputs = {
        "lock": hashlib.sha256(orjson.dumps(run.lock, option=orjson.OPT_SORT_KEYS)).hexdigest(),
        "data_lock": hashlib.sha256(
            orjson.dumps(data_from.lock, option=orjson.OPT_SORT_KEYS)
        ).hexdigest(),
        "checkpoint": ckpt.name,
        "index": checkpoint.sha256_of(ckpt / checkpoint.INDEX),
        "data": {
            k: checkpoint.sha256_of(Path(v))
            for k, v in sorted(resolved.items())
            if isinstance(v, str) and Path(v).is_file()
        },
        "code": _code_digest(),
    }
    return hashlib.sha256(orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS)).hexdigest()


def cached(key: str) -> dict | None:
    path = cache_dir() / f"{key}.json"
    try:
        result = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    return result if isinstance(result, dict) and result.get("evaluation_key") == key else None


def remember(key: str, result: dict) -> None:
    path = cache_dir() / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
