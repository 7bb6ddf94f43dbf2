"""One run's trajectory as diff reads it: each rank's step index (the recorder's, or rebuilt by a scan), and
the steps' bytes, hash-checked against it, as raw ranges, records or Arrow batches (docs/design.md, "Trust")."""

from __future__ import annotations

import operator
import threading
from pathlib import Path

import numpy as np
import orjson

from disttrace.analysis.diff.stepentries import StepEntries
from disttrace.analysis.result import (
    SideSummary,
)
from disttrace.errors import BadInput
from disttrace.store import safeio, seal, trajectory_decode, trajectory_read
from disttrace.store.rundir import Run

_SPAN = 64 << 20  # the most bytes read in one range for a block of steps


class Side:
    """One run's trajectory as diff sees it: per rank, an index step -> {offset, length, records, digest}.

    With ``use_index`` the index is the recorder's ``rank-NNNNN.steps.jsonl``. Without it (or when a rank
    has none), the index is rebuilt by scanning the trajectory's lines for their step number, and carries
    no digests, so every step is read and compared record by record (the baseline the bench measures).
    ``only`` restricts what is read to those ranks (a partial diff, or one process of ``--jobs``); what the
    side says of the whole run (its ranks, the ranks its world lacks) still counts every rank's file.
    """

    def __init__(
        self,
        label: str,
        path: str | Path,
        use_index: bool,
        warnings: list[str],
        only: set[int] | None = None,
    ):
        self.label = label
        self.run = Run(path)
        self.path = self.run.path
        self.warnings = warnings
        info = self.run.info
        self.info = info if isinstance(info, dict) else {}
        self.kind = self.info.get("path")
        resume = self.info.get("resume") or {}
        self.resume_step = int(resume.get("step") or 0) if isinstance(resume, dict) else 0
        self.resume_checkpoint = resume.get("checkpoint") if isinstance(resume, dict) else None
        self.complete = self.run.complete
        self.all_ranks = self.run.ranks()
        self.ranks = [r for r in self.all_ranks if only is None or r in only]
        self.use_index = use_index
        self.hash_checked = 0  # step ranges whose bytes were checked against the index's sha256
        self.index: dict[int, StepEntries] = {}
        self.steps: list[int] = []
        self.records_read = 0  # trajectory records parsed (the `records_read` of the result)
        # per step: [records parsed, step ranges hash-checked], so results of different ranks combine exactly
        self.io: dict[int, list[int]] = {}
        self.rank_warnings: dict[int, list[str]] = {}  # what reading each rank's index said
        self._paths: dict[int, Path] = {}
        self._last_bytes: tuple[tuple[int, int], bytes] | None = None
        self._counting = threading.Lock()
        # the versions of its records' sketches (store.trajectory.SKETCH_VERSION; None: not known)
        self.sketch_versions: set[int | None] = set()

    def load(self) -> None:
        """Read (or rebuild) the step index of every rank; called after the compatibility check."""
        warnings = self.warnings
        for r in self.ranks:
            mark = len(warnings)
            entries = self._load_index(r, self.use_index)
            self.sketch_versions |= self._sketch_versions(r, entries)
            self.index[r] = StepEntries(entries)
            self.rank_warnings[r] = warnings[mark:]
        self.steps = common_steps(self.index[r] for r in self.ranks)
        warnings.extend(
            side_warnings(
                self.label,
                self.path,
                self.all_ranks,
                self.run.world_size,
                self.complete,
                self.steps,
            )
        )

    @property
    def manifest(self) -> dict:
        return self.run.manifest_doc

    def _count(self, step: int, records: int = 0, hashed: int = 0) -> None:
        with self._counting:  # a ReadAhead's thread counts what it reads too
            self._count_locked(step, records, hashed)

    def _count_locked(self, step: int, records: int, hashed: int) -> None:
        self.records_read += records
        self.hash_checked += hashed
        io = self.io.get(step)
        if io is None:
            io = self.io[step] = [0, 0]
        io[0] += records
        io[1] += hashed

    def _load_index(self, rank: int, use_index: bool) -> dict[int, dict]:
        traj = self.run.trajectory_path(rank)
        size = safeio.size(traj, self.run.path)  # a regular file inside the run, or BadInput
        if size and not trajectory_read.is_arrow(traj):
            with safeio.open_file(traj, self.run.path) as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self.warnings.append(
                        f"run {self.label}: {traj}: last line is torn (incomplete write), ignored"
                    )
        steps_path = self.run.rank_path("trajectory", rank, ".steps.jsonl")
        if use_index and safeio.present(steps_path):
            # the stored lines, validated: the same shape as the entries a scan rebuilds without an index
            read = self.run.step_index_lines(rank)
            lines = read.records
            if read.torn:
                self.warnings.append(f"run {self.label}: {read.torn}")
            broken = seal.first_chain_break(rank, lines)
            if (
                broken is not None
            ):  # an index edited after the run must never let a step be skipped as equal
                raise BadInput(
                    steps_path,
                    f"step {broken}: the step chain is broken (a step removed, reordered or "
                    "edited after the run; see `disttrace verify`)",
                )
            out = _plain_entries(lines, size)
            if out is None:
                out = self._entries(lines, size, rank, steps_path, traj)
            if trajectory_read.is_arrow(traj):
                tail = trajectory_read.unindexed_tail(
                    traj, max((e["offset"] + e["length"] for e in out.values()), default=0)
                )
                if tail:
                    self.warnings.append(
                        f"run {self.label}: {traj}: {tail} bytes after the last indexed step are "
                        "torn (incomplete write), ignored"
                    )
            return out
        if use_index:
            self.warnings.append(
                f"run {self.label}: rank {rank} has no step index; scanned {traj.name} instead"
            )
        if trajectory_read.is_arrow(traj):
            return self._scan_arrow(traj)
        return _scan_index(traj)

    def _entries(
        self, lines: list[dict], size: int, rank: int, steps_path, traj
    ) -> dict[int, dict]:
        """The index lines by step, line by line: one that lacks an integer field refused, one that points
        past the trajectory's end warned of and left out."""
        out: dict[int, dict] = {}
        for n, e in enumerate(lines, 1):
            for k in ("step", "offset", "length"):
                if not isinstance(e.get(k), int):
                    raise BadInput(steps_path, f"line {n} lacks an integer '{k}'", field=k)
            if e["offset"] + e["length"] > size:
                self.warnings.append(
                    f"run {self.label}: rank {rank} step {e['step']}: the index points past "
                    f"the end of {traj.name} (records not all written); step ignored"
                )
                continue
            out[e["step"]] = e
        return out

    def _scan_arrow(self, traj: Path) -> dict[int, dict]:
        """Rebuild a step index (without digests) from the stream's record batches, one per step."""
        out: dict[int, dict] = {}
        torn: list[str] = []
        for offset, length, batch in trajectory_read.scan(traj, torn):
            step = trajectory_read.step_of(batch)
            if step is None:
                continue
            if step in out:
                raise BadInput(
                    traj, f"bytes {offset}..{offset + length}: step {step} appears twice"
                )
            out[step] = {
                "step": step,
                "offset": offset,
                "length": length,
                "records": batch.num_rows,
                "digest": None,
            }
        self.warnings.extend(f"run {self.label}: {t}" for t in torn)
        return out

    def _sketch_versions(self, rank: int, entries: dict[int, dict]) -> set[int | None]:
        """The sketch versions the rank's step index states for the steps loaded (a line without one: 1, the
        version before it was written). A rank scanned without its index: read from the index if it is
        there, else 1 (a trajectory written before the index, JSON lines); an index that cannot be read: None."""
        if not entries:
            return set()
        steps_path = self.run.rank_path("trajectory", rank, ".steps.jsonl")
        if self.use_index and safeio.present(steps_path):
            return {e.get("sketch") or 1 for e in entries.values()}
        if not safeio.present(steps_path):
            return {1}
        try:
            lines = self.run.step_index_lines(rank).records
        except BadInput:
            return {None}
        return {e.get("sketch") or 1 for e in lines if e.get("step") in entries} or {1}

    def entry(self, rank: int, step: int) -> dict | None:
        """The rank's index entry of the step as a dict (StepEntries.line), None where it has none; what is read
        of it has its own accessor below, which builds none."""
        return self.index.get(rank, {}).get(step)

    def has(self, rank: int, step: int) -> bool:
        """The rank's index holds the step."""
        idx = self.index.get(rank)
        return idx is not None and step in idx

    def record_count(self, rank: int, step: int):
        """The step's record count as the rank's index states it (None: not stated, or no such step)."""
        idx = self.index.get(rank)
        return None if idx is None else idx.records(step)

    def same_digest(self, rank: int, step: int, other: Side) -> bool:
        """Both sides' index lines of the rank's step state the same digest of digests and record count."""
        mine, theirs = self.index.get(rank), other.index.get(rank)
        return mine is not None and theirs is not None and mine.same_digest(step, theirs)

    def step_bytes(self, rank: int, step: int) -> bytes | None:
        """The step's raw bytes, checked against the hash its index line holds (a trajectory edited after the
        run is refused). Kept for the next read of the same step, which then decodes the bytes hashed."""
        if self._last_bytes is not None and self._last_bytes[0] == (rank, step):
            return self._last_bytes[1]
        if not self.has(rank, step):
            return None
        idx = self.index[rank]
        data = trajectory_read.read_range(self.traj_path(rank), *idx.span(step))
        self._hash_checked(rank, step, idx.hash_match(step, data))
        self._last_bytes = ((rank, step), data)
        return data

    def raw_steps(self, rank: int, steps: list[int]) -> list[bytes]:
        """The steps' raw bytes, not yet checked (the caller checks each with `checked`, in its order): steps
        that lie one after another in the file are read in one range, so a rank's file is opened once a block
        of steps, not once a step."""
        idx = self.index[rank]
        return self._ranges(rank, self.traj_path(rank), [idx.span(s) for s in steps])

    def checked(self, rank: int, step: int, data: bytes) -> bytes:
        """`data` (the step's bytes from raw_steps) checked against the hash its index line holds, as
        step_bytes checks them."""
        self._hash_checked(rank, step, self.index[rank].hash_match(step, data))
        return data

    def check_step(self, rank: int, step: int) -> None:
        """The step's raw bytes against the hash its index line holds (hashing, no parsing)."""
        self.step_bytes(rank, step)

    def _hash_checked(self, rank: int, step: int, ok: bool | None) -> None:
        if ok is False:
            raise BadInput(
                self.traj_path(rank),
                f"step {step}: the bytes differ from the hash "
                "in the step index (edited after the run; see `disttrace verify`)",
            )
        if ok is True:
            self._count(step, hashed=1)

    def records(self, rank: int, step: int) -> list[dict]:
        if not self.has(rank, step):
            return []
        self.check_step(rank, step)
        recs = self.run.records_of_range(rank, *self.index[rank].span(step), step)
        self._count(step, records=len(recs))
        return recs

    def traj_path(self, rank: int) -> Path:
        if rank not in self._paths:
            self._paths[rank] = self.run.trajectory_path(rank)
        return self._paths[rank]

    def batch(self, rank: int, step: int):
        """The step's Arrow record batch (hash-checked), or None for a JSON-lines store or a missing step."""
        path = self.traj_path(rank)
        if not self.has(rank, step) or not trajectory_read.is_arrow(path):
            return None
        data = self.step_bytes(rank, step)  # the bytes decoded are the bytes hashed
        offset, length = self.index[rank].span(step)
        b = trajectory_decode.decode_step(
            path, data, f"step {step} (bytes {offset}..{offset + length})"
        )
        self._count(step, records=b.num_rows)
        return b

    def batches(self, rank: int, steps: list[int]):
        """Several steps' records (hash-checked) as one Arrow batch, the steps one after the other, with each
        step's first row; None for a JSON-lines store. Steps that lie one after the other in the file are read
        in one range and decoded together (trajectory_decode.decode_steps: a step's fixed cost paid once a block)."""
        path = self.traj_path(rank)
        if not trajectory_read.is_arrow(path) or not all(self.has(rank, s) for s in steps):
            return None
        idx = self.index[rank]
        spans = [idx.span(s) for s in steps]
        datas = self._ranges(rank, path, spans)
        matched = idx.hash_matches(steps, datas)
        if False in matched:  # the first step whose bytes are not what was indexed
            j = matched.index(False)
            self._count_block(steps[:j], None, matched)
            self._hash_checked(rank, steps[j], False)
        parts = [
            (data, f"step {s} (bytes {offset}..{offset + length})")
            for s, (offset, length), data in zip(steps, spans, datas)
        ]
        batch, starts = trajectory_decode.decode_steps(path, parts)
        # counted per step, as a step read alone is: results of ranks or steps read elsewhere then combine
        self._count_block(steps, np.diff(np.append(starts, batch.num_rows)).tolist(), matched)
        return batch, starts

    def _count_block(self, steps: list[int], records: list[int] | None, hashed: list) -> None:
        """_count of a block's steps under one lock: each step's records (None: none yet) and whether its
        bytes were hash-checked (True in `hashed`)."""
        with self._counting:
            for j, s in enumerate(steps):
                self._count_locked(
                    s, records[j] if records is not None else 0, int(hashed[j] is True)
                )

    def _ranges(self, rank: int, path: Path, spans: list[tuple[int, int]]) -> list[bytes]:
        """Each (offset, length)'s bytes; a run of spans that follow one another in the file in one read."""
        out: list[bytes] = []
        i = 0
        while i < len(spans):
            first, first_len = spans[i]
            j, end, span = i + 1, first + first_len, first_len
            while (
                j < len(spans)
                and spans[j][0] == end
                and min(first_len, spans[j][1]) >= 0
                and span + spans[j][1] <= _SPAN
            ):
                end += spans[j][1]
                span += spans[j][1]
                j += 1
            if j == i + 1:
                out.append(trajectory_read.read_range(path, first, first_len))
            else:
                data = memoryview(trajectory_read.read_range(path, first, span))
                for offset, length in spans[i:j]:
                    at = offset - first
                    out.append(bytes(data[at : at + length]))
            i = j
        return out

    def describe(self) -> SideSummary:
        return SideSummary(
            path=str(self.path),
            kind=self.kind,
            complete=self.complete,
            manifest_id=self.run.manifest_id,
            resume_step=self.resume_step or None,
            ranks=self.all_ranks,
            steps=[self.steps[0], self.steps[-1]] if self.steps else None,
        )


def common_steps(indexes) -> list[int]:
    """The steps every one of `indexes` (step -> entry, or a collection of steps) holds, in order."""
    steps: set[int] | None = None
    for index in indexes:
        s = set(index)
        steps = s if steps is None else steps & s
    return sorted(steps or ())


def side_warnings(
    label: str, path, all_ranks: list[int], world: int, complete: bool, steps: list[int]
) -> list[str]:
    """What a side says of the whole run once its ranks' indexes are read: no trajectory at all, the ranks its
    world lacks, incomplete (where its records stop)."""
    out = []
    if not all_ranks:
        out.append(f"run {label} ({path}) has no trajectory files")
    have = set(all_ranks)
    missing = [r for r in range(world) if r not in have]
    if missing and all_ranks:
        out.append(f"run {label}: no trajectory for rank(s) {missing} of world size {world}")
    if not complete:
        last = steps[-1] if steps else None
        out.append(
            f"run {label} is incomplete (no COMPLETE marker): "
            + (f"its records stop at step {last}" if last is not None else "it has no full step")
        )
    return out


def _line_step(line: bytes) -> int:
    if line.startswith(
        b'{"step":'
    ):  # the recorder writes "step" first: no need to parse the whole line
        end = line.find(b",", 8)
        try:
            return int(line[8:end])
        except ValueError:
            pass
    return int(orjson.loads(line)["step"])


def _scan_index(path: Path) -> dict[int, dict]:
    """Rebuild a step index (without digests) from the trajectory lines; a torn last line is left out."""
    out: dict[int, dict] = {}
    cur: dict | None = None
    offset = 0
    for lineno, line in safeio.lines(path, path.parent.parent):
        n = len(line)
        if not line.endswith(b"\n"):
            break  # torn last line (reported by the caller)
        if line.strip():
            try:
                step = _line_step(line)
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                raise BadInput(path, f"line {lineno} is not a trajectory record") from None
            if cur is None or cur["step"] != step:
                if step in out:
                    raise BadInput(
                        path, f"line {lineno}: records of step {step} are not contiguous"
                    )
                cur = out[step] = {
                    "step": step,
                    "offset": offset,
                    "length": 0,
                    "records": 0,
                    "digest": None,
                }
            cur["records"] += 1
        if cur is not None:
            cur["length"] = offset + n - cur["offset"]
        offset += n
    return out


def _plain_entries(lines: list[dict], size: int) -> dict[int, dict] | None:
    """_load_index's entries where every line has int step, offset and length and lies inside the trajectory of
    `size` bytes, checked a field at a time over all lines; None otherwise (the lines are then taken one by
    one, with their refusals and warnings)."""
    cols = [[e.get(k) for e in lines] for k in ("step", "offset", "length")]
    if any(set(map(type, c)) - {int} for c in cols):
        return None
    if lines and max(map(operator.add, cols[1], cols[2])) > size:
        return None
    return dict(zip(cols[0], lines))
