"""The run store: the only thing diff, gate, show, trace and report ever read.

Layout (one run = one directory, docs/design.md, "The run store"):

    runs/<manifest-id[:12]>/<path>[-<n>]/
      manifest.lock.json     canonical manifest + resolved hashes (written first)
      run.json               which path this is, the fault spec, where it resumed from
      env.json  topology.json
      trajectory/rank-00000.arrows       Arrow IPC stream, one record batch per step (store/trajectory.py)
      trajectory/rank-00000.steps.jsonl  per step: byte offset, length, record count, digest of digests
      collectives/rank-00000.frames  memory/rank-00000.jsonl
      steps/rank-00000.jsonl  per step: wall time (kept also when record.enabled = false)
      events.jsonl           fault fired, checkpoint saved, crash, resume
      checkpoints/step-000004/  DCP files + INDEX.json
      COMPLETE               written last; without it the run is incomplete

This module imports no torch: a run written on a cluster can be read on a laptop.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path

from disttrace.errors import BadInput
from disttrace.store import collframes, safeio
from disttrace.store.documents import (
    CollectiveLine,
    MemoryLine,
    RunInfo,
    StepTimes,
    StoredLock,
    Topology,
    parse_doc,
)
from disttrace.store.events import EventLine, FaultEvent, parse_event
from disttrace.store.jsonlines import JsonlRead, iter_jsonl, read_json, read_jsonl
from disttrace.store.manifest import StoredManifest
from disttrace.store.records import ATTACHED_SOURCES, INT64_END, StepIndexEntry

LOCK = "manifest.lock.json"
# the most ranks a store is read for: 2^20, far above any job's, small enough for a per-rank list
MAX_WORLD = 1 << 20
COMPLETE = "COMPLETE"
RUN_INFO = "run.json"


def rank_file(kind: str, rank: int, suffix: str = ".jsonl") -> str:
    return f"{kind}/rank-{rank:05d}{suffix}"


def read_run_info(run_dir: Path | str) -> RunInfo:
    """run.json of a run directory this job prepared or runs in, validated (BadInput naming the field)."""
    p = Path(run_dir) / RUN_INFO
    return parse_doc(RunInfo, read_json(p), p)


_INDEX_INTS = (
    "step",
    "offset",
    "length",
    "records",
)  # StepIndexEntry's StrictInt fields, each >= 0
_INDEX_TEXT = ("digest", "sha256", "xxh3", "chain")  # its optional strings
_TIME_NUMBERS = (
    "start",
    "collective_issue",
    "end",
)  # StepTimes' optional numbers (StrictInt | StrictFloat)


def _plain_index_line(e: dict) -> bool:
    """True for a step-index line both models accept as the writer writes it (exact types: a bool is no int);
    False for anything else, which the models then judge. Never True for a line they would refuse."""
    for k in _INDEX_INTS:
        v = e.get(k)
        if type(v) is not int or not 0 <= v < INT64_END:
            return False
    for k in _INDEX_TEXT:
        v = e.get(k)
        if v is not None and type(v) is not str:
            return False
    v = e.get("sketch")  # the sketch's version: an int when present
    if v is not None and type(v) is not int:
        return False
    if "time" not in e:
        return True
    t = e["time"]
    if type(t) is not dict:
        return False
    for k in _TIME_NUMBERS:
        v = t.get(k)
        if v is not None and type(v) is not float and type(v) is not int:
            return False
    v = t.get("spans")
    return v is None or type(v) is list or type(v) is dict


def _types(lines: list[dict], key: str) -> set:
    return set(map(type, [e.get(key) for e in lines]))


def _plain_index_lines(lines: list[dict]) -> bool:
    """_plain_index_line of every line, a field at a time over all of them (the same tests, in C loops: ~1 us
    a line instead of ~20 dict lookups and type tests). False where any line is not plain: each is then
    judged on its own."""
    for k in _INDEX_INTS:
        col = [e.get(k) for e in lines]
        if set(map(type, col)) - {int} or (col and (min(col) < 0 or max(col) >= INT64_END)):
            return False
    if any(_types(lines, k) - {str, type(None)} for k in _INDEX_TEXT):
        return False
    if _types(lines, "sketch") - {int, type(None)}:
        return False
    times = [e["time"] for e in lines if "time" in e]
    if set(map(type, times)) - {dict}:
        return False
    if any(_types(times, k) - {float, int, type(None)} for k in _TIME_NUMBERS):
        return False
    return not _types(times, "spans") - {type(None), list, dict}


# the manifest sections and fields readers rely on, with their types (a lock is data from disk: check it)
LOCK_SHAPE = {
    "experiment": {"name": str, "edition": str},
    "parallelism": {"dp": int, "tp": int, "pp": int, "zero_stage": int},
    "training": {"micro_batch_size": int, "grad_accum_steps": int, "steps": int},
    "record": {"every": int},
}


def _check_shape(path: Path, manifest: dict, shape: dict) -> None:
    for section, fields in shape.items():
        sec = manifest.get(section)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise BadInput(path, "must be an object", field=f"manifest.{section}")
        for key, typ in fields.items():
            v = sec.get(key)
            if key in sec and (not isinstance(v, typ) or isinstance(v, bool)):
                raise BadInput(path, f"must be {typ.__name__}", field=f"manifest.{section}.{key}")


def _check_topology(path: Path, topo: Topology, world: int, wrote: list[int]) -> None:
    """The topology against the lock's world size and the ranks whose trajectories are in the store: the
    document's own checks (store/documents.py) only hold it to itself."""
    if topo.world_size is not None and topo.world_size != world:
        raise BadInput(
            path, f"{topo.world_size}, but the lock's dp*tp*pp is {world} ranks", field="world_size"
        )
    if math.prod(topo.mesh_shape.values()) != world:
        raise BadInput(
            path,
            f"sizes {dict(topo.mesh_shape)} whose product is not the lock's {world} ranks",
            field="mesh_shape",
        )
    listed = sorted(r.rank for r in topo.ranks)
    if listed != list(range(world)):
        raise BadInput(
            path, f"ranks {listed}, not every rank 0..{world - 1} exactly once", field="ranks"
        )
    missing = sorted(set(wrote) - set(listed))
    if missing:
        raise BadInput(
            path, f"no place for rank(s) {missing}, whose trajectories are stored", field="ranks"
        )


class Run:
    """Read-only view of one run directory."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if not self.path.exists():
            raise BadInput(self.path, "no such run directory")
        if not self.path.is_dir():
            raise BadInput(self.path, "not a directory")
        if not safeio.present(self.path / LOCK):
            raise BadInput(self.path, f"not a run directory (no {LOCK})")
        self.lock = read_json(self.path / LOCK, self.path)  # as stored: what identity is taken over
        if not isinstance(self.lock, dict):
            raise BadInput(self.path / LOCK, "must be a JSON object", field="manifest")
        self.lock_info = parse_doc(StoredLock, self.lock, self.path / LOCK)
        _check_shape(self.path / LOCK, self.lock_info.manifest, LOCK_SHAPE)
        self._manifest: StoredManifest | None = None
        self._info: RunInfo | None = None
        self._step_batch: dict[int, tuple[tuple[int, int], object]] = {}  # rank -> (range, batch)

    # -- identity
    @property
    def manifest_doc(self) -> dict:
        """The manifest as stored: what identity is taken over (the id, field-by-field comparisons)."""
        return self.lock_info.manifest

    @property
    def manifest(self) -> StoredManifest:
        """The manifest's fields readers use, typed (store/manifest.py); checked once, when first read."""
        if self._manifest is None:
            from pydantic import ValidationError

            try:
                self._manifest = StoredManifest.model_validate(self.manifest_doc)
            except ValidationError as e:
                err = e.errors()[0]
                field = ".".join(["manifest", *map(str, err["loc"])])
                raise BadInput(self.path / LOCK, err["msg"].lower(), field=field) from None
        return self._manifest

    @property
    def manifest_id(self) -> str:
        return self.lock_info.manifest_id

    @property
    def run_info(self) -> RunInfo:
        """run.json validated by the model its writers build it with (an empty one when the run has
        none); checked once, when first read."""
        if self._info is None:
            p = self.path / RUN_INFO
            if not safeio.present(p):
                self._info = RunInfo()
            else:
                info = read_json(p, self.path)
                if not isinstance(info, dict):
                    raise BadInput(p, "must be a JSON object")
                self._info = parse_doc(RunInfo, info, p)
        return self._info

    @property
    def info(self) -> dict:
        """run.json as stored (validated as `run_info`), for a document that echoes it."""
        return self.run_info.as_read() if self.run_info._read is not None else {}

    @property
    def complete(self) -> bool:
        p = self.path / COMPLETE
        if not safeio.present(p):
            return False
        if not safeio.is_regular(
            p, self.path
        ):  # a FIFO or a link out in its place: not a run's marker
            raise BadInput(p, "not a regular file inside the run (COMPLETE is one the job writes)")
        return True

    @property
    def attached(self) -> bool:
        """Written by a user's own script through disttrace.api, not by disttrace's own trainer."""
        return self.lock_info.source in ATTACHED_SOURCES

    @property
    def world_size(self) -> int:
        """dp x tp x pp of the lock's manifest. Readers build per-rank lists from it, so a lock claiming more
        ranks than any job has (a store's writer chooses every byte) is bad input, not a list of 10^11."""
        par = self.manifest_doc.get("parallelism", {})
        par = par if isinstance(par, dict) else {}
        sizes = [par.get(k, 1) for k in ("dp", "tp", "pp")]
        if not all(type(n) is int and n >= 1 for n in sizes):
            raise BadInput(
                self.path / LOCK, "dp, tp and pp must be positive integers", "parallelism"
            )
        world = sizes[0] * sizes[1] * sizes[2]
        if world > MAX_WORLD:
            raise BadInput(
                self.path / LOCK,
                f"dp*tp*pp = {world} ranks, more than a run store is read for ({MAX_WORLD})",
                "parallelism",
            )
        return world

    def ranks(self, kind: str = "trajectory") -> list[int]:
        d = self.path / kind
        out = []
        if d.is_dir():
            for p in d.iterdir():
                m = re.fullmatch(
                    r"rank-(\d{5})\.(?:jsonl|arrows)"
                    if kind == "trajectory"
                    else r"rank-(\d{5})\.(?:jsonl|frames)"
                    if kind == "collectives"
                    else r"rank-(\d{5})\.jsonl",
                    p.name,
                )
                if m:
                    if (
                        p.is_symlink()
                    ):  # a rank file names its content by its place: it stays in the run
                        from disttrace.store.paths import contained

                        contained(p, self.path, p)
                    out.append(int(m.group(1)))
        return sorted(set(out))

    def rank_path(self, kind: str, rank: int, suffix: str = ".jsonl") -> Path:
        return self.path / rank_file(kind, rank, suffix)

    def collectives_path(self, rank: int) -> Path:
        """The rank's collective trace: its frames where it has them, else its JSON lines."""
        p = self.rank_path("collectives", rank, collframes.SUFFIX)
        return p if safeio.present(p) else self.rank_path("collectives", rank)

    def event_lines(self) -> list[EventLine]:
        """events.jsonl, each line validated by its kind's model, the one its writer built it with."""
        p = self.path / "events.jsonl"
        if not safeio.present(p):
            return []
        return [parse_event(e, p, n) for n, e in enumerate(read_jsonl(p, self.path).records, 1)]

    def events(self) -> JsonlRead:
        """events.jsonl as stored (each line validated as `event_lines` does), for documents that echo it."""
        p = self.path / "events.jsonl"
        if not safeio.present(p):
            return JsonlRead([], None)
        read = read_jsonl(p, self.path)
        for n, e in enumerate(read.records, 1):
            parse_event(e, p, n)
        return read

    def fault_events(self) -> list[FaultEvent]:
        """The `fault_fired` lines of events.jsonl, each validated by the writer's own model."""
        return [e for e in self.event_lines() if isinstance(e, FaultEvent)]

    def topology(self) -> Topology | None:
        """topology.json (`as_read()`: the document as written); None when the run wrote none. Held to the
        rest of the store, as the other files are: its mesh must hold the lock's world and list every rank
        that wrote a trajectory (a mesh edited to `{}` would otherwise be drawn as the run's layout)."""
        p = self.path / "topology.json"
        if not safeio.present(p):
            return None
        topo = parse_doc(Topology, read_json(p, self.path), p)
        _check_topology(p, topo, self.world_size, self.ranks())
        return topo

    def step_index(self, rank: int) -> JsonlRead:
        """The rank's step index: `records` are StepIndexEntry lines (the writer's own model)."""
        p = self.rank_path("trajectory", rank, ".steps.jsonl")
        if not safeio.present(p):
            return JsonlRead([], None)
        read = read_jsonl(p, self.path)
        entries = []
        for n, e in enumerate(read.records, 1):
            entries.append(StepIndexEntry.parse_line(e, p, n))
            StepTimes.parse_line(e.get("time") or {}, p, n)
        return JsonlRead(entries, read.torn)

    def step_index_lines(self, rank: int) -> JsonlRead:
        """`step_index` as the lines the file holds (dicts, every key in the file's order: what
        `StepIndexEntry.as_read` gives), for a reader of many lines (diff). Every line is held to the same
        models: a line of the writer's shape is checked by `_plain_index_line` (a few type tests, no model
        built), any other goes through StepIndexEntry and StepTimes, so what is refused, and the message that
        refuses it, are `step_index`'s."""
        p = self.rank_path("trajectory", rank, ".steps.jsonl")
        if not safeio.present(p):
            return JsonlRead([], None)
        read = read_jsonl(p, self.path)
        if _plain_index_lines(read.records):
            return read
        for n, e in enumerate(read.records, 1):
            if not _plain_index_line(e):
                StepIndexEntry.parse_line(e, p, n)
                StepTimes.parse_line(e.get("time") or {}, p, n)
        return read

    def sketch_versions(self) -> set[int]:
        """The versions of the sketches its ranks' step indexes state (trajectory.SKETCH_VERSION; a line
        without one: 1, written before the version was)."""
        return {e.sketch or 1 for rank in self.ranks() for e in self.step_index(rank).records}

    def step_times(self, rank: int) -> JsonlRead:
        """`steps/rank-N.jsonl` (run/job/stepclock.py): one line per step, kept whether the run records or not."""
        p = self.rank_path("steps", rank)
        if not safeio.present(p):
            return JsonlRead([], None)
        read = read_jsonl(p, self.path)
        for n, e in enumerate(read.records, 1):
            if (
                not isinstance(e.get("step"), int)
                or isinstance(e.get("step"), bool)
                or e["step"] < 0
            ):
                raise BadInput(p, f"line {n}: 'step' must be a non-negative integer", field="step")
            sec = e.get("seconds")
            if not isinstance(sec, (int, float)) or isinstance(sec, bool) or not sec >= 0:
                raise BadInput(p, f"line {n}: 'seconds' must be a number >= 0", field="seconds")
        return read

    def collectives(self, rank: int, torn: list | None = None) -> Iterator[CollectiveLine]:
        """The rank's collective trace, each line validated (CollectiveLine): the Flight Recorder's frames
        (`collectives/rank-N.frames`, store/collframes.py), or the JSON lines of the dispatch-mode tracer
        and of a store written before the frames (`rank-N.jsonl`)."""
        p = self.collectives_path(rank)
        lines = (
            collframes.records(p, torn, self.path)
            if p.name.endswith(collframes.SUFFIX)
            else iter_jsonl(p, torn, self.path)
        )
        for n, rec in enumerate(lines, 1):
            yield CollectiveLine.parse_line(rec, p, n)

    def memory(self, rank: int, torn: list | None = None) -> Iterator[MemoryLine]:
        """`memory/rank-N.jsonl`, each line validated as a MemoryLine (its `as_read()` the line as stored)."""
        p = self.rank_path("memory", rank)
        for n, rec in enumerate(iter_jsonl(p, torn, self.path), 1):
            yield MemoryLine.parse_line(rec, p, n)

    def trajectory_path(self, rank: int) -> Path:
        """The rank's trajectory file: the Arrow stream, or the JSON lines of a store written before it."""
        from disttrace.store.trajectory_read import trajectory_path

        return trajectory_path(self.path, rank)

    def records(self, rank: int, torn: list | None = None) -> Iterator[dict]:
        """Every trajectory record of the rank, step by step (a torn last step reported through `torn`)."""
        from disttrace.store import trajectory_read

        path = self.trajectory_path(rank)
        if not trajectory_read.is_arrow(path):
            from disttrace.store.records import JsonRecord

            for n, rec in enumerate(iter_jsonl(path, torn, self.path), 1):
                JsonRecord.parse_line(rec, path, n)
                yield rec
            return
        for _, _, batch in trajectory_read.scan(path, torn, self.path):
            yield from trajectory_read.to_records(batch)

    def checked_step_records(self, rank: int, step: int) -> list[dict]:
        """One step's records of one rank, from the bytes its step index names, checked against the index's
        hash (the same bytes diff judged); [] when the rank has no such step."""
        from disttrace.store import seal, trajectory_decode, trajectory_read

        for e in self.step_index(rank).records:
            if e.step == step:
                path = self.trajectory_path(rank)
                data = trajectory_read.read_range(path, e.offset, e.length)
                if seal.step_data_match_hashes(data, e.length, e.xxh3, e.sha256) is False:
                    raise BadInput(
                        path, f"step {step}: the bytes differ from the hash in the step index"
                    )
                if not trajectory_read.is_arrow(path):
                    return self.records_of_step(rank, e)
                return trajectory_read.to_records(
                    trajectory_decode.decode_step(path, data, f"step {step}")
                )
        return []

    def records_of_step(
        self, rank: int, entry: StepIndexEntry, phases: tuple[str, ...] | None = None
    ) -> list[dict]:
        """Read only the byte range of one step (from the step index): diff seeks, never scans; with
        `phases`, only those phases' records."""
        return self.records_of_range(rank, entry.offset, entry.length, entry.step, phases)

    def step_batch(self, rank: int, entry: StepIndexEntry):
        """One step's records as an Arrow batch, read by its byte range (None for a JSON-lines store); the
        last step read of each rank is kept, as the readers of a run's first step (the bound's inputs, the
        optimizer state's parameters) ask for the same one."""
        from disttrace.store import trajectory_decode, trajectory_read

        path = self.trajectory_path(rank)
        if not trajectory_read.is_arrow(path):
            return None
        span = (entry.offset, entry.length)
        kept = self._step_batch.get(rank)
        if kept is not None and kept[0] == span:
            return kept[1]
        data = trajectory_read.read_range(path, entry.offset, entry.length, self.path)
        where = f"step {entry.step} (bytes {entry.offset}..{entry.offset + entry.length})"
        batch = trajectory_decode.decode_step(path, data, where)
        self._step_batch[rank] = (span, batch)
        return batch

    def records_of_range(
        self,
        rank: int,
        offset: int,
        length: int,
        step: int | None = None,
        phases: tuple[str, ...] | None = None,
    ) -> list[dict]:
        """The records in bytes offset..offset+length of the rank's trajectory (one step's, if `step`)."""
        from disttrace.store.trajectory_read import records_of_range

        return records_of_range(
            self.trajectory_path(rank), offset, length, step, root=self.path, phases=phases
        )

    def checkpoint_dirs(self) -> list[Path]:
        d = self.path / "checkpoints"
        if not d.is_dir():
            return []
        return sorted(p for p in d.iterdir() if p.is_dir() and re.fullmatch(r"step-\d{6}", p.name))

    def verdict(self):
        """verdict.json as the gate's own model (store/documents.py's `Verdict`), None when the gate never
        wrote one; a malformed one is BadInput naming the field."""
        from disttrace.store.documents import Verdict

        p = self.path / "verdict.json"
        return Verdict.parse_line(read_json(p, self.path), p, 1) if safeio.present(p) else None

    def partial_checkpoints(self) -> list[str]:
        """Names of checkpoint writes that never finished (`step-N.partial`, never published)."""
        d = self.path / "checkpoints"
        return sorted(p.name for p in d.glob("*.partial")) if d.is_dir() else []

    def losses(self) -> dict[int, float]:
        """Mean training loss per step (over micro-batches and data-parallel ranks), from loss records."""
        acc: dict[int, list[float]] = {}
        for rank in self.ranks():
            for rec in self.records(rank, torn=[]):
                if (
                    rec.get("phase") == "loss"
                    and rec.get("tensor") == "loss"
                    and isinstance(rec.get("step"), int)
                ):
                    value = (
                        rec["sum"] if rec.get("sum") is not None else float("nan")
                    )  # a non-finite loss
                    acc.setdefault(rec["step"], []).append(value)
        return {s: sum(v) / len(v) for s, v in sorted(acc.items())}
