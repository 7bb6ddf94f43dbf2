"""diff: compare the trajectories of two runs and find the first divergence (docs/design.md, "Order", "Equality").

    result = diff_runs("runs/ab12/reference", "runs/ab12/fault")

* Compatibility first: runs of different editions are refused (unless allowed), and so are runs of
  different experiments (data, tokenizer, seed, model, optimisation, global batch), naming every field.
* Mode: ``bitwise`` (digests must match; the default when both runs have the same topology) or
  ``numeric`` (float statistics within a derived tolerance, see tolerance.py; the default across
  topologies, and when the caller gives rtol/atol).
* Order: records are ordered by (step, micro_batch, phase, rank, index); the first divergence is the
  smallest key whose records differ or that exists on one side only.
* Work: the per-rank step index holds a digest of each step's record digests; a step whose digests agree
  and whose raw bytes are the same on both sides is skipped without decoding a record (the index's digest
  alone never skips a step: its writer may have forged it). Every other step is read, by seeking to its
  byte range.
* Propagation: from the first divergent step on, per step and rank, how many tensors differ out of how
  many, the largest relative error per phase, and the steps where everything is equal again.

Everything here reads the run store only and imports no torch: a run written on a cluster is diffed on a
laptop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import columnar, tolerance
from disttrace.analysis.result import (
    BoundKind,
    ComparedSteps,
    DiffResult,
    DiffStats,
    Divergence,
    NumericSummary,
    PhaseWorst,
    RankEntry,
    RecordsRead,
    SideSummary,
    StepEntry,
    Tolerance,
    TopologyComparison,
    Unit,
    WorstRatio,
)
from disttrace.config.manifest import (
    TOPOLOGY_FIELDS,
    experiment_differences,
    get_field,
    observed_topology_differences,
    unknown_line,
)
from disttrace.errors import BadInput
from disttrace.fmt import ranges
from disttrace.model.names import tensor_class
from disttrace.store import safeio, seal, trajectory
from disttrace.store.rundir import LOCK, PHASE_ORDER, PHASES, Run

MODES = ("bitwise", "numeric")
# Across topologies only these phases hold the same logical tensors: the global (reduced) gradient, the
# clipped gradient, and parameters + optimizer state after the step. Per-micro-batch activations and
# local gradients depend on how the batch was split.
CROSS_TOPOLOGY_PHASES = ("reduce", "clip", "optimizer")
TINY = 1e-300
MAX_WARNINGS_OF_A_KIND = 5
_SPAN = 64 << 20  # the most bytes read in one range for a block of steps

_UNKNOWN_PHASE = len(PHASES)


def _phase_order(phase: str) -> int:
    return PHASE_ORDER.get(phase, _UNKNOWN_PHASE)


# ---------------------------------------------------------------- one side


class _Side:
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
        self.index: dict[int, dict[int, dict]] = {}
        self.steps: list[int] = []
        self.records_read = 0  # trajectory records parsed (the `records_read` of the result)
        # per step: [records parsed, step ranges hash-checked], so results of different ranks combine exactly
        self.io: dict[int, list[int]] = {}
        self.rank_warnings: dict[int, list[str]] = {}  # what reading each rank's index said
        self._paths: dict[int, Path] = {}
        self._last_bytes: tuple[tuple[int, int], bytes] | None = None
        # records of all ranks that batch() may decode ahead of the step asked for (0: one step at a time): a
        # reader that then asks for the following steps in order gets them from one decode
        self.read_ahead = 0
        self._order: dict[int, int] = {}  # the steps it reads ahead along, and their positions
        self._order_steps: list[int] = []
        self._ahead: dict[tuple[int, int], pa.RecordBatch] = {}

    def load(self) -> None:
        """Read (or rebuild) the step index of every rank; called after the compatibility check."""
        warnings = self.warnings
        for r in self.ranks:
            mark = len(warnings)
            self.index[r] = self._load_index(r, self.use_index)
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
        if size and not trajectory.is_arrow(traj):
            with safeio.open_file(traj, self.run.path) as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    self.warnings.append(
                        f"run {self.label}: {traj}: last line is torn (incomplete write), ignored"
                    )
        steps_path = self.run.rank_path("trajectory", rank, ".steps.jsonl")
        if use_index and safeio.present(steps_path):
            read = self.run.step_index(rank)
            # the stored lines: the same shape as the entries a scan rebuilds without an index
            lines = [e.as_read() for e in read.records]
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
            if trajectory.is_arrow(traj):
                tail = trajectory.unindexed_tail(
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
        if trajectory.is_arrow(traj):
            return self._scan_arrow(traj)
        return _scan_index(traj)

    def _scan_arrow(self, traj: Path) -> dict[int, dict]:
        """Rebuild a step index (without digests) from the stream's record batches, one per step."""
        out: dict[int, dict] = {}
        torn: list[str] = []
        for offset, length, batch in trajectory.scan(traj, torn):
            step = trajectory.step_of(batch)
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

    def entry(self, rank: int, step: int) -> dict | None:
        return self.index.get(rank, {}).get(step)

    def step_bytes(self, rank: int, step: int) -> bytes | None:
        """The step's raw bytes, checked against the hash its index line holds (a trajectory edited after the
        run is refused). Kept for the next read of the same step, which then decodes the bytes hashed."""
        if self._last_bytes is not None and self._last_bytes[0] == (rank, step):
            return self._last_bytes[1]
        e = self.entry(rank, step)
        if e is None:
            return None
        data = trajectory.read_range(self.traj_path(rank), e["offset"], e["length"])
        self._hash_checked(rank, step, seal.step_data_match(data, e))
        self._last_bytes = ((rank, step), data)
        return data

    def raw_steps(self, rank: int, steps: list[int]) -> list[bytes]:
        """The steps' raw bytes, not yet checked (the caller checks each with `checked`, in its order): steps
        that lie one after another in the file are read in one range, so a rank's file is opened once a block
        of steps, not once a step."""
        return self._ranges(rank, self.traj_path(rank), [self.entry(rank, s) for s in steps])

    def checked(self, rank: int, step: int, data: bytes) -> bytes:
        """`data` (the step's bytes from raw_steps) checked against the hash its index line holds, as
        step_bytes checks them."""
        self._hash_checked(rank, step, seal.step_data_match(data, self.entry(rank, step)))
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
        e = self.entry(rank, step)
        if e is None:
            return []
        self.check_step(rank, step)
        recs = self.run.records_of_range(rank, e["offset"], e["length"], e.get("step"))
        self._count(step, records=len(recs))
        return recs

    def traj_path(self, rank: int) -> Path:
        if rank not in self._paths:
            self._paths[rank] = self.run.trajectory_path(rank)
        return self._paths[rank]

    def batch(self, rank: int, step: int):
        """The step's Arrow record batch (hash-checked), or None for a JSON-lines store or a missing step.
        With `read_ahead`, the rank's following steps are decoded with it (a block) and kept for their turn."""
        e = self.entry(rank, step)
        path = self.traj_path(rank)
        if e is None or not trajectory.is_arrow(path):
            return None
        kept = self._ahead.pop((rank, step), None)
        if kept is not None:
            return kept
        if self.read_ahead:
            block = self._following(rank, step)
            if len(block) > 1:
                batch, starts = self.batches(rank, block)
                ends = np.append(starts[1:], batch.num_rows)
                for s, a, b in zip(block, starts.tolist(), ends.tolist()):
                    self._ahead[(rank, s)] = batch.slice(a, b - a)
                return self._ahead.pop((rank, step))
        data = self.step_bytes(rank, step)  # the bytes decoded are the bytes hashed
        b = trajectory.decode_step(
            path, data, f"step {step} (bytes {e['offset']}..{e['offset'] + e['length']})"
        )
        self._count(step, records=b.num_rows)
        return b

    def batches(self, rank: int, steps: list[int]):
        """Several steps' records (hash-checked) as one Arrow batch, the steps one after the other, with each
        step's first row; None for a JSON-lines store. Steps that lie one after the other in the file are read
        in one range and decoded together (trajectory.decode_steps: a step's fixed cost paid once a block)."""
        path = self.traj_path(rank)
        entries = [self.entry(rank, s) for s in steps]
        if not trajectory.is_arrow(path) or any(e is None for e in entries):
            return None
        parts = []
        for e, data in zip(entries, self._ranges(rank, path, entries)):
            self._hash_checked(rank, e["step"], seal.step_data_match(data, e))
            parts.append(
                (data, f"step {e['step']} (bytes {e['offset']}..{e['offset'] + e['length']})")
            )
        batch, starts = trajectory.decode_steps(path, parts)
        # counted per step, as a step read alone is: results of ranks or steps read elsewhere then combine
        ends = np.append(starts[1:], batch.num_rows)
        for s, a, z in zip(steps, starts.tolist(), ends.tolist()):
            self._count(s, records=z - a)
        return batch, starts

    def read_along(self, steps: list[int], rows: int) -> None:
        """Let batch() decode ahead, along `steps` (the steps the comparison will ask for, in its order), as
        far as `rows` records over all ranks reach: each step decoded ahead is one it will ask for."""
        self.read_ahead, self._order_steps = rows, list(steps)
        self._order = {s: i for i, s in enumerate(self._order_steps)}

    def _following(self, rank: int, step: int) -> list[int]:
        """`step` and the rank's steps after it, as far as read_ahead records over all ranks reach."""
        at = self._order.get(step)
        if at is None:
            return [step]
        out, rows, width = [], 0, max(1, len(self.ranks))
        for s in self._order_steps[at:]:
            e = self.entry(rank, s)
            if e is None:
                break
            rows += width * int(e.get("records") or 0)
            if out and rows > self.read_ahead:
                break
            out.append(s)
        return out

    def _ranges(self, rank: int, path: Path, entries: list[dict]) -> list[bytes]:
        """Each entry's bytes; a run of entries that follow one another in the file in one read."""
        out: list[bytes] = []
        i = 0
        while i < len(entries):
            j, end, span = i + 1, entries[i]["offset"] + entries[i]["length"], entries[i]["length"]
            while (
                j < len(entries)
                and entries[j]["offset"] == end
                and min(entries[i]["length"], entries[j]["length"]) >= 0
                and span + entries[j]["length"] <= _SPAN
            ):
                end += entries[j]["length"]
                span += entries[j]["length"]
                j += 1
            if j == i + 1:
                out.append(trajectory.read_range(path, entries[i]["offset"], entries[i]["length"]))
            else:
                data = memoryview(trajectory.read_range(path, entries[i]["offset"], span))
                for e in entries[i:j]:
                    at = e["offset"] - entries[i]["offset"]
                    out.append(bytes(data[at : at + e["length"]]))
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


# ---------------------------------------------------------------- compatibility


def _leaves(manifest: dict, dotted: str) -> dict[str, Any]:
    v = get_field(manifest, dotted)
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k in v:
            out.update(_leaves(manifest, f"{dotted}.{k}"))
        return out
    return {dotted: v}


def _field_diffs(ma: dict, mb: dict, fields) -> list[tuple[str, Any, Any]]:
    out = []
    for f in fields:
        la, lb = _leaves(ma, f), _leaves(mb, f)
        for k in sorted(set(la) | set(lb)):
            if la.get(k) != lb.get(k):
                out.append((k, la.get(k), lb.get(k)))
    return out


def _short(v: Any) -> str:
    s = repr(v)
    return s[:14] + "...'" if isinstance(v, str) and len(v) > 16 else s


def _check_compatible(
    a: _Side, b: _Side, allow_edition_mismatch: bool, warnings: list[str]
) -> None:
    ma, mb = a.manifest, b.manifest
    where = b.path / LOCK
    ea, eb = get_field(ma, "experiment.edition"), get_field(mb, "experiment.edition")
    if ea != eb:
        if not allow_edition_mismatch:
            raise BadInput(
                where,
                f"edition {eb!r} differs from {ea!r} of {a.path}; runs of different editions are "
                "never compared silently (allow it explicitly to compare anyway)",
                field="experiment.edition",
            )
        warnings.append(
            f"editions differ ({ea!r} vs {eb!r}): compared because it was explicitly allowed"
        )
    diffs, unknown = experiment_differences(a.run.lock, b.run.lock)
    if unknown:
        warnings.append(unknown_line(unknown))
    if diffs:
        names = ", ".join(k for k, _, _ in diffs)
        detail = "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in diffs)
        raise BadInput(where, f"not the same experiment as {a.path}: {detail}", field=names)


# ---------------------------------------------------------------- comparing values


def _stats(rec: dict) -> dict:
    return {
        k: rec.get(k)
        for k in ("digest", "sum", "norm", "sketch", "nonfinite", "dtype", "shape", "numel")
    }


def _same_bits(ra: dict, rb: dict) -> bool:
    return (
        ra.get("digest") is not None
        and ra.get("digest") == rb.get("digest")
        and ra.get("shape") == rb.get("shape")
        and ra.get("dtype") == rb.get("dtype")
    )


def _nonfinite(r: dict) -> bool:
    return bool(r.get("nonfinite")) or r.get("sum") is None or r.get("norm") is None


class _Tol:
    """rel_err of two records' statistics and the bound it is held to."""

    def __init__(
        self,
        mode: str,
        ma: dict,
        mb: dict,
        rtol: float | None,
        atol: float | None,
        since: int,
        calibration=None,
        magnitudes=None,
        observed: tuple = (None, None),
    ):
        self.mode, self.ma, self.mb, self.since = mode, ma, mb, since
        # each lock's `observed` (attached runs count their batch: the reduction size of the bound)
        self.observed = observed
        self.user = mode == "numeric" and (rtol is not None or atol is not None)
        self.rtol, self.atol = (rtol or 0.0), (atol or 0.0)
        self.cal = calibration if mode == "numeric" and not self.user else None
        self._cls: dict[str, str] = {}
        self._cache: dict[tuple[int, str], float] = {}
        self._eps: dict[str, float] = {}
        # (A's, B's) analysis.magnitudes.Magnitudes when both runs recorded them: a gradient's difference is then
        # measured against the magnitudes that produced it, not against its own (possibly cancelled) norm
        self.mags = (
            magnitudes
            if mode == "numeric"
            and not self.user
            and magnitudes
            and all(m.available for m in magnitudes)
            else None
        )
        if self.cal is not None and self.cal.scale == "magnitudes" and self.mags is None:
            # its noise was measured against the magnitudes: it says nothing of an error on a norm's scale
            self.ignored_calibration = self.cal
            self.cal = None
        else:
            self.ignored_calibration = None

    def magnitude(self, step: int, ra: dict | None, rb: dict | None) -> tuple[float, bool]:
        """(the larger side's magnitude, 0 if none; False where no sound bound exists) for a pair of records
        or logical values (analysis/magnitudes.py)."""
        if self.mags is None:
            return 0.0, True
        out, bounded = 0.0, True
        for mag, r in zip(self.mags, (ra, rb)):
            if r is None:
                continue
            m, ok = mag.of(
                step,
                r.get("phase"),
                int(r.get("index") or 0),
                r.get("logical") or r.get("tensor"),
                r.get("rank"),
                int(r.get("micro_batch") or 0),
            )
            bounded = bounded and ok
            if m is not None:
                out = max(out, m)
        return out, bounded

    def row_magnitudes(self, step_of_row, batch_a, batch_b, rows) -> tuple[np.ndarray, np.ndarray]:
        """`magnitude` for rows of two aligned batches: (magnitudes, unbounded) arrays. Rows are grouped by
        (step, phase, rank, micro-batch), and each group looked up in one pass over its indices."""
        n = len(rows)
        extra, unbounded = np.zeros(n), np.zeros(n, dtype=bool)
        if self.mags is None or not n:
            return extra, unbounded
        take = pa.array(rows, pa.int64())
        steps = step_of_row[rows]
        for mag, batch in zip(self.mags, (batch_a, batch_b)):
            phase = batch.column("phase").take(take).to_pylist()
            names = batch.column("tensor").take(take).to_pylist()
            index = np.asarray(batch.column("index").take(take).to_numpy(zero_copy_only=False))
            rank = np.asarray(batch.column("rank").take(take).to_numpy(zero_copy_only=False))
            mb = np.asarray(batch.column("micro_batch").take(take).to_numpy(zero_copy_only=False))
            groups: dict[tuple, list[int]] = {}
            for j, key in enumerate(zip(steps.tolist(), phase, rank.tolist(), mb.tolist())):
                groups.setdefault(key, []).append(j)
            for (step, ph, rk, m), pos in groups.items():
                if ph in ("backward", "reduce") or (ph == "clip"):
                    table = (
                        mag.by_rank.get(rk, {}).get(step, {}).get(ph, {}).get(m, {})
                        if ph == "backward"
                        else mag.reduced(step)
                    )
                    vals = [table.get(i) for i in index[pos].tolist()]
                    for k, j in enumerate(pos):
                        v = vals[k]
                        if v is None and ph == "clip":
                            v, _ = mag.of(step, ph, int(index[j]), names[j], rk, m)
                        if v is not None and v > extra[j]:
                            extra[j] = v
                    continue
                for j in pos:
                    v, ok = mag.of(step, ph, int(index[j]), names[j], rk, m)
                    if not ok:
                        unbounded[j] = True
                    if v is not None and v > extra[j]:
                        extra[j] = v
        return extra, unbounded

    def _class(self, name: str | None) -> str | None:
        """The calibration's key for a tensor: its class where the calibration has classes, else None."""
        if name is None or self.cal is None or self.cal.by_class is None:
            return None
        got = self._cls.get(name)
        if got is None:
            got = self._cls[name] = tensor_class(name)
        return got

    def _step_bound(self, phase: str) -> float:
        """tolerance.step_bound of the two manifests: per phase, the same at every step."""
        eps = self._eps.get(phase)
        if eps is None:
            eps = self._eps[phase] = tolerance.step_bound(self.ma, self.mb, phase, self.observed)
        return eps

    def derived(self, step: int, phase: str, name: str | None = None) -> float:
        """The bound at (step, phase) for tensor `name`: the calibrated one where the calibration measured it
        (per tensor class where it has classes), else derived."""
        if self.mode == "bitwise":
            return 0.0
        cls = self._class(name)
        k = (step, phase, cls)
        if k not in self._cache:
            c = None
            if self.cal is not None:
                c = (
                    self.cal.by_class.get((int(step), phase, cls))
                    if cls is not None
                    else self.cal.bound(step, phase)
                )
            self._cache[k] = (
                c
                if c is not None
                else tolerance.bound(
                    self.ma,
                    self.mb,
                    step,
                    phase,
                    since=self.since,
                    magnitudes=self.mags is not None,
                    observed=self.observed,
                    eps=self._step_bound(phase),
                )
            )
        return self._cache[k]

    def kind(self, step: int, phase: str, name: str | None = None) -> str:
        """Where the bound at (step, phase) comes from: bitwise | user | calibrated | derived | none (no
        sound bound: a parameter under Adam, analysis/magnitudes.py)."""
        if (
            self.mags is not None
            and phase == "optimizer"
            and name is not None
            and ":" not in name
            and not self.mags[0].of(step, phase, 0, name, None, 0)[1]
        ):
            return "none"
        if self.mode == "bitwise" or self.user:
            return "bitwise" if self.mode == "bitwise" else "user"
        return (
            "calibrated"
            if self.cal is not None and self.cal.bound(step, phase, name) is not None
            else "derived"
        )

    def compare_bound(self, step: int, phase: str) -> float | None:
        """The relative bound at (step, phase); None where a user's atol makes it depend on the scale."""
        if self.user:
            return self.rtol if not self.atol else None
        return self.derived(step, phase)

    def compare(
        self, step: int, phase: str, ra: dict, rb: dict
    ) -> tuple[float | None, float, bool, str | None]:
        """-> (rel_err, bound, diverged, note) for two records (or logical values) that are not bit-equal."""
        numel = max(int(ra.get("numel") or 0), int(rb.get("numel") or 0), 1)
        note = None
        if ra.get("shape") != rb.get("shape") or ra.get("dtype") != rb.get("dtype"):
            note = "shape or dtype differs"
        fa, fb = _nonfinite(ra), _nonfinite(rb)
        name = ra.get("tensor") or rb.get("tensor")
        b0 = self.derived(step, phase, name) * tolerance.tensor_factor(name)
        if fa or fb:
            same = fa and fb and ra.get("nonfinite") == rb.get("nonfinite")
            diverged = self.mode == "bitwise" or not same or note is not None
            return None, b0, diverged, note or "non-finite values"
        na, nb = float(ra["norm"]), float(rb["norm"])
        extra, bounded = self.magnitude(step, ra, rb)
        if not bounded:
            b0 = math.inf
        scale_n = max(na, nb, extra, TINY)
        scale_s = max(max(na, nb, extra) * math.sqrt(numel), TINY)
        # the sum and each sketch projection are <x, v> with ||v|| = sqrt(numel): one scale, one bound
        terms = (abs(na - nb) / scale_n, *tolerance.projection_terms(ra, rb, scale_s))
        if self.user:
            bounds = (
                (self.atol + self.rtol * scale_n) / scale_n,
                *[(self.atol + self.rtol * scale_s) / scale_s] * (len(terms) - 1),
            )
        else:
            bounds = (b0,) * len(terms)
        # each statistic also carries its own rounding (tolerance.norm_rounding, sum_rounding: float32 runs and
        # column sums; sketch_rounding: the float32 GEMM), both records'; the norm's and the sum's are added to
        # a derived or calibrated bound (not to a user's, nor to a phase that must be exact)
        stat = self.mode != "bitwise" and not self.user and b0 > 0
        rounding = [
            sum(f(r.get("dtype"), r.get("shape")) for r in (ra, rb)) if stat else 0.0
            for f in (tolerance.norm_rounding, tolerance.sum_rounding)
        ]
        rounding.append(
            sum(tolerance.sketch_rounding(r.get("dtype"), r.get("shape")) for r in (ra, rb))
        )
        bounds = (
            bounds[0] + rounding[0],
            bounds[1] + rounding[1],
            *(bd + rounding[2] for bd in bounds[2:]),
        )
        # report the term that is largest relative to its bound (simply the largest term when the bounds agree)
        if len(set(bounds)) == 1:
            i = max(range(len(terms)), key=lambda j: terms[j])
        else:
            ratios = [
                t / bd if bd > 0 else (math.inf if t else 0.0) for t, bd in zip(terms, bounds)
            ]
            i = max(range(len(terms)), key=lambda j: ratios[j])
        rel, bnd = terms[i], bounds[i]
        if not math.isfinite(rel):
            rel = None
        diverged = (
            self.mode == "bitwise"
            or note is not None
            or rel is None
            or any(t > bd for t, bd in zip(terms, bounds))
        )
        return rel, bnd, diverged, note


class _RankStep:
    """What one rank showed at one step."""

    __slots__ = (
        "differing",
        "total",
        "inexact",
        "hard",
        "max_rel",
        "max_rel_bound",
        "max_ratio",
        "ratio_by_phase",
        "first",
    )

    def __init__(self, total: int = 0):
        self.differing = 0
        self.total = total
        self.inexact = 0  # not bit-equal (within or beyond the bound)
        self.hard = 0  # divergent without a relative error: missing, non-finite, shape
        self.max_rel: dict[str, float] = {}
        self.max_ratio = 0.0
        self.max_rel_bound: dict[str, float] = {}
        self.ratio_by_phase: dict[
            str, tuple[float, float, float]
        ] = {}  # phase -> (ratio, rel_err, bound)
        self.first: tuple[tuple, Unit] | None = None  # (key, unit)

    def add(self, key: tuple, unit: Unit) -> None:
        self.inexact += 1
        rel, bnd, phase = unit.rel_err, unit.bound, unit.phase
        if rel is not None:
            if rel > self.max_rel.get(phase, -1.0):
                self.max_rel[phase] = rel
                self.max_rel_bound[phase] = (
                    bnd  # the bound that tensor was held to (per-tensor factors apply)
                )
            if bnd > 0:
                ratio = rel / bnd
                self.max_ratio = max(self.max_ratio, ratio)
                if ratio > self.ratio_by_phase.get(phase, (-1.0,))[0]:
                    self.ratio_by_phase[phase] = (ratio, rel, bnd)
        if unit.diverged:
            self.differing += 1
            if rel is None or unit.missing_in or unit.note:
                self.hard += 1
            if self.first is None or key < self.first[0]:
                self.first = (key, unit)

    def entry(self) -> RankEntry:
        by_phase = dict(sorted(self.max_rel.items(), key=lambda kv: _phase_order(kv[0])))
        if not self.inexact:
            return RankEntry(self.differing, self.total, by_phase)
        return RankEntry(
            self.differing,
            self.total,
            by_phase,
            inexact=self.inexact,
            max_rel_err=max(self.max_rel.values()) if self.max_rel else None,
            max_ratio=self.max_ratio if self.max_ratio else None,
            hard=self.hard,
        )


def _unit(step, rec_a, rec_b, rank, tol: _Tol, logical: bool = False) -> Unit:
    ref = rec_b if rec_b is not None else rec_a
    phase = ref["phase"]
    if rec_a is None or rec_b is None:
        rel, bnd, diverged, note = None, tol.derived(step, phase), True, None
    else:
        rel, bnd, diverged, note = tol.compare(step, phase, rec_a, rec_b)
    return Unit(
        step=step,
        micro_batch=ref.get("micro_batch", 0),
        phase=phase,
        rank=rank,
        tensor=(ref.get("logical") or ref.get("tensor")) if logical else ref.get("tensor"),
        index=ref.get("index", 0),
        a=_stats(rec_a) if rec_a is not None else None,
        b=_stats(rec_b) if rec_b is not None else None,
        rel_err=rel,
        bound=bnd,
        diverged=diverged,
        missing_in="a" if rec_a is None else ("b" if rec_b is None else None),
        note=note,
    )


def _keyed(recs: list[dict]) -> dict[tuple, dict]:
    """Records of one rank and step by (micro_batch, phase order, phase, index, duplicate number)."""
    out: dict[tuple, dict] = {}
    for r in recs:
        phase = r.get("phase", "")
        k = (r.get("micro_batch", 0), _phase_order(phase), phase, r.get("index", 0))
        d = 0
        while (*k, d) in out:
            d += 1
        out[(*k, d)] = r
    return out


def _compare_rank_step(
    step: int, rank: int, recs_a: list[dict], recs_b: list[dict], tol: _Tol
) -> _RankStep:
    ka, kb = _keyed(recs_a), _keyed(recs_b)
    keys = sorted(
        ka.keys() | kb.keys()
    )  # in the recorder's order: ties between errors resolve the same every run
    rs = _RankStep(len(keys))
    for k in keys:
        ra, rb = ka.get(k), kb.get(k)
        if ra is not None and rb is not None and _same_bits(ra, rb):
            continue
        mb, po, phase, index, dup = k
        rs.add((mb, po, phase, rank, index, dup), _unit(step, ra, rb, rank, tol))
    return rs


def _compare_rank_step_columns(step: int, rank: int, ba, bb, tol: _Tol) -> _RankStep:
    """_compare_rank_step on two Arrow batches: aligned rows are compared column-wise (analysis/columnar.py),
    the few that need the record path's special cases (and unaligned steps) go through it."""
    ca, cb = columnar.Columns(ba), columnar.Columns(bb)
    if not columnar.aligned(ca, cb):
        return _compare_rank_step(
            step, rank, trajectory.to_records(ba), trajectory.to_records(bb), tol
        )
    rs = _RankStep(ba.num_rows)
    _fold_columns([step], rank, ca, cb, np.zeros(1, dtype=np.int64), tol, [rs])
    return rs


def _fold_columns(
    steps: list[int],
    rank: int,
    ca,
    cb,
    starts: np.ndarray,
    tol: _Tol,
    out: list[_RankStep],
    logical: bool = False,
) -> None:
    """Row i of `ca` against row i of `cb`, column-wise, into `out`: one or several steps concatenated (step
    `steps[j]` from row `starts[j]`, its result into `out[j]`). The bulk is summed up per step by
    columnar.by_step; the special rows (non-finite, shape or dtype differs, empty) and each step's first
    divergent row (whose unit dict the result shows) go through the record path's own `_unit`."""
    row_step = np.repeat(np.asarray(steps, dtype=np.int64), np.diff(np.append(starts, ca.num_rows)))
    n_orders = len(PHASES) + 1

    def base_bound(rows, order, names):
        if tol.cal is not None and tol.cal.by_class is not None:  # per tensor class: row by row
            steps_, names_ = row_step[rows].tolist(), names.to_pylist()
            per_row = np.array(
                [
                    tol.derived(s, columnar.phase_name(int(o)), n)
                    for s, o, n in zip(steps_, order.tolist(), names_)
                ]
            )
            return per_row * columnar.tensor_factors(names)
        pairs, inv = np.unique(row_step[rows] * n_orders + order, return_inverse=True)
        derived = np.array(
            [
                tol.derived(int(p // n_orders), columnar.phase_name(int(p % n_orders)))
                for p in pairs.tolist()
            ]
        )
        return derived[inv.reshape(-1)] * columnar.tensor_factors(names)

    c = columnar.compare(
        ca,
        cb,
        bitwise=tol.mode == "bitwise",
        user=(tol.rtol, tol.atol) if tol.user else None,
        base_bound=base_bound,
        magnitudes=(lambda rows: tol.row_magnitudes(row_step, ca.batch, cb.batch, rows))
        if tol.mags is not None
        else None,
    )
    summary = columnar.by_step(c, starts)
    for j, rs in enumerate(out):
        rs.inexact += int(summary.inexact[j])
        rs.differing += int(summary.differing[j])
        rs.hard += int(summary.hard[j])
    for j, order, rel, bnd, ratio in summary.groups:
        rs, phase = out[j], columnar.phase_name(order)
        if rel > rs.max_rel.get(phase, -1.0):
            rs.max_rel[phase], rs.max_rel_bound[phase] = rel, bnd
        if ratio is not None:
            rs.max_ratio = max(rs.max_ratio, ratio[0])
            if ratio[0] > rs.ratio_by_phase.get(phase, (-1.0,))[0]:
                rs.ratio_by_phase[phase] = ratio
    rows = sorted(
        {r for j in range(len(out)) for r in summary.special[j]}
        | {int(r) for r in summary.first_divergent if r >= 0}
    )
    if not rows:
        return
    take = pa.array(rows, pa.int64())
    ra, rb = trajectory.to_records(ca.batch.take(take)), trajectory.to_records(cb.batch.take(take))
    special = {r for j in range(len(out)) for r in summary.special[j]}
    for row, x, y in zip(rows, ra, rb):
        j = int(np.searchsorted(starts, row, side="right")) - 1
        rs, step = out[j], steps[j]
        last = (
            y.get("tensor") if logical else 0
        )  # the record path's key ends with the name / a duplicate count
        key = (
            y.get("micro_batch", 0),
            _phase_order(y["phase"]),
            y["phase"],
            rank,
            y.get("index", 0),
            last,
        )
        unit = _unit(step, x, y, rank, tol, logical=logical)
        if row in special:
            rs.add(key, unit)
        elif rs.first is None or key < rs.first[0]:
            rs.first = (key, unit)


# ---------------------------------------------------------------- logical tensors (across topologies)


class StepWarnings:
    """What comparing one step across topologies warns of, each warning with its kind, and the phases both
    runs record. The comparison's driver replays them in step order (`Warned`), so results of steps compared
    in different processes warn as one process would."""

    __slots__ = ("events", "both", "_counts")

    def __init__(self):
        self.events: list[
            tuple[str, str]
        ] = []  # (kind, text); kind "phase:<name>" is warned once a run
        self.both: set[str] = set()
        self._counts: dict[str, int] = {}

    def wants(self, kind: str) -> bool:
        """Whether a capped warning of `kind` could still be printed (none beyond the cap in one step)."""
        return self._counts.get(kind, 0) < MAX_WARNINGS_OF_A_KIND

    def capped(self, kind: str, text: str) -> None:
        self._counts[kind] = self._counts.get(kind, 0) + 1
        self.events.append((kind, text))

    def phase(self, phase: str, text: str) -> None:
        self.events.append(("phase:" + phase, text))


class Warned:
    """The comparison's warnings replayed in step order: a phase one run lacks once, at most
    MAX_WARNINGS_OF_A_KIND of each other kind."""

    def __init__(self, warnings: list[str]):
        self.warnings = warnings
        self.counts: dict[str, int] = {}
        self.phases: set[str] = set()
        self.both: set[str] = set()

    def replay(self, events, both) -> None:
        self.both.update(both)
        for kind, text in events:
            if kind.startswith("phase:"):
                if kind not in self.phases:
                    self.phases.add(kind)
                    self.warnings.append(text)
            elif self.counts.get(kind, 0) < MAX_WARNINGS_OF_A_KIND:
                self.counts[kind] = self.counts.get(kind, 0) + 1
                self.warnings.append(text)


class _Logical:
    """One logical tensor of one step and phase on one side: its shards (distinct offsets, lowest rank
    wins) or, for a replicated tensor, each rank's copy."""

    __slots__ = ("recs",)

    def __init__(self):
        self.recs: list[dict] = []  # in rank order

    def value(self) -> tuple[dict, int, bool]:
        """-> (a record-like dict of the logical tensor, lowest holding rank, complete)."""
        first = self.recs[0]
        if not any("shard" in r for r in self.recs):
            return first, first.get("rank", 0), True
        shards: dict[tuple, dict] = {}
        for r in self.recs:  # rank order: the lowest rank's copy of a replicated shard wins
            sh = r.get("shard") or {
                "offset": [0] * len(r.get("shape") or []),
                "logical_shape": r.get("shape"),
            }
            shards.setdefault(tuple(sh.get("offset") or ()), r)
        ordered = [shards[k] for k in sorted(shards)]
        sums = [r.get("sum") for r in ordered]
        norms = [r.get("norm") for r in ordered]
        lshape = (first.get("shard") or {}).get("logical_shape") or first.get("shape") or []
        numel = math.prod(lshape) if lshape else int(first.get("numel") or 0)
        covered = sum(int(r.get("numel") or 0) for r in ordered)
        finite = all(s is not None for s in sums) and all(n is not None for n in norms)
        v = {
            "step": first.get("step"),
            "micro_batch": first.get("micro_batch", 0),
            "phase": first.get("phase"),
            "index": first.get("index", 0),
            "tensor": first.get("logical") or first.get("tensor"),
            "logical": first.get("logical") or first.get("tensor"),
            "digest": "shards:" + ",".join(str(r.get("digest")) for r in ordered),
            "sum": math.fsum(sums) if finite else None,
            "norm": math.sqrt(math.fsum(n * n for n in norms)) if finite else None,
            "sketch": tolerance.combine_sketches([r.get("sketch") for r in ordered])
            if finite
            else None,
            "nonfinite": sum(int(r.get("nonfinite") or 0) for r in ordered),
            "dtype": first.get("dtype"),
            "shape": list(lshape),
            "numel": numel,
            "shards": len(ordered),
        }
        return v, min(r.get("rank", 0) for r in self.recs), covered == numel


def _replica_mismatches(recs: list[dict]) -> list[tuple[dict, dict]]:
    """(record, the lowest rank's record) for copies of one tensor or shard (same offset) that differ."""
    first: dict[tuple, dict] = {}
    out = []
    for r in recs:
        k = tuple((r.get("shard") or {}).get("offset") or ())
        r0 = first.setdefault(k, r)
        if r0 is not r and not _same_bits(r, r0):
            out.append((r, r0))
    return out


def _logicals(recs_by_rank: dict[int, list[dict]], phases) -> dict[tuple[str, str], _Logical]:
    out: dict[tuple[str, str], _Logical] = {}
    for rank in sorted(recs_by_rank):
        for r in recs_by_rank[rank]:
            if r.get("phase") not in phases:
                continue
            name = r.get("logical") or r.get("tensor")
            out.setdefault((r["phase"], name), _Logical()).recs.append(r)
    return out


def _step_records(side: _Side, step: int) -> tuple[dict[int, list[dict]], dict | None]:
    """(records by rank, Arrow batches by rank when every rank's trajectory is an Arrow stream)."""
    if side.ranks and all(trajectory.is_arrow(side.traj_path(r)) for r in side.ranks):
        batches = {r: side.batch(r, step) for r in side.ranks if side.entry(r, step) is not None}
        return {}, batches
    return {r: side.records(r, step) for r in side.ranks}, None


def _compare_logical_step(
    step: int, a: _Side, b: _Side, tol: _Tol, ev: StepWarnings
) -> dict[int, _RankStep]:
    recs_a, batches_a = _step_records(a, step)
    recs_b, batches_b = _step_records(b, step)
    out = _compare_logical_tensors(step, recs_a, batches_a, recs_b, batches_b, tol, ev)
    if tol.mode == "numeric":
        _compare_losses(step, _losses(recs_a, batches_a), _losses(recs_b, batches_b), tol, out)
    return out


def _losses(recs: dict, batches: dict | None) -> dict[tuple, list[dict]]:
    """A side's loss records keyed by the samples of their micro-batch (the `data` record's sample ids at
    the same rank and micro-batch), in rank order: the same samples under the same parameters give the
    same loss in any layout, so micro-batches that hold the same samples compare across topologies."""
    if batches is not None:
        want = pa.array(["data", "loss"], pa.string())
        recs = {
            r: trajectory.to_records(b.filter(pc.is_in(b.column("phase"), value_set=want)))
            for r, b in batches.items()
            if b is not None
        }
    out: dict[tuple, list[dict]] = {}
    for rank in sorted(recs):
        samples, losses = {}, {}
        for r in recs[rank]:
            if r.get("phase") == "data" and r.get("samples"):
                samples[r.get("micro_batch", 0)] = tuple(r["samples"])
            elif r.get("phase") == "loss":
                losses[r.get("micro_batch", 0)] = r
        for mb, r in losses.items():
            if mb in samples:
                out.setdefault(samples[mb], []).append(r)
    return out


def _compare_losses(step: int, la: dict, lb: dict, tol: _Tol, out: dict) -> None:
    """Each of B's losses against A's loss of the same samples (A's lowest rank); micro-batches whose samples
    the other run splits differently are not compared."""
    for key in sorted(la.keys() & lb.keys()):
        ra = la[key][0]
        for rb in lb[key]:
            rank = rb.get("rank", 0)
            rs = out.setdefault(rank, _RankStep())
            rs.total += 1
            if _same_bits(ra, rb):
                continue
            u = _unit(step, ra, rb, rank, tol)
            key_ = (rb.get("micro_batch", 0), _phase_order("loss"), "loss", rank, 0, "loss")
            rs.add(key_, u)


def _compare_logical_tensors(
    step, recs_a, batches_a, recs_b, batches_b, tol, ev: StepWarnings
) -> dict[int, _RankStep]:
    if batches_a is not None and batches_b is not None:
        out = _compare_logical_step_columns(step, batches_a, batches_b, tol, ev)
        if out is not None:
            return out
    if batches_a is not None:
        recs_a = {r: trajectory.to_records(x) for r, x in batches_a.items()}
    if batches_b is not None:
        recs_b = {r: trajectory.to_records(x) for r, x in batches_b.items()}
    la = _logicals(recs_a, CROSS_TOPOLOGY_PHASES)
    lb = _logicals(recs_b, CROSS_TOPOLOGY_PHASES)
    pa, pb = {p for p, _ in la}, {p for p, _ in lb}
    ev.both.update(pa & pb)
    for p in pa ^ pb:  # a phase one side does not record at all: nothing to compare it with
        side = "A" if p not in pa else "B"
        ev.phase(p, f"run {side} records no '{p}' phase: that phase is not compared")
    out: dict[int, _RankStep] = {}

    def rank_step(r: int) -> _RankStep:
        if r not in out:
            out[r] = _RankStep()
        return out[r]

    for phase, name in sorted(la.keys() | lb.keys(), key=lambda k: (_phase_order(k[0]), k)):
        if phase not in pa or phase not in pb:
            continue
        xa, xb = la.get((phase, name)), lb.get((phase, name))
        va = xa.value() if xa else None
        vb = xb.value() if xb else None
        units: list[tuple[int, dict | None, dict | None]] = []  # (rank, value a, value b)
        if va and vb and xb is not None and not any("shard" in r for r in xb.recs):
            units = [
                (r.get("rank", 0), va[0], r) for r in xb.recs
            ]  # every replica on B against A's value
        else:
            rank = vb[1] if vb else va[1]
            units = [(rank, va[0] if va else None, vb[0] if vb else None)]
        # replicas inside one run must be bit-identical; B's whole-tensor replicas are compared one by one
        # above, the others (A's, and replicated shards on either side) are only represented by the lowest rank
        for side, x in (("A", xa), ("B", xb)):
            if x is None or (side == "B" and len(units) > 1):
                continue
            for r, r0 in _replica_mismatches(x.recs):
                if ev.wants("replica"):
                    ev.capped(
                        "replica",
                        f"run {side}: step {step} {phase} {name}: rank {r.get('rank')}'s copy differs "
                        f"from rank {r0.get('rank')}'s (replicas should be bit-identical)",
                    )
        for side, v in (("A", va), ("B", vb)):
            if v is not None and not v[2] and ev.wants("cover"):
                ev.capped(
                    "cover",
                    f"run {side}: step {step} {phase} {name}: the shards do not cover the logical shape",
                )
        for rank, ra, rb in units:
            rs = rank_step(rank)
            rs.total += 1
            if ra is not None and rb is not None and _same_bits(ra, rb):
                continue
            u = _unit(step, ra, rb, rank, tol, logical=True)
            incomplete = [s for s, v in (("a", va), ("b", vb)) if v is not None and not v[2]]
            if incomplete:
                u.diverged, u.note = True, f"shards incomplete in {incomplete[0]}"
            ref = rb if rb is not None else ra
            key = (
                ref.get("micro_batch", 0),
                _phase_order(phase),
                phase,
                rank,
                ref.get("index", 0),
                name,
            )
            rs.add(key, u)
    return out


_CROSS = pa.array(CROSS_TOPOLOGY_PHASES, pa.string())
_SEP = pa.scalar(
    "\x00", pa.string()
)  # joins phase and name into one key (typed: no type inference per call)


def _phase_rows(batches: dict[int, pa.RecordBatch]):
    """One side's records of one step in the cross-topology phases, rank by rank, as one batch; None when a
    tensor is sharded (combining shards into the logical tensor is the record path's)."""
    parts = [
        b.filter(pc.is_in(b.column("phase"), value_set=_CROSS))
        for _, b in sorted(batches.items())
        if b is not None
    ]
    x = (
        pa.concat_batches(parts)
        if parts
        else pa.RecordBatch.from_pylist([], schema=trajectory.SCHEMA)
    )
    return x if x.column("shard_offset").null_count == x.num_rows else None


def _compare_logical_step_columns(
    step: int,
    batches_a: dict,
    batches_b: dict,
    tol: _Tol,
    ev: StepWarnings,
) -> dict[int, _RankStep] | None:
    """_compare_logical_step column-wise, for tensors that are whole on every rank (replicas: A's lowest
    rank's copy is the logical value, each of B's copies is compared with it); None hands the step to the
    record path (a sharded tensor on either side)."""
    xa, xb = _phase_rows(batches_a), _phase_rows(batches_b)
    if xa is None or xb is None:
        return None
    pa_, pb_ = (
        set(pc.unique(xa.column("phase")).to_pylist()),
        set(pc.unique(xb.column("phase")).to_pylist()),
    )
    ev.both.update(pa_ & pb_)
    for p in sorted(pa_ ^ pb_, key=lambda p: (_phase_order(p), p)):
        ev.phase(
            p,
            f"run {'A' if p not in pa_ else 'B'} records no '{p}' phase: that phase is not compared",
        )
    if pa_ != pb_:
        both = pa.array(sorted(pa_ & pb_), pa.string())
        xa = xa.filter(pc.is_in(xa.column("phase"), value_set=both))
        xb = xb.filter(pc.is_in(xb.column("phase"), value_set=both))
    key_a = pc.binary_join_element_wise(xa.column("phase"), xa.column("tensor"), _SEP)
    key_b = pc.binary_join_element_wise(xb.column("phase"), xb.column("tensor"), _SEP)
    logical_a = pc.unique(
        key_a
    )  # in order of first appearance: rank order, so each key's lowest rank
    first_a = np.asarray(
        pc.index_in(logical_a, value_set=key_a).to_numpy(zero_copy_only=False), dtype=np.int64
    )
    _replica_warnings(xa, key_a, xb, key_b, logical_a, ev)
    match = pc.index_in(key_b, value_set=logical_a)
    matched = np.asarray(match.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    in_b = np.asarray(
        pc.is_in(logical_a, value_set=key_b).to_numpy(zero_copy_only=False), dtype=bool
    )
    out: dict[int, _RankStep] = {}
    ranks_b = xb.column("rank").to_numpy(zero_copy_only=False)
    a_row = np.full(xb.num_rows, -1, dtype=np.int64)
    a_row[matched] = first_a[
        np.asarray(match.filter(match.is_valid()).to_numpy(zero_copy_only=False), dtype=np.int64)
    ]
    for rank in np.unique(ranks_b).tolist():
        rows = np.nonzero(matched & (ranks_b == rank))[0]
        if rows.size:
            rs = out.setdefault(rank, _RankStep())
            rs.total += len(rows)
            _fold_columns(
                [step],
                rank,
                columnar.Columns(xa.take(pa.array(a_row[rows]))),
                columnar.Columns(xb.take(pa.array(rows))),
                np.zeros(1, dtype=np.int64),
                tol,
                [rs],
                logical=True,
            )
    # a logical tensor one side lacks: the record path's unit (missing_in), at its holder's rank
    lone = []
    if (~matched).any():  # one unit per logical tensor, at B's lowest rank holding it
        only_b = xb.take(pa.array(np.nonzero(~matched)[0]))
        keys = pc.binary_join_element_wise(only_b.column("phase"), only_b.column("tensor"), _SEP)
        lone.append(("b", only_b.take(pc.index_in(pc.unique(keys), value_set=keys))))
    if (~in_b).any():
        lone.append(("a", xa.take(pa.array(first_a[~in_b]))))
    for side, recs in lone:
        for r in trajectory.to_records(recs):
            rank = r["rank"]
            u = _unit(
                step,
                r if side == "a" else None,
                r if side == "b" else None,
                rank,
                tol,
                logical=True,
            )
            rs = out.setdefault(rank, _RankStep())
            rs.total += 1
            rs.add(
                (
                    r.get("micro_batch", 0),
                    _phase_order(r["phase"]),
                    r["phase"],
                    rank,
                    r.get("index", 0),
                    r["tensor"],
                ),
                u,
            )
    return out


def _replica_mismatch_rows(side: str, x, keys) -> list[tuple]:
    """Copies of one tensor in `x` (rank order) that differ from its lowest rank's copy (replicas must be
    bit-identical): (sort key, warning) each, the record path's order and wording."""
    logical = pc.unique(keys)
    if x.num_rows == len(logical):
        return []
    first = np.asarray(
        pc.index_in(logical, value_set=keys).to_numpy(zero_copy_only=False), dtype=np.int64
    )
    of_key = np.asarray(
        pc.index_in(keys, value_set=logical).to_numpy(zero_copy_only=False), dtype=np.int64
    )
    ref = x.take(pa.array(first[of_key]))
    cx, cr = columnar.Columns(x), columnar.Columns(ref)
    same = columnar.same_bits(cx, cr)
    odd = np.nonzero(~same)[0]
    if not odd.size:
        return []
    out = []
    for r, r0 in zip(
        trajectory.to_records(x.take(pa.array(odd))), trajectory.to_records(ref.take(pa.array(odd)))
    ):
        out.append(
            (
                (_phase_order(r["phase"]), r["phase"], r["tensor"], side, r["rank"]),
                f"run {side}: step {r['step']} {r['phase']} {r['tensor']}: rank {r.get('rank')}'s copy differs "
                f"from rank {r0.get('rank')}'s (replicas should be bit-identical)",
            )
        )
    return out


def _replica_warnings(xa, key_a, xb, key_b, logical_a, ev: StepWarnings) -> None:
    """A's replicas, and B's of the tensors A lacks (B's other copies are each compared with A's value)."""
    found = _replica_mismatch_rows("A", xa, key_a)
    only_b = ~np.asarray(
        pc.is_in(key_b, value_set=logical_a).to_numpy(zero_copy_only=False), dtype=bool
    )
    if only_b.any():
        rows = pa.array(np.nonzero(only_b)[0])
        found += _replica_mismatch_rows("B", xb.take(rows), key_b.take(rows))
    for _, text in sorted(found, key=lambda f: f[0]):
        if ev.wants("replica"):
            ev.capped("replica", text)


# ---------------------------------------------------------------- the comparison


def _compared_steps(a: _Side, b: _Side) -> tuple[list[int], ComparedSteps]:
    common = sorted(set(a.steps) & set(b.steps))
    n_total = int(get_field(a.manifest, "training.steps") or 0)
    why: list[str] = []
    for s in (a, b):
        if not s.steps:
            why.append(f"run {s.label} has no complete step")
            continue
        first, last = s.steps[0], s.steps[-1]
        every = max(
            1, int(get_field(s.manifest, "record.every") or 1)
        )  # it digests steps every, 2*every, ...
        if every > 1:
            why.append(f"run {s.label} records one step in {every} (record.every)")
        if first > every:
            if s.kind == "recovered" or s.resume_step:
                why.append(
                    f"run {s.label} is a recovered run resumed from the checkpoint of step "
                    f"{s.resume_step or first - 1}: its records start at step {first}"
                )
            else:
                why.append(f"run {s.label} has no records before step {first}")
        if n_total and last < n_total - n_total % every:
            if not s.complete:
                why.append(f"run {s.label} is incomplete: stops at step {last}")
            else:
                why.append(f"run {s.label} stops at step {last} of {n_total}")
        gaps = sorted({x for x in range(first, last + 1) if x % every == 0} - set(s.steps))
        if gaps:
            why.append(f"run {s.label} lacks step(s) {ranges(gaps)}")
    if not common:
        raise BadInput(
            f"{a.path} vs {b.path}",
            "the runs share no step to compare" + (f" ({'; '.join(why)})" if why else ""),
        )
    if not why:
        why.append(f"all {len(common)} steps")
    return common, ComparedSteps(
        first=common[0],
        last=common[-1],
        count=len(common),
        why="; ".join(why),
        full=bool(n_total) and len(common) == n_total,
    )


def _agreed_since(x: _Side, other: _Side) -> int:
    """The step at which x last held the other run's state: its resume step when it resumed from a
    checkpoint inside the other run's directory; else 0 (both started from the same initial state)."""
    if not x.resume_step or not x.resume_checkpoint:
        return 0
    ck = Path(str(x.resume_checkpoint))
    for cand in (
        [ck]
        if ck.is_absolute()
        else [x.path / ck, x.path.parent / ck, x.path.parent.parent / ck, ck]
    ):
        try:
            cand.resolve().relative_to(other.path.resolve())
            return x.resume_step
        except ValueError:
            continue
    return 0


def _choose_mode(side_a: _Side, side_b: _Side, mode: str | None, rtol, atol, warnings: list[str]):
    """bitwise when the topologies are equal and no explicit bound is given, else numeric; refuses a bitwise
    comparison across topologies and bad bounds. Returns (mode, the topology fields that differ)."""
    ma, mb = side_a.manifest, side_b.manifest
    topo = _field_diffs(ma, mb, TOPOLOGY_FIELDS) + observed_topology_differences(
        side_a.run.lock, side_b.run.lock
    )
    algorithm = [
        (k, x, y)
        for k, x, y in _field_diffs(ma, mb, ("parallelism.architecture", "parallelism.staleness"))
        if (k != "parallelism.architecture" and (x or y))  # an attached run states no staleness: 0
        or ma.get("parallelism", {}).get("staleness")
        or mb.get("parallelism", {}).get("staleness")
    ]
    if algorithm:
        warnings.append(
            "different algorithms, not a bug: "
            + "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in algorithm)
            + " (a stale parameter server computes other updates; "
            "a divergence here is expected)"
        )
    if mode is None:
        mode = "bitwise" if not topo and rtol is None and atol is None else "numeric"
    if mode not in MODES:
        raise BadInput(
            "--mode", f"unknown mode {mode!r}; use one of {', '.join(MODES)}", field="mode"
        )
    if mode == "bitwise" and topo:
        raise BadInput(
            side_b.path / LOCK,
            "a bitwise comparison needs the same topology, and these differ: "
            + "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in topo)
            + " (compare them numerically)",
            field=", ".join(k for k, _, _ in topo),
        )
    if mode == "bitwise" and (rtol is not None or atol is not None):
        warnings.append("rtol/atol are ignored in bitwise mode")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise BadInput(f"--{name}", f"must be a finite number >= 0 (got {v!r})", field=name)
    return mode, topo


def _load_calibration(path, side_a: _Side, side_b: _Side):
    from disttrace.analysis.calibration import Calibration

    cal = Calibration(path)
    if cal.manifest_id not in (side_a.run.manifest_id, side_b.run.manifest_id):
        raise BadInput(
            cal.path,
            f"calibrates manifest {cal.manifest_id[:12]}, neither run A's "
            f"({str(side_a.run.manifest_id)[:12]}) nor B's ({str(side_b.run.manifest_id)[:12]})",
            field="manifest_id",
        )
    return cal


CALIBRATION = "calibration.json"


def _found_calibration(side_a: _Side, side_b: _Side) -> Path | None:
    """The reference's own measured noise, used by default: `disttrace calibrate` writes calibration.json
    beside the runs of its manifest (runs/<id12>/), so a reference carries it; A's first, then B's. A file
    there that calibrates another manifest is not this run's and is left alone."""
    from disttrace.analysis.calibration import KIND

    for side in (side_a, side_b):
        p = side.path.parent / CALIBRATION
        if not p.is_file():
            continue
        try:  # beside the run, in its runs/<id12>/: read as a store's file is (store/safeio.py)
            doc = orjson.loads(safeio.read_bytes(p, p.parent, "json"))
        except orjson.JSONDecodeError:
            raise BadInput(p, "not valid JSON (a calibration beside the run)") from None
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            if doc.get("manifest_id") == side.run.manifest_id:
                return p
    return None


# records a block of steps may hold, per side: of one rank where ranks are compared one after another (a few MB
# of columns), of all ranks where a step's ranks are read together (across topologies)
BLOCK_ROWS = 1 << 14


def _block(steps: list[int], n: int, ranks, sides: tuple[_Side, _Side], rows: int) -> list[int]:
    """steps[n:] as far as `rows` records of any one rank of either side reach, at least one step."""
    out, total = [], 0
    for step in steps[n:]:
        total += max(  # a rank's steps are decoded and compared together, one rank after another
            max((int((side.entry(r, step) or {}).get("records") or 0) for r in ranks), default=0)
            for side in sides
        )
        if out and total > rows:
            break
        out.append(step)
    return out


def _compare_block(
    block: list[int], ranks, side_a: _Side, side_b: _Side, tol: _Tol
) -> dict[int, tuple[dict, int]]:
    """Same topology, steps `block`, rank by rank: ({rank: _RankStep}, ranks read) per step. A rank whose index
    digests agree is skipped undecoded when its raw bytes are the same on both sides (each side's bytes also
    checked against the hash it was indexed with): a digest in the index is the writer's word, equal bytes are
    equal records whoever wrote the index. A rank's steps that are read are decoded together (one batch a
    side) and, where they align row by row, compared in one column-wise call (a step's fixed cost of numpy
    and Arrow calls is paid once per block, not once per step and rank); each step's result is what it would
    be alone."""
    per = {s: {} for s in block}
    read = dict.fromkeys(block, 0)
    for r in ranks:
        todo = []
        agree = []  # steps whose index digests agree: skipped if their bytes are the same on both sides
        for s in block:
            ea, eb = side_a.entry(r, s), side_b.entry(r, s)
            if (
                ea is not None
                and eb is not None
                and ea.get("digest") is not None
                and ea.get("digest") == eb.get("digest")
                and ea.get("records") == eb.get("records")
            ):
                agree.append(s)
        same = set()
        if (
            agree
        ):  # each side's steps read together, checked step by step (a refusal names the first)
            for s, da, db in zip(agree, side_a.raw_steps(r, agree), side_b.raw_steps(r, agree)):
                if side_a.checked(r, s, da) == side_b.checked(r, s, db):
                    same.add(s)
        for s in block:
            if s in same:
                per[s][r] = _RankStep(int(side_a.entry(r, s).get("records") or 0))
                continue
            read[s] += 1
            todo.append(s)
        if not todo:
            continue
        if not all(
            trajectory.is_arrow(x.traj_path(r)) and all(x.entry(r, s) is not None for s in todo)
            for x in (side_a, side_b)
        ):  # a JSON-lines side, or a step one side lacks: step by step
            for s in todo:
                per[s][r] = _compare_step_alone(s, r, side_a, side_b, tol)
            continue
        (ba, starts_a), (bb, starts_b) = side_a.batches(r, todo), side_b.batches(r, todo)
        ca, cb = columnar.Columns(ba), columnar.Columns(bb)
        if (
            len(todo) > 1
            and np.array_equal(starts_a, starts_b)
            and columnar.aligned_block(ca, cb, starts_a)
        ):
            out = [_RankStep(n) for n in np.diff(np.append(starts_a, ba.num_rows)).tolist()]
            _fold_columns(todo, r, ca, cb, starts_a, tol, out)
            for s, rs in zip(todo, out):
                per[s][r] = rs
            continue
        # one step, or a block in which some step does not align: one by one
        ends_a, ends_b = np.append(starts_a[1:], ba.num_rows), np.append(starts_b[1:], bb.num_rows)
        for j, s in enumerate(todo):
            sa = ba.slice(int(starts_a[j]), int(ends_a[j] - starts_a[j]))
            sb = bb.slice(int(starts_b[j]), int(ends_b[j] - starts_b[j]))
            per[s][r] = _compare_rank_step_columns(s, r, sa, sb, tol)
    return {s: (per[s], read[s]) for s in block}


def _compare_step_alone(s: int, r: int, side_a: _Side, side_b: _Side, tol: _Tol) -> _RankStep:
    """One rank's step on the record path, where a side is JSON lines (a side decoded is not read again)."""
    ba, bb = side_a.batch(r, s), side_b.batch(r, s)
    if ba is not None and bb is not None:
        return _compare_rank_step_columns(s, r, ba, bb, tol)
    return _compare_rank_step(
        s,
        r,
        trajectory.to_records(ba) if ba is not None else side_a.records(r, s),
        trajectory.to_records(bb) if bb is not None else side_b.records(r, s),
        tol,
    )


def _worst_by_phase(by_phase: dict[str, PhaseWorst], step: int, per_rank: dict, tol: _Tol) -> None:
    """Numeric mode: keep, per phase, the largest relative error seen and the largest error-to-bound ratio."""
    for r, rs in per_rank.items():
        if rs.first is None and rs.inexact == 0:
            continue
        for phase, rel in rs.max_rel.items():
            cur = by_phase.setdefault(phase, PhaseWorst())
            if rel > cur.max_rel_err:
                bnd = None if tol.user else rs.max_rel_bound.get(phase, tol.derived(step, phase))
                cur.max_rel_err, cur.bound, cur.ratio = rel, bnd, rel / bnd if bnd else None
                cur.step, cur.rank, cur.bound_kind = step, r, BoundKind(tol.kind(step, phase))
        for phase, (ratio, rel, bnd) in rs.ratio_by_phase.items():
            cur = by_phase[phase]
            if cur.max_ratio is None or ratio > cur.max_ratio:
                cur.max_ratio, cur.max_ratio_at = ratio, WorstRatio(step, r, rel, bnd)


def _tolerance_doc(
    mode: str, tol: _Tol, cal, since: int, ma: dict, mb: dict, rtol, atol, found: bool = False
) -> Tolerance:
    """What the comparison was held to, for the result (and the views that print the bound)."""
    if mode == "bitwise":
        return Tolerance(BoundKind.BITWISE, bound=0.0)
    if tol.user:
        return Tolerance(BoundKind.USER, rtol=rtol or 0.0, atol=atol or 0.0)
    if cal is not None:
        return Tolerance(
            BoundKind.CALIBRATED,
            file=str(cal.path),
            safety=cal.doc.get("safety"),
            manifest_id=cal.manifest_id,
            elsewhere="derived",
            since_step=since,
            derivation=tolerance.explain(ma, mb, tol.observed),
            scale="magnitudes" if tol.mags is not None else "norm",
            found=found,
        )
    return Tolerance(
        BoundKind.DERIVED,
        since_step=since,
        derivation=tolerance.explain(ma, mb, tol.observed),
        scale="magnitudes" if tol.mags is not None else "norm",
    )


class StepOutcome:
    """One compared step as the fold reads it: each rank's result (in the order the comparison produced
    them), the (step, rank) pairs read, each side's [records parsed, ranges hash-checked], the warnings the
    step raised, the phases both runs record (across topologies), and where the bounds come from (`look`:
    `.user`, `.kind(step, phase, name)`, `.compare_bound(step, phase)`, `.derived(step, phase)`; the
    comparison's `_Tol` in the process that compared it, a table of the same answers in a merge)."""

    __slots__ = ("step", "per_rank", "read", "io", "events", "both", "look")

    def __init__(self, step, per_rank, read, io, events, both, look):
        self.step, self.per_rank, self.read, self.io = step, per_rank, read, io
        self.events, self.both, self.look = events, both, look


class _Fold:
    """The result's step-wise parts, from the compared steps in order: the first divergence, propagation,
    recovered steps, numeric summary, counts, and the comparison's warnings."""

    def __init__(self, mode: str, warnings: list[str]):
        self.mode = mode
        self.first_div: Divergence | None = None
        self.first_step: int | None = None
        self.propagation: list[StepEntry] = []
        self.recovered: list[int] = []
        self.by_step: list[
            StepEntry
        ] = []  # numeric: per-step errors of steps before the first divergence
        self.by_phase: dict[str, PhaseWorst] = {}
        self.n_units = self.n_exact = 0
        self.read_steps = 0
        self.records = [0, 0]
        self.hashed = 0
        self.warned = Warned(warnings)

    def add(self, o: StepOutcome) -> bool:
        """Fold one step in; True once the first divergence has been seen."""
        step, per_rank, look = o.step, o.per_rank, o.look
        self.read_steps += o.read
        (ra, ha), (rb, hb) = o.io
        self.records[0] += ra
        self.records[1] += rb
        self.hashed += ha + hb
        self.warned.replay(o.events, o.both)
        for rs in per_rank.values():
            self.n_units += rs.total
            self.n_exact += rs.total - rs.inexact
        if self.mode == "numeric":
            _worst_by_phase(self.by_phase, step, per_rank, look)
        diverged_here = [rs for rs in per_rank.values() if rs.differing]
        if self.first_step is None and diverged_here:
            self.first_step = step
            key, unit = min((rs.first for rs in diverged_here), key=lambda fu: fu[0])
            self.first_div = Divergence.of_unit(
                unit, BoundKind(look.kind(step, unit.phase, unit.tensor))
            )
        entry = StepEntry(
            step=step,
            equal=not diverged_here,
            differing=sum(rs.differing for rs in per_rank.values()),
            ranks={r: per_rank[r].entry() for r in sorted(per_rank)},
        )
        if self.mode == "numeric":  # the bound each phase's errors at this step are held to
            phases = sorted({p for rs in per_rank.values() for p in rs.max_rel}, key=_phase_order)
            entry.bound_by_phase = {p: look.compare_bound(step, p) for p in phases}
            entry.bound_kind_by_phase = {p: BoundKind(look.kind(step, p)) for p in phases}
        if self.first_step is not None:
            self.propagation.append(entry)
            if not diverged_here:
                self.recovered.append(step)
            return True
        if self.mode == "numeric" and any(rs.inexact for rs in per_rank.values()):
            self.by_step.append(entry)
        return False


class _Setup:
    """Both sides read and checked, the mode chosen, the steps and the bound settled: what comparing any
    rank's steps needs. `only` restricts the ranks read (a partial diff, one process of `--jobs`)."""

    def __init__(
        self,
        a,
        b,
        mode,
        rtol,
        atol,
        allow_edition_mismatch,
        use_index,
        calibration,
        find_calibration,
        only: set[int] | None = None,
        compare: bool = True,
    ):
        self.warnings = warnings = []
        self.side_a = side_a = _Side("A", a, use_index, warnings, only)
        self.side_b = side_b = _Side("B", b, use_index, warnings, only)
        _check_compatible(side_a, side_b, allow_edition_mismatch, warnings)
        self.n_pre = len(warnings)
        side_a.load()
        side_b.load()
        if only is not None:  # a side that holds none of these ranks does not limit their steps
            for x, y in ((side_a, side_b), (side_b, side_a)):
                if not x.ranks and x.all_ranks:
                    x.steps = y.steps
        self.n_loaded = len(warnings)
        self.rtol, self.atol, self.use_index = rtol, atol, use_index
        self.ma, self.mb = ma, mb = side_a.manifest, side_b.manifest
        self.mode, self.topo = _choose_mode(side_a, side_b, mode, rtol, atol, warnings)
        self.n_setup = len(warnings)
        self.same_topology = not self.topo
        self.logical = self.mode == "numeric" and not self.same_topology
        self.ranks = sorted(set(side_a.ranks) | set(side_b.ranks))  # the ranks compared here
        all_ranks = sorted(set(side_a.all_ranks) | set(side_b.all_ranks))
        self.grid_ranks = sorted(side_b.all_ranks) if self.logical else all_ranks
        if not compare:
            return
        self.steps, self.compared = _compared_steps(side_a, side_b)
        self.since = since = max(_agreed_since(side_b, side_a), _agreed_since(side_a, side_b))
        found = False
        if (
            calibration is None
            and find_calibration
            and self.mode == "numeric"
            and rtol is None
            and atol is None
        ):
            calibration = _found_calibration(side_a, side_b)
            found = calibration is not None
        self.calibration, self.found = calibration, found
        cal = _load_calibration(calibration, side_a, side_b) if calibration is not None else None
        from disttrace.analysis.magnitudes import Magnitudes

        mags = (
            (Magnitudes(side_a.run, since), Magnitudes(side_b.run, since))
            if self.mode == "numeric" and rtol is None and atol is None
            else None
        )
        # each lock's `observed` (attached runs count their batch: the reduction size of the bound)
        observed = tuple(
            o if isinstance(o := s.run.lock.get("observed"), dict) else None
            for s in (side_a, side_b)
        )
        self.tol = tol = _Tol(self.mode, ma, mb, rtol, atol, since, cal, mags, observed)
        if tol.ignored_calibration is not None:
            warnings.append(
                f"calibration {tol.ignored_calibration.path} not used: its noise was measured against the "
                "magnitudes, and these runs do not both record them (derived bounds instead)"
            )
            self.n_setup = len(
                warnings
            )  # a warning of the setup: every share of a partial diff says it
        self.tolerance = _tolerance_doc(self.mode, tol, tol.cal, since, ma, mb, rtol, atol, found)

    def outcomes(self, steps: list[int], propagate: bool = True, on_step=None):
        """StepOutcome of each of `steps`, in order, computed as they are asked for (a block of steps at once
        where the topologies are the same; one at a time when the first divergent step ends the comparison)."""
        side_a, side_b, tol, ranks = self.side_a, self.side_b, self.tol, self.ranks
        if (
            self.logical and propagate
        ):  # every step read, every rank of a step: a block of steps a rank
            side_a.read_along(steps, BLOCK_ROWS)
            side_b.read_along(steps, BLOCK_ROWS)
        ahead: dict = {}  # steps compared ahead of the loop (a block)
        nothing = [0, 0]
        for n, step in enumerate(steps):
            if on_step is not None:
                on_step(n, len(steps))
            ev = StepWarnings()
            if self.logical:
                per_rank = _compare_logical_step(step, side_a, side_b, tol, ev)
                read = 1
            else:
                if step not in ahead:
                    ahead = _compare_block(
                        _block(steps, n, ranks, (side_a, side_b), BLOCK_ROWS if propagate else 0),
                        ranks,
                        side_a,
                        side_b,
                        tol,
                    )
                per_rank, read = ahead.pop(step)
            io = (side_a.io.get(step, nothing), side_b.io.get(step, nothing))
            yield StepOutcome(step, per_rank, read, io, ev.events, ev.both, tol)


def _result(
    fold: _Fold,
    *,
    mode: str,
    a: SideSummary,
    b: SideSummary,
    topo_differs: list[str],
    compared: ComparedSteps,
    ranks: list[int],
    tolerance: Tolerance,
    use_index: bool,
    warnings: list[str],
    logical: bool,
) -> DiffResult:
    return DiffResult(
        equal=fold.first_div is None,
        mode=mode,
        a=a,
        b=b,
        topology=TopologyComparison(same=not topo_differs, differs=list(topo_differs)),
        compared_steps=compared,
        ranks=ranks,
        first_divergence=fold.first_div,
        propagation=fold.propagation,
        recovered_steps=fold.recovered,
        tolerance=tolerance,
        stats=DiffStats(
            tensors_compared=fold.n_units,
            bit_equal=fold.n_exact,
            steps_read=fold.read_steps,
            index=use_index,
            steps_hash_checked=fold.hashed,
        ),
        records_read=RecordsRead(a=fold.records[0], b=fold.records[1]),
        warnings=warnings,
        compared_phases=[p for p in CROSS_TOPOLOGY_PHASES if p in fold.warned.both]
        if logical
        else None,
        numeric=NumericSummary(
            by_phase=dict(sorted(fold.by_phase.items(), key=lambda kv: _phase_order(kv[0]))),
            by_step=fold.by_step,
        )
        if mode == "numeric"
        else None,
    )


def diff_runs(
    a: str | Path,
    b: str | Path,
    mode: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    allow_edition_mismatch: bool = False,
    *,
    use_index: bool = True,
    propagate: bool = True,
    on_step=None,
    calibration: str | Path | None = None,
    find_calibration: bool = True,
    jobs: int = 1,
) -> DiffResult:
    """Compare run `b` against run `a`; `.to_json()` of the result is the `diff --json` document.

    mode: None (bitwise when the topologies are equal and no rtol/atol is given, else numeric), "bitwise"
    or "numeric". rtol/atol replace the derived tolerance (a missing one counts as 0).
    use_index=False ignores the step digests and reads every record (the bench's baseline).
    propagate=False stops at the first divergent step (propagation then holds that step only).
    on_step(done, total), if given, is called before each compared step (a progress display).
    calibration: a `disttrace calibrate` file of A's or B's manifest; its measured bounds replace the derived
    ones where it has them (each bound in the result says `bound_kind`: derived, calibrated or none). Without
    it, a calibration of A's (else B's) manifest beside the run (`calibrate` writes runs/<id12>/
    calibration.json) is used, unless find_calibration=False.
    jobs > 1 compares in that many processes (analysis/partial.py: ranks split between them where the
    topologies are the same, steps across topologies); the result is the one this process would return.
    Raises BadInput (exit 2) for unreadable or incompatible runs.
    """
    if jobs != 1:
        from disttrace.analysis import partial

        if not propagate:
            raise BadInput("--jobs", "needs the whole propagation (propagate=True)", field="jobs")
        return partial.diff_jobs(
            a,
            b,
            jobs,
            mode=mode,
            rtol=rtol,
            atol=atol,
            allow_edition_mismatch=allow_edition_mismatch,
            use_index=use_index,
            calibration=calibration,
            find_calibration=find_calibration,
        )
    st = _Setup(
        a, b, mode, rtol, atol, allow_edition_mismatch, use_index, calibration, find_calibration
    )
    fold = _Fold(st.mode, st.warnings)
    for o in st.outcomes(st.steps, propagate, on_step):
        if fold.add(o) and not propagate:
            break
    return _result(
        fold,
        mode=st.mode,
        a=st.side_a.describe(),
        b=st.side_b.describe(),
        topo_differs=[k for k, _, _ in st.topo],
        compared=st.compared,
        ranks=st.grid_ranks,
        tolerance=st.tolerance,
        use_index=use_index,
        warnings=st.warnings,
        logical=st.logical,
    )
