"""The bound two records (or logical values) are held to and their relative error (`_Tol`: derived,
calibrated, a user's, or none where no sound bound exists; docs/tolerance.md)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import magnitudes, tolerance, updates
from disttrace.analysis.diff import sensitivity
from disttrace.analysis.result import BoundKind
from disttrace.model.names import tensor_class
from disttrace.store.records import PHASES
from disttrace.store.trajectory import SKETCH_K

TINY = 1e-300


class _NameKinds:
    """What analysis/magnitudes.py's `of` asks of a tensor name, over a column of names, matched on the
    column's bytes (a null name is the empty one)."""

    _MATCH = {
        "grad_norm": ("equal", b"grad_norm"),
        "clip_coef": ("equal", b"clip_coef"),
        "param_groups": ("starts", b"param_groups."),
        "colon": ("contains", b":"),
        "exp_avg": ("ends", b":exp_avg"),
        "exp_avg_sq": ("ends", b":exp_avg_sq"),
    }

    def __init__(self, names: pa.Array):
        self._contains: np.ndarray | None = None  # the rows holding ":" (the one "contains" kind)
        names = names.cast(pa.string()) if names.type != pa.string() else names
        n = len(names)
        self._n = n
        validity, offsets, data = names.buffers()
        self._off = np.frombuffer(offsets, np.int32)[names.offset : names.offset + n + 1].astype(
            np.int64
        )
        self._data = np.frombuffer(data, np.uint8) if data is not None else np.empty(0, np.uint8)
        self._valid = (
            np.asarray(names.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
            if names.null_count
            else np.ones(n, dtype=bool)
        )

    def over(self, rows):
        """The matcher of the rows `rows` (kind -> a mask over them), each kind matched once."""
        masks: dict[str, np.ndarray] = {}

        def kind_of(kind: str) -> np.ndarray:
            got = masks.get(kind)
            if got is None:
                got = masks[kind] = self._match(kind, rows)
            return got

        return kind_of

    def _match(self, kind: str, sel) -> np.ndarray:
        how, word = self._MATCH[kind]
        lo, hi, valid = self._off[:-1][sel], self._off[1:][sel], self._valid[sel]
        if how == "contains":  # the rows the byte's positions fall in, over the whole column once
            if self._contains is None:
                self._contains = np.zeros(self._n, dtype=bool)
                if (
                    self._n
                ):  # the column's own bytes (a slice's lie after those of the rows before it)
                    first = int(self._off[0])
                    at = np.flatnonzero(self._data[first : self._off[-1]] == word[0]) + first
                    self._contains[np.searchsorted(self._off[1:], at, side="right")] = True
            return self._contains[sel] & valid
        k = len(word)
        fits = ((hi - lo == k) if how == "equal" else (hi - lo >= k)) & valid
        out = np.zeros(len(fits), dtype=bool)
        rows = np.flatnonzero(fits)
        start = (hi[rows] - k) if how == "ends" else lo[rows]
        # a byte at a time, from the word's end (names share their beginnings), over the rows still matching
        for i in reversed(range(k)):
            if not len(rows):
                break
            same = self._data[start + i] == word[i]
            rows, start = rows[same], start[same]
        out[rows] = True
        return out


_CACHED = 1 << 10  # (step, phase, class) bounds held at once: a few blocks' steps, not the run's


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
        projections: int = SKETCH_K,
    ):
        self.mode, self.ma, self.mb, self.since = mode, ma, mb, since
        # the leading sketch projections the runs share the vectors of (fewer between two sketch versions)
        self.projections = projections
        # each lock's `observed` (attached runs count their batch: the reduction size of the bound)
        self.observed = observed
        self.user = mode == "numeric" and (rtol is not None or atol is not None)
        self.rtol, self.atol = (rtol or 0.0), (atol or 0.0)
        self.cal = calibration if mode == "numeric" and not self.user else None
        self._cls: dict[str, str] = {}
        self._cache: dict[tuple[int, str], float] = {}
        self._eps: dict[str, float] = {}
        self._table: tuple | None = None  # derived_table's last (key, table)
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
        # an update record's own bound (analysis/updates.py), whether or not the runs recorded magnitudes:
        # `judged` says its records are held to one, `allowed` what it is (None: reported, never judged)
        self.judged = mode == "numeric" and not self.user
        self.allowed = updates.allowance(ma, mb) if self.judged else None
        if self.cal is not None and self.cal.scale == "magnitudes" and self.mags is None:
            # its noise was measured against the magnitudes: it says nothing of an error on a norm's scale
            self.ignored_calibration = self.cal
            self.cal = None
        else:
            self.ignored_calibration = None

    def magnitude(self, step: int, ra: dict | None, rb: dict | None) -> tuple[float, bool]:
        """(the larger side's magnitude, 0 if none; False where no sound bound exists) for a pair of records
        or logical values (analysis/magnitudes.py; an update record's from analysis/updates.py)."""
        ref = ra if ra is not None else (rb or {})
        name = ref.get("logical") or ref.get("tensor")
        if self.judged and ref.get("phase") == "optimizer" and updates.is_update(name):
            return self._update_scale(step, name)
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

    def row_magnitudes(self, step_of_row, cols_a, cols_b, rows) -> tuple[np.ndarray, np.ndarray]:
        """`magnitude` for rows of two aligned steps' columns (analysis/columnar.py's `Columns`, whose numpy
        columns the fold shares): (magnitudes, unbounded) arrays, looked up a step and phase at a time over
        whole columns (analysis/magnitudes.py's `lookup`)."""
        n = len(rows)
        extra, unbounded = np.zeros(n), np.zeros(n, dtype=bool)
        if not self.scaled or not n:
            return extra, unbounded
        rows = np.asarray(rows, dtype=np.int64)
        steps = np.asarray(step_of_row[rows], dtype=np.int64)
        if self.mags is None:  # update records only
            self._update_rows(steps, cols_b, rows, extra, unbounded)
            return extra, unbounded
        for mag, cols in zip(self.mags, (cols_a, cols_b)):
            order = cols["phase_order"][rows]
            index, rank, mb = (
                np.asarray(cols[c][rows], dtype=np.int64) for c in ("index", "rank", "micro_batch")
            )
            names = _NameKinds(cols.column("tensor"))
            phases = np.unique(order)
            for o in phases.tolist():  # a phase's rows of every step together
                if o >= len(PHASES):
                    continue  # an unknown phase has no magnitude
                sel = np.flatnonzero(order == o) if len(phases) > 1 else slice(None)
                v, ok = magnitudes.lookup(
                    mag,
                    steps[sel],
                    PHASES[o],
                    index[sel],
                    names.over(rows[sel]),
                    rank[sel],
                    mb[sel],
                )
                unbounded[sel] |= ~ok
                extra[sel] = np.fmax(extra[sel], v)
        self._update_rows(steps, cols_b, rows, extra, unbounded)
        return extra, unbounded

    @property
    def scaled(self) -> bool:
        """Whether a row's scale may be more than its norms: magnitudes, or update records' own bound."""
        return self.mags is not None or self.judged

    def _update_scale(self, step: int, name: str) -> tuple[float, bool]:
        """(scale, bounded) of an update record: the scale at which the phase's bound allows the update's."""
        if self.allowed is None:
            return 0.0, False
        return updates.scale(self.allowed, self.derived(step, "optimizer", name)), True

    def _update_rows(self, steps, cols, rows, extra, unbounded) -> None:
        """The update records among the rows: their scale replaces what the magnitudes said."""
        if not self.judged:
            return
        at = np.flatnonzero(cols["phase_order"][rows] == PHASES.index("optimizer"))
        if not len(at):
            return
        names = cols.column("tensor").take(pa.array(rows[at], pa.int64()))
        hit = np.asarray(
            pc.ends_with(names, updates.SUFFIX).fill_null(False).to_numpy(zero_copy_only=False),
            dtype=bool,
        )
        for i, name in zip(at[hit].tolist(), names.filter(pa.array(hit)).to_pylist()):
            extra[i], ok = self._update_scale(int(steps[i]), name)
            unbounded[i] = not ok

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
        return self.class_bound(step, phase, None if name is None else self._class(name))

    def class_bound(self, step: int, phase: str, cls: str | None) -> float:
        """`derived` for a tensor of calibration class `cls` (None: the phase's one bound)."""
        k = (step, phase, cls)
        got = self._cache.get(k)
        if got is not None:
            return got
        cache = self._cache
        if len(cache) >= _CACHED:
            # steps are asked for in order, the fold a block behind the comparison: the older half goes
            # (clearing all of it dropped the bounds of the block the fold was about to ask for)
            for old in list(itertools.islice(cache, len(cache) // 2)):
                del cache[old]
        c = None
        if self.cal is not None:
            c = (
                self.cal.by_class.get((int(step), phase, cls))
                if cls is not None
                else self.cal.bound(step, phase)
            )
        cache[k] = (
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
        return cache[k]

    def derived_table(self, steps: list[int], orders: list[int], n_orders: int) -> np.ndarray:
        """`derived` (no tensor class) at each of `steps` (rows) and phase orders (columns of n_orders, those
        not in `orders` 0): the table of the last call is kept, as a block's ranks ask for the same one."""
        key = (tuple(steps), tuple(orders))
        last = self._table
        if last is not None and last[0] == key:
            return last[1]
        table = np.zeros((len(steps), n_orders))
        cache = self._cache
        for o in orders:
            phase = PHASES[o] if o < len(PHASES) else ""
            table[:, o] = [
                cache[k] if (k := (s, phase, None)) in cache else self.derived(s, phase)
                for s in steps
            ]
        table.setflags(write=False)
        self._table = (key, table)
        return table

    def kind(self, step: int, phase: str, name: str | None = None) -> BoundKind:
        """Where the bound at (step, phase) comes from: bitwise, user, calibrated, derived or none (no
        sound bound: a parameter under Adam, analysis/magnitudes.py)."""
        if (
            self.judged
            and phase == "optimizer"
            and updates.is_update(name)
            and self.allowed is None
        ):
            return BoundKind.NONE
        if (
            self.mags is not None
            and phase == "optimizer"
            and name is not None
            and ":" not in name
            and not self.mags[0].of(step, phase, 0, name, None, 0)[1]
        ):
            return BoundKind.NONE
        if self.mode == "bitwise" or self.user:
            return BoundKind.BITWISE if self.mode == "bitwise" else BoundKind.USER
        return (
            BoundKind.CALIBRATED
            if self.cal is not None and self.cal.bound(step, phase, name) is not None
            else BoundKind.DERIVED
        )

    def class_bounds(self, step: int, phase: str) -> dict[str, float] | None:
        """Per tensor class, the bound at (step, phase) where the calibration has classes (else None): what
        the diff's sensitivity reports (analysis/diff/sensitivity.py)."""
        return sensitivity.class_bounds(self, step, phase)

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
        terms = (
            abs(na - nb) / scale_n,
            *tolerance.projection_terms(ra, rb, scale_s, self.projections),
        )
        if self.user:
            bounds = (
                (self.atol + self.rtol * scale_n) / scale_n,
                *[(self.atol + self.rtol * scale_s) / scale_s] * (len(terms) - 1),
            )
        else:
            bounds = (b0,) * len(terms)
        # each statistic also carries its own rounding (tolerance.norm_rounding, sum_rounding: float32 runs and
        # column sums; sketch_rounding: the float32 GEMV), both records'; the norm's and the sum's are added to
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
