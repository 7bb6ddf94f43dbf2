"""Across topologies: the logical tensors of a step (shards combined by their offsets, replicas held to
their lowest rank's copy), compared record by record or column-wise (a step with sharded tensors through
shards.py), the losses of micro-batches that hold the same samples, and the warnings a step raises
(`StepWarnings`, replayed in step order by `Warned`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import columnar, updates
from disttrace.analysis.diff.compare import (
    RankStep,
    _fold_columns,
    _phase_order,
    _unit,
)
from disttrace.analysis.diff.shards import _compare_sharded_columns, _Logical
from disttrace.analysis.diff.side import Side
from disttrace.analysis.diff.tol import _same_bits, _Tol
from disttrace.store import trajectory, trajectory_read

# Across topologies only these phases hold the same logical tensors: the global (reduced) gradient, the
# clipped gradient, and parameters + optimizer state after the step. Per-micro-batch activations and
# local gradients depend on how the batch was split.
CROSS_TOPOLOGY_PHASES = ("reduce", "clip", "optimizer")
MAX_WARNINGS_OF_A_KIND = 5


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


def _step_records(side: Side, step: int) -> tuple[dict[int, list[dict]], dict | None]:
    """(records by rank, Arrow batches by rank when every rank's trajectory is an Arrow stream)."""
    if side.ranks and all(trajectory_read.is_arrow(side.traj_path(r)) for r in side.ranks):
        batches = {r: side.batch(r, step) for r in side.ranks if side.has(r, step)}
        return {}, batches
    return {r: side.records(r, step) for r in side.ranks}, None


def _compare_logical_step(
    step: int, a: Side, b: Side, tol: _Tol, ev: StepWarnings
) -> dict[int, RankStep]:
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
            r: trajectory_read.to_records(_of_phases(b, want))
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
            rs = out.setdefault(rank, RankStep())
            rs.total += 1
            if _same_bits(ra, rb):
                continue
            u = _unit(step, ra, rb, rank, tol)
            key_ = (rb.get("micro_batch", 0), _phase_order("loss"), "loss", rank, 0, "loss")
            rs.add(key_, u)


def _compare_logical_tensors(
    step, recs_a, batches_a, recs_b, batches_b, tol, ev: StepWarnings
) -> dict[int, RankStep]:
    if batches_a is not None and batches_b is not None:
        out = _compare_logical_step_columns(step, batches_a, batches_b, tol, ev)
        if out is not None:
            return out
    if batches_a is not None:
        recs_a = {r: trajectory_read.to_records(x) for r, x in batches_a.items()}
    if batches_b is not None:
        recs_b = {r: trajectory_read.to_records(x) for r, x in batches_b.items()}
    la = _logicals(recs_a, CROSS_TOPOLOGY_PHASES)
    lb = _logicals(recs_b, CROSS_TOPOLOGY_PHASES)
    pa, pb = {p for p, _ in la}, {p for p, _ in lb}
    ev.both.update(pa & pb)
    for p in pa ^ pb:  # a phase one side does not record at all: nothing to compare it with
        side = "A" if p not in pa else "B"
        ev.phase(p, f"run {side} records no '{p}' phase: that phase is not compared")
    out: dict[int, RankStep] = {}

    def rank_step(r: int) -> RankStep:
        if r not in out:
            out[r] = RankStep()
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
        _warn_copies(f"step {step} {phase} {name}", (xa, xb), (va, vb), len(units) > 1, ev)
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


def _warn_copies(where: str, logicals, values, b_compared: bool, ev: StepWarnings) -> None:
    """A logical tensor's copies that differ inside one run (replicas must be bit-identical) and shards that
    do not cover it. B's whole-tensor replicas are compared one by one (`b_compared`); the others (A's, and
    replicated shards on either side) are only represented by the lowest rank, so they are checked here."""
    for side, x in zip("AB", logicals):
        if x is None or (side == "B" and b_compared):
            continue
        for r, r0 in _replica_mismatches(x.recs):
            if ev.wants("replica"):
                ev.capped(
                    "replica",
                    f"run {side}: {where}: rank {r.get('rank')}'s copy differs "
                    f"from rank {r0.get('rank')}'s (replicas should be bit-identical)",
                )
    for side, v in zip("AB", values):
        if v is not None and not v[2] and ev.wants("cover"):
            ev.capped("cover", f"run {side}: {where}: the shards do not cover the logical shape")


_CROSS = pa.array(CROSS_TOPOLOGY_PHASES, pa.string())
_SEP = pa.scalar(
    "\x00", pa.string()
)  # joins phase and name into one key (typed: no type inference per call)


def _of_phases(b: pa.RecordBatch, phases: pa.Array) -> pa.RecordBatch:
    """The rows of `b` in `phases`, in order: a slice where they lie together (a step's records are
    written phase by phase: no copy), else taken."""
    rows = np.flatnonzero(
        np.asarray(pc.is_in(b.column("phase"), value_set=phases).to_numpy(zero_copy_only=False))
    )
    if len(rows) and rows[-1] - rows[0] + 1 == len(rows):
        return b.slice(int(rows[0]), len(rows))
    return b.take(pa.array(rows, pa.int64()))


def _phase_rows(batches: dict[int, pa.RecordBatch]):
    """One side's records of one step in the cross-topology phases, rank by rank, as one batch; None where a
    name is missing (the record path's)."""
    parts = [_of_phases(b, _CROSS) for _, b in sorted(batches.items()) if b is not None]
    x = (
        pa.concat_batches(parts)
        if parts
        else pa.RecordBatch.from_pylist([], schema=trajectory.SCHEMA)
    )
    return x if x.column("tensor").null_count == 0 else None


def _paired_updates(
    xa: pa.RecordBatch, xb: pa.RecordBatch
) -> tuple[pa.RecordBatch, pa.RecordBatch]:
    """The two sides without the update records (run/record/updates.py) the other side does not make (a sharded
    parameter's, a store's written before them): those are not compared, and are left out here as whole
    columns rather than met one record at a time."""
    ua, ub = (pc.ends_with(x.column("tensor"), updates.SUFFIX).fill_null(False) for x in (xa, xb))
    if not (pc.any(ua).as_py() or pc.any(ub).as_py()):
        return xa, xb
    names_a, names_b = (pc.unique(x.column("tensor").filter(u)) for x, u in ((xa, ua), (xb, ub)))
    out = []
    for x, u, other in ((xa, ua, names_b), (xb, ub, names_a)):
        keep = pc.or_(pc.invert(u), pc.is_in(x.column("tensor"), value_set=other)).fill_null(True)
        out.append(x if pc.all(keep).as_py() else x.filter(keep))
    return out[0], out[1]


def _sharded(x: pa.RecordBatch) -> bool:
    return x.column("shard_offset").null_count != x.num_rows


def _compare_logical_step_columns(
    step: int,
    batches_a: dict,
    batches_b: dict,
    tol: _Tol,
    ev: StepWarnings,
) -> dict[int, RankStep] | None:
    """_compare_logical_step column-wise: where tensors are whole on every rank, in B's rows' order (replicas:
    A's lowest rank's copy is the logical value, each of B's copies is compared with it); where a tensor is
    sharded on either side, in the record path's order (`_compare_sharded_columns`). None hands the step to
    the record path (a value only it reads)."""
    xa, xb = _phase_rows(batches_a), _phase_rows(batches_b)
    if xa is None or xb is None:
        return None
    xa, xb = _paired_updates(xa, xb)
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
        xa, xb = _of_phases(xa, both), _of_phases(xb, both)
    if _sharded(xa) or _sharded(xb):
        return _compare_sharded_columns(step, xa, xb, tol, ev)
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
    out: dict[int, RankStep] = {}
    ranks_b = xb.column("rank").to_numpy(zero_copy_only=False)
    a_row = np.full(xb.num_rows, -1, dtype=np.int64)
    a_row[matched] = first_a[
        np.asarray(match.filter(match.is_valid()).to_numpy(zero_copy_only=False), dtype=np.int64)
    ]
    for rank in np.unique(ranks_b).tolist():
        rows = np.nonzero(matched & (ranks_b == rank))[0]
        if rows.size:
            rs = out.setdefault(rank, RankStep())
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
    _lone_units(step, xa, xb, matched, in_b, first_a, tol, out)
    return out


def _lone_units(
    step: int, xa, xb, matched, in_b, first_a, tol: _Tol, out: dict[int, RankStep]
) -> None:
    """A logical tensor one side lacks, into `out`: the record path's unit (missing_in), at its holder's rank
    (B's lowest rank holding it; A's lowest). `matched`: B's rows whose tensor A holds; `in_b`: A's logical
    tensors B holds; `first_a`: each of A's logical tensors' first row."""
    lone = []
    if (~matched).any():  # one unit per logical tensor, at B's lowest rank holding it
        only_b = xb.take(pa.array(np.nonzero(~matched)[0]))
        keys = pc.binary_join_element_wise(only_b.column("phase"), only_b.column("tensor"), _SEP)
        lone.append(("b", only_b.take(pc.index_in(pc.unique(keys), value_set=keys))))
    if (~in_b).any():
        lone.append(("a", xa.take(pa.array(first_a[~in_b]))))
    for side, recs in lone:
        for r in trajectory_read.to_records(recs):
            rank = r["rank"]
            u = _unit(
                step,
                r if side == "a" else None,
                r if side == "b" else None,
                rank,
                tol,
                logical=True,
            )
            rs = out.setdefault(rank, RankStep())
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
        trajectory_read.to_records(x.take(pa.array(odd))),
        trajectory_read.to_records(ref.take(pa.array(odd))),
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
