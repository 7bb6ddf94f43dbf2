"""What a numeric diff could not have seen: per phase, the smallest relative change it would have flagged
(docs/tolerance.md, "Sensitivity").

A record is divergent when its rel_err (the difference of a statistic relative to its scale: the larger of
the records' norms and the magnitudes that produced them) exceeds the bound at its (step, phase). So the
bound *is* the sensitivity there: a change of relative size below it is accepted as another layout's
rounding. The fold hands this module the bound of every (step, phase) whose records were held to one (some
record not bit-equal: the step entry's `bound_by_phase`), which the diff computes anyway; nothing here looks
at a record. What it keeps is a float a step and phase (the median's).
"""

from __future__ import annotations

import functools
import statistics
from array import array

from disttrace.analysis import tolerance
from disttrace.analysis.result import BoundKind, PhaseSensitivity

NONE = "none"  # a class no sound bound covers: the diff could not have seen a change there at that phase


class Sensitivity:
    """The bounds a numeric diff held each phase to, step by step; `result` sums them up per phase."""

    __slots__ = ("_phases",)

    def __init__(self):
        # phase -> [largest bound, its step, its kind, every bound (for the median: 8 bytes a step), whether
        # a bound was a user's atol's (no single figure)]
        self._phases: dict[str, list] = {}

    def add(
        self,
        step: int,
        phase: str,
        bound: float | None,
        kind: BoundKind,
        by_class: dict[str, float] | None = None,
    ) -> None:
        """The bound `phase` was held to at `step`; `by_class`: each tensor class's, where a calibration has
        classes (`class_bounds`): the phase's figure is then the largest of them."""
        got = self._phases.get(phase)
        if got is None:
            got = self._phases[phase] = [-1.0, step, kind, array("d"), False, {}]
        if bound is None:
            # a user's atol: rel_err's threshold is rtol + atol / scale, record by record
            got[4] = True
            bound = 0.0
        bound = float(bound)
        if by_class:
            per_class = got[5]
            for cls, v in by_class.items():
                if v > per_class.get(cls, -1.0):
                    per_class[cls] = v
            bound = max(bound, *by_class.values())
        got[3].append(bound)
        if bound > got[0]:
            got[:3] = bound, int(step), kind

    def result(
        self, classes: dict[str, dict[str, float | str]] | None = None
    ) -> dict[str, PhaseSensitivity]:
        """Per phase (in the order they were first held to a bound): the largest bound over the steps and
        where (the first step it was reached at), its median, the number of steps; per tensor class the
        largest where a calibration has classes; `classes`: per phase, the classes of records held to another
        figure (`classes` below: a factor on the phase's bound, or NONE)."""
        out = {}
        for phase, (largest, step, kind, bounds, scaled, per_class) in self._phases.items():
            worst = None if scaled else largest
            median = None if scaled else statistics.median(bounds)
            own = dict(sorted(per_class.items()))
            own.update(
                (cls, f if isinstance(f, str) else (None if worst is None else worst * f))
                for cls, f in (classes or {}).get(phase, {}).items()
            )
            out[phase] = PhaseSensitivity(
                bound_kind=kind,
                max=worst,
                median=median,
                step=step,
                steps=len(bounds),
                classes={c: v for c, v in own.items() if v is not None} or None,
            )
        return out


def class_bounds(tol, step: int, phase: str) -> dict[str, float] | None:
    """Per tensor class, the bound a comparison under `tol` holds a record of that class to at (step, phase),
    where its calibration has classes (None otherwise: one bound holds the whole phase). A class the
    calibration measured at the phase but not at this step keeps the derived bound, as `_Tol.derived`
    does."""
    cal = tol.cal
    if cal is None or cal.by_class is None or tol.mode != "numeric" or tol.user:
        return None
    return {cls: tol.class_bound(step, phase, cls) for cls in _classes(cal, phase)}


@functools.lru_cache(maxsize=64)
def _classes(cal, phase: str) -> tuple[str, ...]:
    """The tensor classes a calibration measured at `phase`, at any step: those the phase's records hold (a
    class whose noise was 0 at every step of it is left out: the perturbation reaches every parameter)."""
    return tuple(sorted({c for _, p, c in cal.by_class if p == phase}))


def classes(tol) -> dict[str, dict[str, float | str]]:
    """Per phase, the classes of records that a comparison under `tol` (analysis/diff/tol.py) holds to
    another figure than the phase's bound: Adam's second moment to twice it (tolerance.tensor_factor), and
    none, on the magnitudes' scale, the clip coefficient (its difference is the norm's, on the parts' scale)
    and the parameters under Adam (analysis/magnitudes.py's `of`). A user's rtol/atol holds every record
    alike."""
    if tol.mode != "numeric" or tol.user:
        return {}
    if tol.mags is not None:
        optimizer = tol.mags[0].optimizer
    else:
        training = tol.ma.get("training") if isinstance(tol.ma, dict) else None
        optimizer = str((training or {}).get("optimizer") or "adamw").lower()
    adam = optimizer != "sgd"
    out: dict[str, dict[str, float | str]] = {}
    if adam:
        out["optimizer"] = {"exp_avg_sq": tolerance.tensor_factor(":exp_avg_sq")}
    if tol.mags is not None:
        out["clip"] = {"clip_coef": NONE}
        if adam:
            out["optimizer"]["parameters"] = NONE
    return out


def worst(by_phase: dict[str, PhaseSensitivity]) -> tuple[str, str | None, float | None] | None:
    """(phase, class or None, figure) of the least sensitive bounded figure of a result; figure None where a
    user's atol makes it depend on each record's scale; None when no phase was held to a bound."""
    best = None
    for phase, s in by_phase.items():
        figures = [(None, s.max)] + [
            (c, v) for c, v in (s.classes or {}).items() if not isinstance(v, str)
        ]
        for cls, v in figures:
            key = float("inf") if v is None else v
            if best is None or key > best[0]:
                best = (key, (phase, cls, v))
    return None if best is None else best[1]
