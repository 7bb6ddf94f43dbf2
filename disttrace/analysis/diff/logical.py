"""Across topologies: the logical tensors of a step (shards combined by their offsets, replicas held to
their lowest rank's copy), compared record by record or column-wise (a step with sharded tensors through
shards.py), the losses of micro-batches that hold the same samples, and the warnings a step raises
(`StepWarnings`, replayed in step order by `Warned`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from disttrace.analysis import columnar
from disttrace.analysis.diff.compare import (
    RankStep,
    _fold_columns,
    _phase_order,
    _unit,
)
from disttrace.analysis.diff.shards import _Logical
from disttrace.analysis.diff.tol import _same_bits, _Tol
from disttrace.store import trajectory_read

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


def _losses(recs: dict) -> dict[tuple, list[dict]]:
    """A side's loss records keyed by the samples of their micro-batch (the `data` record's sample ids at
    the same rank and micro-batch), in rank order: the same samples under the same parameters give the
    same loss in any layout, so micro-batches that hold the same samples compare across topologies."""
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


def _compare_logical_records(step, recs_a, recs_b, tol, ev: StepWarnings) -> dict[int, RankStep]:
    """One step's logical tensors record by record (records by rank): the tests' oracle, and the path of a
    JSON-lines store and of a step whose rows the columns cannot hold."""
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


def _compare_whole_columns(
    steps: list[int], which, sa, sb, ka, kb, xa, xb, tol: _Tol, evs: list[StepWarnings]
) -> dict[int, dict[int, RankStep]]:
    """The steps of a window at positions `which`, where every tensor is whole on both sides, column-wise in
    B's rows' order: replicas held to A's lowest rank's copy (the logical value), each of B's copies compared
    with it. sa, sb: each row's step position (rows rank by rank, a rank's in step order); ka, kb: its logical
    tensor (window.py's `_keys`). -> each position's results by rank, in the order the record path meets them."""
    outs: dict[int, dict[int, RankStep]] = {int(j): {} for j in which}
    uniq, first = np.unique(ka, return_index=True)
    # in order of first appearance: rank order, so each key's lowest rank
    by_first = np.argsort(first, kind="stable")
    logical_a, first_a = uniq[by_first], first[by_first]
    _replica_warnings(xa, sa, ka, xb, sb, kb, uniq, evs)
    matched = np.zeros(xb.num_rows, dtype=bool)
    at = np.zeros(xb.num_rows, dtype=np.int64)
    if len(uniq):
        at = np.minimum(np.searchsorted(uniq, kb), len(uniq) - 1)
        matched = uniq[at] == kb
    in_b = np.isin(logical_a, kb)
    ranks_b = np.asarray(xb.column("rank").to_numpy(zero_copy_only=False), dtype=np.int64)
    a_row = np.full(xb.num_rows, -1, dtype=np.int64)
    a_row[matched] = first[at[matched]]
    for rank in np.unique(ranks_b).tolist():
        rows = np.flatnonzero(matched & (ranks_b == rank))
        if not rows.size:
            continue
        rows = rows[np.argsort(sb[rows], kind="stable")]  # step by step, each step's in B's order
        pos = sb[rows]
        cut = np.flatnonzero(np.concatenate(([True], pos[1:] != pos[:-1])))
        held = pos[cut].tolist()
        out = []
        for j, c in zip(held, np.diff(np.append(cut, rows.size)).tolist()):
            rs = outs[j].setdefault(rank, RankStep())
            rs.total += c
            out.append(rs)
        _fold_columns(
            [steps[j] for j in held],
            rank,
            columnar.Columns(xa.take(pa.array(a_row[rows]))),
            columnar.Columns(xb.take(pa.array(rows))),
            cut,
            tol,
            out,
            logical=True,
        )
    _lone_units(steps, sa, sb, xa, xb, kb, matched, in_b, first_a, tol, outs)
    return outs


def _lone_units(steps, sa, sb, xa, xb, kb, matched, in_b, first_a, tol: _Tol, outs) -> None:
    """A logical tensor one side lacks, into `outs`: the record path's unit (missing_in), at its holder's
    rank (B's lowest rank holding it; A's lowest), step by step B's before A's. `matched`: B's rows whose
    tensor A holds; `in_b`: A's logical tensors B holds; `first_a`: each of A's logical tensors' first row."""
    lone = []  # (step position, B's first, rows in first appearance, side, batch)
    if (~matched).any():  # one unit per logical tensor, at B's lowest rank holding it
        rows = np.flatnonzero(~matched)
        _, fi = np.unique(kb[rows], return_index=True)
        lone.append((0, rows[np.sort(fi)], sb, "b", xb))
    if (~in_b).any():
        lone.append((1, first_a[~in_b], sa, "a", xa))
    units = []
    for order, rows, pos, side, x in lone:
        for n, r in enumerate(trajectory_read.to_records(x.take(pa.array(rows)))):
            units.append(((int(pos[rows[n]]), order, n), side, r))
    for (j, _, _), side, r in sorted(units, key=lambda u: u[0]):
        rank, step = r["rank"], steps[j]
        u = _unit(
            step, r if side == "a" else None, r if side == "b" else None, rank, tol, logical=True
        )
        rs = outs[j].setdefault(rank, RankStep())
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


def _replica_mismatch_rows(side: str, x, pos, keys) -> list[tuple]:
    """Copies of one tensor in `x` (rank order) that differ from its lowest rank's copy (replicas must be
    bit-identical): (sort key, warning) each, by step position `pos`, then the record path's order and
    wording."""
    uniq, first, inv = np.unique(keys, return_index=True, return_inverse=True)
    if x.num_rows == len(uniq):
        return []
    ref = x.take(pa.array(first[inv.reshape(-1)]))
    same = columnar.same_bits(columnar.Columns(x), columnar.Columns(ref))
    odd = np.flatnonzero(~same)
    if not odd.size:
        return []
    out = []
    for i, r, r0 in zip(
        odd.tolist(),
        trajectory_read.to_records(x.take(pa.array(odd))),
        trajectory_read.to_records(ref.take(pa.array(odd))),
    ):
        out.append(
            (
                (int(pos[i]), _phase_order(r["phase"]), r["phase"], r["tensor"], side, r["rank"]),
                f"run {side}: step {r['step']} {r['phase']} {r['tensor']}: rank {r.get('rank')}'s copy differs "
                f"from rank {r0.get('rank')}'s (replicas should be bit-identical)",
            )
        )
    return out


def _replica_warnings(xa, sa, ka, xb, sb, kb, uniq_a, evs: list[StepWarnings]) -> None:
    """A's replicas, and B's of the tensors A lacks (B's other copies are each compared with A's value),
    step by step."""
    found = _replica_mismatch_rows("A", xa, sa, ka)
    only_b = ~np.isin(kb, uniq_a)
    if only_b.any():
        rows = np.flatnonzero(only_b)
        found += _replica_mismatch_rows("B", xb.take(pa.array(rows)), sb[rows], kb[rows])
    for key, text in sorted(found, key=lambda f: f[0]):
        ev = evs[key[0]]
        if ev.wants("replica"):
            ev.capped("replica", text)
