"""Across topologies, a window of steps compared at once: each side's steps read rank by rank as one batch
(`Side.batches`), their cross-topology rows and their losses taken once, the update records the other side
lacks and the phases it does not record left out step by step, then the logical tensors compared as whole
columns over the window (logical.py where every tensor is whole, shards.py where one is sharded). A step's
pyarrow and numpy calls are paid once a window, not once a step, and each step's result is what it would be
alone. A step whose rows the columns cannot hold (offsets of many dimensions) and a JSON-lines store go
through the record path, one step at a time."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import columnar, updates
from disttrace.analysis.diff.compare import RankStep, _phase_order
from disttrace.analysis.diff.logical import (
    CROSS_TOPOLOGY_PHASES,
    StepWarnings,
    _compare_logical_records,
    _compare_losses,
    _compare_whole_columns,
    _losses,
)
from disttrace.analysis.diff.shards import _compare_sharded_columns
from disttrace.analysis.diff.side import Side
from disttrace.analysis.diff.tol import _Tol
from disttrace.store import trajectory, trajectory_read
from disttrace.store.records import PHASES

_CROSS_ORDERS = np.array([PHASES.index(p) for p in CROSS_TOPOLOGY_PHASES])
# the losses, and the data records that say which samples each micro-batch held
_LOSS_ORDERS = np.array([PHASES.index("data"), PHASES.index("loss")])
_ORDERS = len(PHASES) + 1  # phase orders (columnar's "phase_order": an unknown phase is the last)

Compared = dict[int, tuple[dict[int, RankStep], StepWarnings]]


def compare_logical_steps(steps: list[int], a: Side, b: Side, tol: _Tol) -> Compared:
    """Each of `steps` compared across topologies: step -> (its results by rank, in the order the record
    path meets them; the warnings it raised)."""
    evs = [StepWarnings() for _ in steps]
    if not (_arrow(a) and _arrow(b)):
        return {s: (_record_step(s, a, b, tol, ev), ev) for s, ev in zip(steps, evs)}
    ra, rb = _Read(a, steps), _Read(b, steps)
    outs = _compare_columns(steps, ra, rb, tol, evs)
    done: Compared = {}
    for j, s in enumerate(steps):
        out = outs.get(j)
        if out is None:  # the record path's step
            out = _compare_logical_records(s, ra.records(j), rb.records(j), tol, evs[j])
        if tol.mode == "numeric":
            _compare_losses(s, _losses(ra.losses[j]), _losses(rb.losses[j]), tol, out)
        done[s] = (out, evs[j])
    return done


def _arrow(side: Side) -> bool:
    return bool(side.ranks) and all(trajectory_read.is_arrow(side.traj_path(r)) for r in side.ranks)


def _record_step(step: int, a: Side, b: Side, tol: _Tol, ev: StepWarnings) -> dict[int, RankStep]:
    """One step record by record, where a side is not an Arrow store throughout (or holds no rank here)."""
    recs = []
    for side in (a, b):
        if _arrow(side):
            got = {r: side.batch(r, step) for r in side.ranks if side.has(r, step)}
            recs.append({r: trajectory_read.to_records(x) for r, x in got.items()})
        else:
            recs.append({r: side.records(r, step) for r in side.ranks})
    out = _compare_logical_records(step, recs[0], recs[1], tol, ev)
    if tol.mode == "numeric":
        _compare_losses(step, _losses(recs[0]), _losses(recs[1]), tol, out)
    return out


def _mask(arr) -> np.ndarray:
    return np.asarray(arr.to_numpy(zero_copy_only=False), dtype=bool)


class _Read:
    """One side's steps of a window, read and decoded a rank at a time (hash-checked, counted per step as a
    step read alone is). Its rows in the cross-topology phases, rank by rank, each rank's in step order, as
    arrays (each row's `pos` step position, phase `order`, whether it is an `update` record,
    holds a shard), taken as one batch by `take`; `losses[j]` the data and loss records of step position j by
    rank."""

    def __init__(self, side: Side, steps: list[int]):
        at = {s: j for j, s in enumerate(steps)}
        self.parts: dict[int, tuple[pa.RecordBatch, list[int], list[int]]] = {}
        self.losses: list[dict[int, list[dict]]] = [{} for _ in steps]
        self.batches: list[pa.RecordBatch] = []
        cols: dict[str, list[np.ndarray]] = {
            k: [] for k in ("part", "row", "pos", "order", "update", "shard")
        }
        update_names = []
        for r in sorted(side.ranks):
            have = [s for s in steps if side.has(r, s)]
            if not have:
                continue
            batch, starts = side.batches(r, have)
            held = [at[s] for s in have]
            counts = np.diff(np.append(starts, batch.num_rows))
            row_pos = np.repeat(np.array(held, dtype=np.int64), counts)
            self.parts[r] = (batch, starts.tolist(), held)
            order = columnar.Columns(batch)["phase_order"]
            rows = np.flatnonzero(np.isin(order, _CROSS_ORDERS))
            names = batch.column("tensor")
            update = _mask(pc.ends_with(names, updates.SUFFIX).fill_null(False))[rows]
            got = {
                "part": np.full(len(rows), len(self.batches), dtype=np.int64),
                "row": rows,
                "pos": row_pos[rows],
                "order": order[rows],
                "update": update,
                "shard": _mask(batch.column("shard_offset").is_valid())[rows],
            }
            for k, v in got.items():
                cols[k].append(v)
            update_names.append(names.take(pa.array(rows[update], pa.int64())))
            self.batches.append(batch)
            for j in held:
                self.losses[j][r] = []
            rows = np.flatnonzero(np.isin(order, _LOSS_ORDERS))
            recs = trajectory_read.to_records(batch.take(pa.array(rows, pa.int64())))
            for j, rec in zip(row_pos[rows].tolist(), recs):
                self.losses[j][r].append(rec)
        self.part, self.row, self.pos, self.order, self.update, self.shard = (
            np.concatenate(cols[k]) if cols[k] else np.empty(0, dtype=np.int64 if i < 4 else bool)
            for i, k in enumerate(("part", "row", "pos", "order", "update", "shard"))
        )
        # the update records' names, in row order
        self.update_names = (
            pa.concat_arrays(update_names) if update_names else pa.array([], pa.string())
        )

    def take(self, sel: np.ndarray) -> pa.RecordBatch:
        """The rows `sel` (positions in the arrays, in order) as one batch."""
        parts = []
        for k, batch in enumerate(self.batches):
            mine = sel[self.part[sel] == k]
            if len(mine):
                parts.append(batch.take(pa.array(self.row[mine], pa.int64())))
        if len(parts) == 1:
            return parts[0]
        return (
            pa.concat_batches(parts)
            if parts
            else pa.RecordBatch.from_pylist([], schema=trajectory.SCHEMA)
        )

    def records(self, j: int) -> dict[int, list[dict]]:
        """Step position j's records by rank (the record path's)."""
        out = {}
        for r, (batch, starts, held) in self.parts.items():
            if j in held:
                k = held.index(j)
                end = starts[k + 1] if k + 1 < len(starts) else batch.num_rows
                out[r] = trajectory_read.to_records(batch.slice(starts[k], end - starts[k]))
        return out


def _keys(xa, sa, oa, xb, sb, ob) -> tuple[np.ndarray, np.ndarray, int]:
    """Each row's logical tensor of a window as one integer in the record path's order: (its step position
    `sa`/`sb`, phase order `oa`/`ob`, name), names numbered over both sides by sorted order (Arrow sorts UTF-8
    bytes, whose order is the code points', Python's). -> (A's keys, B's keys, the keys a step position
    spans)."""
    names = pa.concat_arrays([xa.column("tensor"), xb.column("tensor")]).dictionary_encode()
    idx = np.asarray(names.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    words = names.dictionary
    rank = np.empty(len(words), dtype=np.int64)
    rank[np.asarray(pc.array_sort_indices(words), dtype=np.int64)] = np.arange(len(words))
    n = max(len(words), 1)
    out = []
    for s, order, part in ((sa, oa, idx[: xa.num_rows]), (sb, ob, idx[xa.num_rows :])):
        out.append((s * _ORDERS + order) * n + rank[part])
    return out[0], out[1], _ORDERS * n


def _update_keep(ra: _Read, rb: _Read, keep_a: np.ndarray, keep_b: np.ndarray) -> None:
    """Leave out (in keep_a, keep_b) the update records (run/record/updates.py) the other side does not make
    at that step (a sharded parameter's, a store's written before them): those are not compared, and are left
    out as whole columns rather than met one record at a time."""
    ua, ub = ra.update, rb.update
    if not (ua.any() or ub.any()):
        return
    names = pa.concat_arrays([ra.update_names, rb.update_names]).dictionary_encode()
    idx = np.asarray(names.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    n = max(len(names.dictionary), 1)
    ka = ra.pos[ua] * n + idx[: int(ua.sum())]
    kb = rb.pos[ub] * n + idx[int(ua.sum()) :]
    keep_a[ua] &= np.isin(ka, kb)
    keep_b[ub] &= np.isin(kb, ka)


def _compare_columns(
    steps: list[int], ra: _Read, rb: _Read, tol: _Tol, evs: list[StepWarnings]
) -> dict[int, dict[int, RankStep]]:
    """The window's steps column-wise: step position -> results by rank; a position left out is the record
    path's (values only the record path combines)."""
    W = len(steps)
    keep_a, keep_b = np.ones(len(ra.pos), dtype=bool), np.ones(len(rb.pos), dtype=bool)
    _update_keep(ra, rb, keep_a, keep_b)
    present = []
    for r, keep in ((ra, keep_a), (rb, keep_b)):
        got = np.zeros((W, _ORDERS), dtype=bool)
        got[r.pos[keep], r.order[keep]] = True
        present.append(got)
    # a phase one side does not record: not compared at that step
    for j in range(W):
        pa_ = {PHASES[o] for o in np.flatnonzero(present[0][j]).tolist()}
        pb_ = {PHASES[o] for o in np.flatnonzero(present[1][j]).tolist()}
        evs[j].both.update(pa_ & pb_)
        for p in sorted(pa_ ^ pb_, key=lambda p: (_phase_order(p), p)):
            evs[j].phase(
                p,
                f"run {'A' if p not in pa_ else 'B'} records no '{p}' phase: that phase is not compared",
            )
    both = present[0] & present[1]
    keep_a &= both[ra.pos, ra.order]
    keep_b &= both[rb.pos, rb.order]
    sharded = np.zeros(W, dtype=bool)  # a step where a tensor is sharded on either side
    for r, keep in ((ra, keep_a), (rb, keep_b)):
        sharded[r.pos[keep & r.shard]] = True
    outs: dict[int, dict[int, RankStep]] = {}
    for which in (np.flatnonzero(~sharded), np.flatnonzero(sharded)):
        if len(which):
            outs.update(_compare_part(steps, which, ra, rb, keep_a, keep_b, tol, evs))
    return outs


def _compare_part(steps, which, ra: _Read, rb: _Read, keep_a, keep_b, tol, evs):
    """The steps at positions `which` (all whole or all sharded) column-wise; sharded steps the columns
    cannot combine together are tried one by one, and one they cannot combine alone is left out."""
    part = np.zeros(len(steps), dtype=bool)
    part[which] = True
    rows_a = np.flatnonzero(keep_a & part[ra.pos])
    rows_b = np.flatnonzero(keep_b & part[rb.pos])
    xa, xb = ra.take(rows_a), rb.take(rows_b)
    sa, sb = ra.pos[rows_a], rb.pos[rows_b]
    ka, kb, span = _keys(xa, sa, ra.order[rows_a], xb, sb, rb.order[rows_b])
    sharded = bool(ra.shard[rows_a].any() or rb.shard[rows_b].any())
    if not sharded:
        return _compare_whole_columns(steps, which, sa, sb, ka, kb, xa, xb, tol, evs)
    got = _compare_sharded_columns(steps, which, span, ka, kb, xa, xb, tol, evs)
    if got is not None or len(which) == 1:
        return got or {}
    outs = {}
    for j in which.tolist():
        one = np.zeros(len(steps), dtype=bool)
        one[j] = True
        outs.update(
            _compare_part(
                steps, np.array([j]), ra, rb, keep_a & one[ra.pos], keep_b & one[rb.pos], tol, evs
            )
        )
    return outs
