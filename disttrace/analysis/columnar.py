"""Comparing one rank's step of two runs column by column: the arithmetic of diff's `_Tol.compare` on whole
Arrow columns in numpy, so a numeric diff (every record inexact) costs a few array operations per step
instead of a Python dict and a dozen float conversions per record.

Why numpy over the Arrow buffers, not Polars or DuckDB: a step is one record batch of a few thousand rows,
already aligned row by row between the runs (the recorder writes both in the same order); the work is
elementwise arithmetic and a few reductions, which numpy does on Arrow's buffers without a copy and
without a query planner's per-call cost (a join engine pays off for unaligned tables, which fall back to the
record path here). pyarrow is the store's dependency already; numpy the digest's.

`compare` returns data: which rows are bit-equal, and for the others rel_err, bound, diverged; rows whose
comparison needs the record path's special cases (non-finite values, a shape or dtype that differs, an
empty tensor) are handed back by position for it. diff.py folds the result into its per-rank bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import tolerance
from disttrace.store.records import PHASES
from disttrace.store.trajectory import SKETCH_K

TINY = 1e-300
_PHASES = pa.array(PHASES)
_SKETCH_FLOAT32 = pa.array(tolerance.SKETCH_FLOAT32)
_U32, _U64 = tolerance.UNIT_ROUNDOFF["float32"], tolerance.UNIT_ROUNDOFF["float64"]


@dataclass
class Compared:
    """One rank and step of two runs, row by row (rows in the recorder's order, the same in both)."""

    n: int
    phase_order: (
        np.ndarray
    )  # per row: position of the phase in PHASES (len(PHASES) for an unknown one)
    micro_batch: np.ndarray
    index: np.ndarray
    inexact: np.ndarray  # row positions that are not bit-equal and were compared here
    rel: np.ndarray  # per inexact row: the reported relative error (nan: none)
    bound: np.ndarray
    diverged: np.ndarray  # bool per inexact row
    special: (
        np.ndarray
    )  # row positions the record path compares (non-finite, shape or dtype differs, empty)


class Columns:
    """One step's batch with each column turned into numpy once (aligned() and compare() share them)."""

    def __init__(self, batch: pa.RecordBatch):
        self.batch = batch
        self._np: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        out = self._np.get(name)
        if out is None:
            if name == "phase_order":
                idx = pc.index_in(self.batch.column("phase"), value_set=_PHASES)
                out = np.asarray(
                    idx.fill_null(len(PHASES)).to_numpy(zero_copy_only=False), dtype=np.int64
                )
            else:
                out = self.batch.column(name).to_numpy(zero_copy_only=False)
            self._np[name] = out
        return out

    @property
    def num_rows(self) -> int:
        return self.batch.num_rows

    def column(self, name: str):
        return self.batch.column(name)


def _digests(batch) -> np.ndarray:
    arr = batch.column("digest")
    data = np.frombuffer(arr.buffers()[1], dtype=np.uint8)
    return data[arr.offset * 16 : (arr.offset + len(arr)) * 16].reshape(-1, 16)


def _sketches(batch) -> np.ndarray:
    """(n, SKETCH_K) float64, nan where a record has no sketch (float32 and float64 columns merged)."""
    a, b = batch.column("sketch"), batch.column("sketch64")
    for whole, none in (
        (a, b),
        (b, a),
    ):  # every record's sketch in one column: that column, widened
        if not whole.null_count and none.null_count == len(none) and len(whole):
            vals = whole.values.to_numpy(zero_copy_only=False)
            return (
                vals[whole.offset * SKETCH_K : (whole.offset + len(whole)) * SKETCH_K]
                .reshape(-1, SKETCH_K)
                .astype(np.float64)
            )
    out = np.full((batch.num_rows, SKETCH_K), np.nan)
    for name in ("sketch", "sketch64"):
        arr = batch.column(name)
        if arr.null_count == len(arr):
            continue
        vals = arr.values.to_numpy(zero_copy_only=False)[
            arr.offset * SKETCH_K : (arr.offset + len(arr)) * SKETCH_K
        ]
        vals = vals.reshape(-1, SKETCH_K)
        if arr.null_count:
            valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            out[valid] = vals[valid]
        else:
            out[:] = vals
    return out


def aligned(ca: Columns, cb: Columns) -> bool:
    """Both steps hold the same keys (micro-batch, phase, index) in the same rows, each key once: rows pair
    up by position. Otherwise (a tensor missing on one side, another topology) the record path keys them."""
    if ca.num_rows != cb.num_rows:
        return False
    for name in ("micro_batch", "index", "phase_order"):
        if not np.array_equal(ca[name], cb[name]):
            return False
    if not ca.column("phase").equals(
        cb.column("phase")
    ):  # unknown phases share one order: their names too
        return False
    key = (ca["micro_batch"].astype(np.int64) << 40) + (ca["phase_order"] << 32) + ca["index"]
    if (np.diff(key) > 0).all():  # the recorder's order: increasing, hence each key once
        return True
    return len(np.unique(key)) == len(key)


def _rowwise_equal(a: pa.Array, b: pa.Array) -> np.ndarray:
    if a.equals(b):
        return np.ones(len(a), dtype=bool)
    return np.array([x == y for x, y in zip(a.to_pylist(), b.to_pylist())], dtype=bool)


def same_digest(ca: Columns, cb: Columns) -> np.ndarray:
    """Row by row: the same digest of the same kind (xxh3 or the device checksum)."""
    da, db = _digests(ca), _digests(cb)
    if len(da):  # 16 bytes as two 64-bit words: an eighth of the comparisons
        da, db = da.view(np.uint64), db.view(np.uint64)
    return (da == db).all(axis=1) & (ca["device_digest"] == cb["device_digest"])


def same_dtype_and_shape(ca: Columns, cb: Columns) -> np.ndarray:
    return _rowwise_equal(ca.column("dtype"), cb.column("dtype")) & _rowwise_equal(
        ca.column("shape"), cb.column("shape")
    )


def same_bits(ca: Columns, cb: Columns) -> np.ndarray:
    """The record path's _same_bits on columns: digest, dtype and shape all equal."""
    return same_digest(ca, cb) & same_dtype_and_shape(ca, cb)


def _last_dim(shape: pa.ListArray) -> np.ndarray:
    """The last axis of each row's shape (0 for a scalar)."""
    offsets = np.asarray(shape.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = np.asarray(shape.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    lengths = np.diff(offsets)
    out = np.zeros(len(lengths), dtype=np.int64)
    has = lengths > 0
    out[has] = values[offsets[1:][has] - 1]
    return out


def _sketch_rounding(f32: np.ndarray, numel: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """tolerance.sketch_rounding on columns (rows = numel / last axis; scalars round 0); f32: the sketch was
    computed in float32."""
    u = np.where(f32, _U32, _U64)
    c = np.maximum(cols, 1)
    rows = np.maximum(numel // c, 1)
    r = (
        u * np.sqrt(np.minimum(rows, tolerance.SKETCH_ROWS))
        + _U64 * np.sqrt(rows + c)
        + np.where(f32, _U32, 0.0)
    )
    return np.where(cols > 0, r, 0.0)


def _stat_rounding(
    f32: np.ndarray, numel: np.ndarray, cols: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """tolerance.norm_rounding and sum_rounding on columns (a scalar's sum rounds 0)."""
    n = np.maximum(numel, 1)
    in32 = f32 & (n > tolerance.FLOAT64_STATS)
    run = np.sqrt(np.minimum(n, tolerance.STAT_CHUNK))
    norm = np.where(in32, 0.5 * (_U32 * (run + 1) + _U64 * np.sqrt(n)) + _U64, 0.0)
    return norm, np.where(in32 & (cols > 0), _U32 * run + _U64 * np.sqrt(n), 0.0)


def compare(
    ba: Columns,
    bb: Columns,
    *,
    bitwise: bool,
    user: tuple[float, float] | None,
    base_bound,
    magnitudes=None,
    projections: int = SKETCH_K,
) -> Compared:
    """Rows of two aligned steps (see `aligned`). bitwise: every inexact row diverges. user: (rtol, atol) when
    the user gave the bound, else base_bound(rows, phase_order, tensor_names) -> per-row bounds of those row
    positions (the derived or calibrated bound of the row's step and phase times the tensor's factor).
    magnitudes(rows) -> (magnitude, unbounded) per row, when the runs recorded them: the scale of the row's
    difference is then the larger of the norms and the magnitude (analysis/magnitudes.py), and an unbounded
    row (no sound bound) never diverges on its statistics. projections: how many leading sketch projections
    the runs share the vectors of (store.trajectory.shared_projections: fewer between two sketch versions);
    the others are not compared."""
    n = ba.num_rows
    order = bb["phase_order"]
    same_type = same_dtype_and_shape(ba, bb)
    same = same_digest(ba, bb) & same_type
    f32 = np.asarray(
        pc.is_in(ba.column("dtype"), value_set=_SKETCH_FLOAT32).to_numpy(zero_copy_only=False),
        dtype=bool,
    )
    rows = np.nonzero(~same)[0]
    sa, sb = ba["sum"][rows], bb["sum"][rows]
    na, nb = ba["norm"][rows], bb["norm"][rows]
    sa, sb, na, nb = (
        np.asarray(x, dtype=np.float64) for x in (sa, sb, na, nb)
    )  # nulls arrive as nan
    numel = np.maximum(np.maximum(ba["numel"][rows], bb["numel"][rows]), 1)
    finite = (
        (ba["nonfinite"][rows] == 0)
        & (bb["nonfinite"][rows] == 0)
        & np.isfinite(sa)
        & np.isfinite(sb)
        & np.isfinite(na)
        & np.isfinite(nb)
    )
    simple = finite & same_type[rows] & (ba["numel"][rows] > 0)
    special = rows[~simple]
    rows = rows[simple]
    sa, sb, na, nb, numel = sa[simple], sb[simple], na[simple], nb[simple], numel[simple]

    top = np.maximum(na, nb)
    unbounded = np.zeros(len(rows), dtype=bool)
    if magnitudes is not None and user is None and len(rows):
        extra, unbounded = magnitudes(rows)
        top = np.maximum(top, extra)
    scale_n = np.maximum(top, TINY)
    scale_s = np.maximum(top * np.sqrt(numel), TINY)
    ka, kb = _sketches(ba)[rows], _sketches(bb)[rows]
    has_sketch = ~(np.isnan(ka).any(axis=1) | np.isnan(kb).any(axis=1)) & (projections > 0)
    # projections past the shared ones are of other vectors on each side: no difference to measure there
    kb[:, projections:] = ka[:, projections:]
    # the terms (norm, sum, each sketch projection) and their bounds, a column each; the sketch's bounds are one
    tn, ts = np.abs(na - nb) / scale_n, np.abs(sa - sb) / scale_s
    tk = np.abs(ka - kb) / scale_s[:, None]

    if user is not None:
        rtol, atol = user
        bn, bs = (atol + rtol * scale_n) / scale_n, (atol + rtol * scale_s) / scale_s
    else:
        bn = bs = base_bound(
            rows, order[rows], ba.column("tensor").take(pa.array(rows, pa.int64()))
        )
    f32, numel_a, last = f32[rows], ba["numel"][rows], _last_dim(ba.column("shape"))[rows]
    rounding = 2 * _sketch_rounding(f32, numel_a, last)
    bn, bs = np.where(unbounded, np.inf, bn), np.where(unbounded, np.inf, bs)
    bk = bs + rounding  # each sketch projection also carries its own float32 rounding
    if not bitwise and user is None:  # a user's bound is taken as given (diff.py's compare)
        # the recorded norm's and sum's own rounding, both records' (not where the phase must be exact)
        norm_r, sum_r = _stat_rounding(f32, numel_a, last)
        bn = bn + 2 * np.where(bn > 0, norm_r, 0.0)
        bs = bs + 2 * np.where(bs > 0, sum_r, 0.0)

    # a record without a sketch compares on norm and sum alone
    over = (tn > bn) | (ts > bs) | (has_sketch & (tk > bk[:, None]).any(axis=1))
    all_equal = (bn == bn) & (bs == bn) & (~has_sketch | (bk == bn))
    pick = np.empty((len(rows), 2 + SKETCH_K))
    with np.errstate(divide="ignore", invalid="ignore"):
        for j, (t, bd) in enumerate(((tn, bn), (ts, bs), (tk, bk[:, None]))):
            ratio = np.where(bd > 0, t / bd, np.where(t > 0, np.inf, 0.0))
            eq = all_equal if t.ndim == 1 else all_equal[:, None]
            pick[:, j if j < 2 else slice(2, None)] = np.where(eq, t, ratio)
    pick[~has_sketch, 2:] = -np.inf
    i = np.argmax(pick, axis=1)  # the first maximum, as Python's max() in the record path
    k = tk[np.arange(len(rows)), np.maximum(i - 2, 0)]
    rel = np.where(i == 0, tn, np.where(i == 1, ts, k))
    bnd = np.where(i == 0, bn, np.where(i == 1, bs, bk))
    rel = np.where(np.isfinite(rel), rel, np.nan)
    diverged = np.full(len(rows), True) if bitwise else (over | np.isnan(rel))
    # coordinates are B's (the record path reports B's record when both exist)
    return Compared(
        n=n,
        phase_order=order,
        micro_batch=bb["micro_batch"],
        index=bb["index"],
        inexact=rows,
        rel=rel,
        bound=bnd,
        diverged=diverged,
        special=special,
    )


def aligned_block(ca: Columns, cb: Columns, starts: np.ndarray) -> bool:
    """`aligned` for concatenated steps (both sides' steps with equal row counts): the same keys in the same
    rows, increasing within each step (each key once per step)."""
    if ca.num_rows != cb.num_rows:
        return False
    for name in ("micro_batch", "index", "phase_order"):
        if not np.array_equal(ca[name], cb[name]):
            return False
    if not ca.column("phase").equals(cb.column("phase")):
        return False
    key = (ca["micro_batch"].astype(np.int64) << 40) + (ca["phase_order"] << 32) + ca["index"]
    rising = np.diff(key) > 0
    firsts = starts[
        (starts > 0) & (starts < len(key))
    ]  # steps without rows start where the next one does
    rising[firsts - 1] = True  # a step's first row need not follow the last step's last
    return bool(rising.all())


@dataclass
class StepSummary:
    """`Compared` of one or several concatenated steps, summed up per step (diff folds it into each step's
    RankStep). Per step: inexact, differing and hard counts, and the rows
    (positions in the concatenation) that the record path must see: special ones and the first divergent one.
    Per (step, phase) group with a relative error: the largest error (first among equals) and its bound, and
    where a bound is positive the largest error-to-bound ratio with its error and bound."""

    inexact: np.ndarray
    differing: np.ndarray
    hard: np.ndarray
    special: list  # per step: row positions
    first_divergent: np.ndarray  # per step: row position, -1 if none
    groups: list  # (step position, phase order, max rel, its bound, (ratio, rel, bound) or None)


def by_step(c: Compared, starts: np.ndarray) -> StepSummary:
    n_steps = len(starts)
    step_of = lambda rows: np.searchsorted(starts, rows, side="right") - 1  # noqa: E731
    si = step_of(c.inexact)
    inexact = np.bincount(si, minlength=n_steps)
    differing = np.bincount(si[c.diverged], minlength=n_steps)
    hard = np.bincount(si[c.diverged & np.isnan(c.rel)], minlength=n_steps)
    special = [[] for _ in range(n_steps)]
    for row, s in zip(c.special.tolist(), step_of(c.special).tolist()):
        special[s].append(row)
    first = np.full(n_steps, -1, dtype=np.int64)
    div = c.inexact[c.diverged]
    if div.size:  # per step, the smallest (micro-batch, phase, index): lexsort by step last
        o = np.lexsort((c.index[div], c.phase_order[div], c.micro_batch[div], si[c.diverged]))
        ds = si[c.diverged][o]
        heads = np.concatenate(([True], ds[1:] != ds[:-1]))
        first[ds[heads]] = div[o][heads]
    groups = []
    ok = ~np.isnan(c.rel)
    if ok.any():
        rows = np.nonzero(ok)[0]  # positions in c.inexact, increasing
        g_step, g_phase = si[rows], c.phase_order[c.inexact[rows]]
        gkey = g_step * (len(PHASES) + 1) + g_phase
        rel, bnd = c.rel[rows], c.bound[rows]
        pos = bnd > 0
        ratio = np.where(pos, rel / np.where(pos, bnd, 1.0), -1.0)
        # per group: the largest error, the first among equals; the same for the ratio
        best, best_ratio = (
            _group_firsts_of_max(gkey, rows, rel),
            _group_firsts_of_max(gkey, rows, ratio),
        )
        best_ratio = dict(zip(gkey[best_ratio].tolist(), best_ratio.tolist()))
        for j in best.tolist():
            k = best_ratio[int(gkey[j])]
            groups.append(
                (
                    int(g_step[j]),
                    int(g_phase[j]),
                    float(rel[j]),
                    float(bnd[j]),
                    (float(ratio[k]), float(rel[k]), float(bnd[k])) if pos[k] else None,
                )
            )
    return StepSummary(inexact, differing, hard, special, first, groups)


def _group_firsts_of_max(gkey: np.ndarray, rows: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per group of `gkey` (in increasing key order): the position of its largest `value` (no NaN), the one of
    smallest `rows` among equals. Where the keys already come in groups of increasing key (one micro-batch:
    the recorder's order is the phases' order), by reductions over the runs; else by sorting."""
    if len(gkey) and (gkey[1:] >= gkey[:-1]).all():
        starts = np.flatnonzero(np.concatenate(([True], gkey[1:] != gkey[:-1])))
        top = np.maximum.reduceat(value, starts)
        sizes = np.diff(np.append(starts, len(gkey)))
        at = np.arange(len(gkey))
        # rows increase with position here (they are positions in an increasing list), so the first position
        # holding the maximum is the smallest row among equals
        return np.minimum.reduceat(np.where(value == np.repeat(top, sizes), at, len(gkey)), starts)
    o = np.lexsort((rows, -value, gkey))
    return o[np.concatenate(([True], gkey[o][1:] != gkey[o][:-1]))]


_SQUARED = ":exp_avg_sq"


def tensor_factors(names: pa.Array) -> np.ndarray:
    """tolerance.tensor_factor per row (Adam's second moment: 2, else 1), on the column."""
    squared = np.asarray(pc.ends_with(names, _SQUARED).to_numpy(zero_copy_only=False), dtype=bool)
    return np.where(squared, 2.0, 1.0)


def phase_name(order: int) -> str:
    return PHASES[order] if order < len(PHASES) else ""


def _sketch_columns(batch: pa.RecordBatch, name: str, dtype) -> tuple[np.ndarray, np.ndarray]:
    """A sketch column as (its rows' values, flat, as `dtype`; valid per row): what _sketches reads of it."""
    arr = batch.column(name)
    n = len(arr)
    if arr.null_count == n:
        return np.empty(0, dtype=dtype), np.zeros(n, dtype=bool)
    vals = arr.values.to_numpy(zero_copy_only=False)[
        arr.offset * SKETCH_K : (arr.offset + n) * SKETCH_K
    ]
    vals = np.ascontiguousarray(vals, dtype=dtype)
    if arr.null_count:
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    else:
        valid = np.ones(n, dtype=bool)
    return vals, valid
