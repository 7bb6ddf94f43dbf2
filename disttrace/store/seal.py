"""The run store's content hashes: what `disttrace verify` and `diff` check (no torch here).

Two layers, both written while the run is produced:

* **The step chain.** Each line of `trajectory/rank-N.steps.jsonl` carries `sha256`, the hash of that step's
  raw trajectory bytes (its offset..offset+length), and `chain`, the hash of the previous line's `chain`
  and of this line's own fields (sorted-key JSON, `chain` left out). A removed, reordered or edited step, in
  the trajectory or in the index, breaks the chain from that step on.
* **The seal.** `COMPLETE` (written last, by global rank 0 after every rank has flushed) holds `seal`: the
  sha256 and size of every file the job wrote (lock, run.json, env, topology, replicas, every per-rank file
  `<dir>/rank-NNNNN.*`: trajectory, step index, collectives, memory, step times; every checkpoint's
  INDEX.json) and each rank's last chain hash. `events.jsonl` is sealed as the prefix written until then
  (`bytes`, and `sha256` of those bytes): lines appended later (after the job) are reported, not damage.
  Not sealed: what the gate writes afterwards (`eval.json`, `verdict.json`) and the launcher's lock files.

sha256 (hashlib) rather than the xxh3 of the tensor digests: the chain is meant to make an after-the-fact
edit show, and a step's bytes are a few KiB (docs/design.md, "Facts"). It guards against
accidents and edits, not against a writer who rewrites every hash and the seal: nothing signs COMPLETE.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import orjson
import xxhash

from disttrace.store import safeio
from disttrace.store.documents import ChainEnd, FileHash, Seal, SealPart

SEAL_VERSION = 1
SHARED_FILES = ("manifest.lock.json", "run.json", "env.json", "topology.json", "replicas.json")
EVENTS = "events.jsonl"


def step_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def step_fast_hash(data: bytes) -> str:
    """xxh3-128 of a step's bytes: what diff checks on every step it reads or skips (~25x sha256's speed, so
    a bitwise diff of a long run stays I/O-bound). The sha256 beside it is what `verify` checks; both sit
    in the index line the chain covers."""
    return xxhash.xxh3_128_hexdigest(data)


def genesis(rank: int) -> str:
    """The chain's start for one rank (a rank's index cannot pass for another rank's)."""
    return hashlib.sha256(f"disttrace-steps-v{SEAL_VERSION}:rank-{rank:05d}".encode()).hexdigest()


def chain_next(prev: str, entry: dict) -> str:
    body = entry
    if "chain" in entry:  # the line's own link is not part of what it links
        body = entry.copy()
        del body["chain"]
    return hashlib.sha256(
        prev.encode() + b"\n" + orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    ).hexdigest()


def file_hash(path: Path, limit: int | None = None, root: Path | None = None) -> FileHash:
    """sha256 and size of a file (of its first `limit` bytes, if given), streamed. A reader passes the run
    directory as `root` (store/safeio.py: a regular file inside it, or BadInput); the writer hashes its own."""
    h = hashlib.sha256()
    n = 0
    with safeio.open_file(path, root) as f:
        while True:
            want = 1 << 20 if limit is None else min(1 << 20, limit - n)
            if want <= 0:
                break
            block = f.read(want)
            if not block:
                break
            h.update(block)
            n += len(block)
    return FileHash(sha256=h.hexdigest(), bytes=n)


def rank_part(run_dir: Path | str, rank: int, chain: str | None, steps: int) -> SealPart:
    """One rank's share of the seal: its own files (each rank hashes what it wrote, so a multi-node run
    seals every node's files) and its chain's last hash."""
    run_dir = Path(run_dir)
    files = {}
    # every per-rank file, whatever its kind (trajectory, step index, collectives, memory, step times, ...)
    for p in sorted(run_dir.glob(f"*/rank-{rank:05d}.*")):
        if p.is_file() and not p.is_symlink():
            files[f"{p.parent.name}/{p.name}"] = file_hash(p)
    return SealPart(rank=rank, files=files, chain=chain, steps=steps)


def build_seal(run_dir: Path | str, parts: list[SealPart | dict | None]) -> Seal:
    """The seal COMPLETE holds: the shared files (hashed here, by rank 0), every rank's part (as gathered:
    JSON, validated here), the events so far and every published checkpoint's INDEX."""
    run_dir = Path(run_dir)
    files: dict[str, FileHash] = {}
    for name in SHARED_FILES:
        if (run_dir / name).is_file():
            files[name] = file_hash(run_dir / name)
    chains = {}
    ranked = [SealPart.model_validate(p) for p in parts if p]
    for part in sorted(ranked, key=lambda p: p.rank):
        files.update(part.files)
        chains[f"{part.rank:05d}"] = ChainEnd(chain=part.chain, steps=part.steps)
    ck = run_dir / "checkpoints"
    if ck.is_dir():
        for d in sorted(ck.iterdir()):
            if d.is_dir() and not d.name.endswith(".partial") and (d / "INDEX.json").is_file():
                files[f"checkpoints/{d.name}/INDEX.json"] = file_hash(d / "INDEX.json")
    # the events are a prefix: lines may be appended after the job
    events = {"events": file_hash(run_dir / EVENTS)} if (run_dir / EVENTS).is_file() else {}
    return Seal(
        version=SEAL_VERSION,
        hash="sha256",
        files=dict(sorted(files.items())),
        chains=chains,
        **events,
    )


class StepChain:
    """The recorder's side: hash a step's bytes, chain its index line to the previous one."""

    def __init__(self, rank: int):
        self.last = genesis(rank)
        self.steps = 0

    def seal_entry(self, entry: dict, data: bytes) -> dict:
        entry["sha256"] = step_hash(data)
        entry["xxh3"] = step_fast_hash(data)
        entry["chain"] = self.last = chain_next(self.last, entry)
        self.steps += 1
        return entry


def first_chain_break(rank: int, entries: list[dict]) -> int | None:
    """The step at which a rank's index entries stop chaining (None: intact, or written before chains)."""
    if not entries or any("chain" not in e for e in entries):
        return None
    prev = genesis(rank)
    for e in entries:
        if chain_next(prev, e) != e.get("chain"):
            return e.get("step")
        prev = e["chain"]
    return None


def step_data_match_hashes(data: bytes, length: int, xxh3, sha256) -> bool | None:
    """Whether a step's bytes hash to its index line's: its length, its xxh3 (the line's hex, or those 16
    bytes) and, in lines written before xxh3, its sha256; None: it holds neither hash."""
    if xxh3 is None and sha256 is None:
        return None
    if len(data) != length:
        return False
    if isinstance(xxh3, bytes):
        return xxhash.xxh3_128_digest(data) == xxh3
    return step_fast_hash(data) == xxh3 if xxh3 is not None else step_hash(data) == sha256
