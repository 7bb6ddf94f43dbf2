"""One rank's step compared record by record or column-wise (`_fold_columns`, analysis/columnar.py), and
what a rank showed at a step (`RankStep`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from disttrace.analysis import block_summary, columnar, updates
from disttrace.analysis.diff.tol import _same_bits, _Tol
from disttrace.analysis.result import RankEntry, RecordStats, Unit
from disttrace.store import trajectory_read
from disttrace.store.records import PHASE_ORDER, PHASES

_UNKNOWN_PHASE = len(PHASES)
_PHASE_NAMES = (*PHASES, "")  # by phase order (columnar.phase_name)


def _phase_order(phase: str) -> int:
    return PHASE_ORDER.get(phase, _UNKNOWN_PHASE)


class RankStep:
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
        if unit.missing_in and not unit.diverged:
            return  # a record one run need not make (`_unit`): nothing to compare
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
        # an update record is the recorder's statistic, not training state: a store written before them, or
        # a sharded parameter (run/record/updates.py), has none, and the other run's is then not compared
        lone = updates.is_update(ref.get("tensor")) and phase == "optimizer"
        rel, bnd, diverged, note = None, tol.derived(step, phase), not lone, None
    else:
        rel, bnd, diverged, note = tol.compare(step, phase, rec_a, rec_b)
    return Unit(
        step=step,
        micro_batch=ref.get("micro_batch", 0),
        phase=phase,
        rank=rank,
        tensor=(ref.get("logical") or ref.get("tensor")) if logical else ref.get("tensor"),
        index=ref.get("index", 0),
        a=RecordStats.of(rec_a) if rec_a is not None else None,
        b=RecordStats.of(rec_b) if rec_b is not None else None,
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
) -> RankStep:
    ka, kb = _keyed(recs_a), _keyed(recs_b)
    keys = sorted(
        ka.keys() | kb.keys()
    )  # in the recorder's order: ties between errors resolve the same every run
    rs = RankStep(len(keys))
    for k in keys:
        ra, rb = ka.get(k), kb.get(k)
        if ra is not None and rb is not None and _same_bits(ra, rb):
            continue
        mb, po, phase, index, dup = k
        rs.add((mb, po, phase, rank, index, dup), _unit(step, ra, rb, rank, tol))
    return rs


def _compare_rank_step_columns(step: int, rank: int, ba, bb, tol: _Tol) -> RankStep:
    """_compare_rank_step on two Arrow batches: aligned rows are compared column-wise (analysis/columnar.py),
    the few that need the record path's special cases (and unaligned steps) go through it."""
    ca, cb = columnar.Columns(ba), columnar.Columns(bb)
    if not columnar.aligned(ca, cb):
        return _compare_rank_step(
            step, rank, trajectory_read.to_records(ba), trajectory_read.to_records(bb), tol
        )
    rs = RankStep(ba.num_rows)
    _fold_columns([step], rank, ca, cb, np.zeros(1, dtype=np.int64), tol, [rs])
    return rs


def _fold_columns(
    steps: list[int],
    rank: int,
    ca,
    cb,
    starts: np.ndarray,
    tol: _Tol,
    out: list[RankStep],
    logical: bool = False,
    records=None,
) -> None:
    """Row i of `ca` against row i of `cb`, column-wise, into `out`: one or several steps concatenated (step
    `steps[j]` from row `starts[j]`, its result into `out[j]`). The bulk is summed up per step by
    columnar.by_step; the special rows (non-finite, shape or dtype differs, empty) and each step's first
    divergent row (whose unit dict the result shows) go through the record path's own `_unit`. records(rows)
    -> (A's dicts, B's dicts) of those rows, where the batches' rows stand for other values (logical tensors)."""
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

    def bound_table():
        """base_bound as a table: tol.derived at each step and phase the block holds."""
        phases = np.flatnonzero(np.bincount(cb["phase_order"], minlength=n_orders))
        return tol.derived_table(steps, phases.tolist(), n_orders)

    summary = block_summary.summarize(
        ca,
        cb,
        starts,
        bitwise=tol.mode == "bitwise",
        user=(tol.rtol, tol.atol) if tol.user else None,
        base_bound=base_bound,
        magnitudes=(lambda rows: tol.row_magnitudes(row_step, ca, cb, rows))
        if tol.scaled
        else None,
        projections=tol.projections,
        bound_table=None if tol.cal is not None and tol.cal.by_class is not None else bound_table,
    )
    for rs, i, d, h in zip(
        out, summary.inexact.tolist(), summary.differing.tolist(), summary.hard.tolist()
    ):
        rs.inexact += i
        rs.differing += d
        rs.hard += h
    names = _PHASE_NAMES
    for j, order, rel, bnd, ratio in summary.groups:
        rs, phase = out[j], names[order]
        max_rel = rs.max_rel
        if rel > max_rel.get(phase, -1.0):
            max_rel[phase], rs.max_rel_bound[phase] = rel, bnd
        if ratio is not None:
            q = ratio[0]
            if q > rs.max_ratio:  # max(rs.max_ratio, q)
                rs.max_ratio = q
            if q > rs.ratio_by_phase.get(phase, (-1.0,))[0]:
                rs.ratio_by_phase[phase] = ratio
    special = {r for rows in summary.special for r in rows}
    divergent = summary.first_divergent
    rows = sorted(
        special | set(divergent[divergent >= 0].tolist())
        if special or (len(divergent) and divergent.max() >= 0)
        else ()
    )
    if not rows:
        return
    if records is not None:
        ra, rb = records(rows)
    else:
        take = pa.array(rows, pa.int64())
        ra = trajectory_read.to_records(ca.batch.take(take))
        rb = trajectory_read.to_records(cb.batch.take(take))
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
