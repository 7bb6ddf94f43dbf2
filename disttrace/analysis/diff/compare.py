"""Comparing two records (or logical values): the bound they are held to and their relative error (`_Tol`),
one rank's step record by record or column-wise (`_fold_columns`, analysis/columnar.py), and what a rank
showed at a step (`_RankStep`)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from disttrace.analysis import columnar, tolerance
from disttrace.analysis.result import (
    RankEntry,
    Unit,
)
from disttrace.model.names import tensor_class
from disttrace.store import trajectory
from disttrace.store.rundir import PHASE_ORDER, PHASES

TINY = 1e-300

_UNKNOWN_PHASE = len(PHASES)


def _phase_order(phase: str) -> int:
    return PHASE_ORDER.get(phase, _UNKNOWN_PHASE)


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
