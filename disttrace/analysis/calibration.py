"""Measured run-to-run noise (`disttrace calibrate MANIFEST`, or `disttrace run --calibrate`): where the
derived bound of tolerance.py is in doubt, measure instead, the way TTrace sets its thresholds: perturb,
measure, multiply by a stated safety factor. The reference runs twice (same bits expected: determinism) and
once with its initial parameters perturbed by one unit in the last place (run/faults/perturb.py); the largest
relative error between the reference and the perturbed run, per step, phase and tensor class (embedding,
attention, mlp, norm, output, other: model/names.py's `tensor_class`), is the noise, and `safety` times it
is the calibrated bound diff and gate use (where the perturbation never reached, noise 0, the derived bound
holds). The error is taken on the scale diff compares on: against the magnitudes that produced each record
when the runs recorded them (analysis/magnitudes.py), else against the records' norms; the file says which
(`scale`), and diff uses a calibration of the magnitudes' scale only where it compares on it.
Per class because one class's noise is not another's: an attention projection's gradient cancels through
the softmax, an RMSNorm weight sees a normalised input; one bound per phase is the loosest class's.
No torch here: it reads run stores."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import orjson

from disttrace.analysis import tolerance, updates
from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc
from disttrace.model.names import CLASSES, tensor_class
from disttrace.store import safeio
from disttrace.store.rundir import Run
from disttrace.store.trajectory import shared_projections

KIND = "disttrace-calibration"
DEFAULT_SAFETY = 10.0


@dataclass
class Perturbation(JsonDoc):
    relative: float  # each initial parameter multiplied by 1 +- this
    what: str = "initial parameters x (1 +- relative), signs seeded"


@dataclass
class CalibrationDoc(JsonDoc):
    """calibration.json as `build` makes it (`calibrate --json` adds its path). Per step (a string, as JSON
    keys are) and phase, and per step, phase and tensor class: the noise measured and the bound it gives."""

    kind: str
    version: int
    manifest_id: str
    runs: dict[str, str]  # reference, repeat, perturbed: their run directories
    perturbation: Perturbation
    repeat_bit_identical: bool
    repeat_max_rel_err: float
    safety: float
    scale: str  # magnitudes | norm: what the errors are relative to
    classes: list[str]
    noise: dict[str, dict[str, float]]
    bounds: dict[str, dict[str, float]]
    noise_by_class: dict[str, dict[str, dict[str, float]]]
    bounds_by_class: dict[str, dict[str, dict[str, float]]]


def rel_err(
    ra: dict, rb: dict, magnitude: float = 0.0, projections: int | None = None
) -> float | None:
    """diff's relative error of two records (norm, sum and sketch terms) on diff's scale: the larger of their
    norms and `magnitude` (what produced them, analysis/magnitudes.py; 0 for a store without magnitudes);
    None without finite statistics; `projections`: the sketch projections both share the vectors of."""
    if any(r.get(k) is None for r in (ra, rb) for k in ("sum", "norm")):
        return None
    na, nb = float(ra["norm"]), float(rb["norm"])
    scale = max(na, nb, magnitude, 1e-300)
    numel = max(int(ra.get("numel") or 0), int(rb.get("numel") or 0), 1)
    return max(
        abs(na - nb) / scale,
        *tolerance.projection_terms(ra, rb, scale * math.sqrt(numel), projections),
    )


def noise(a: Path, b: Path, magnitudes: bool = True) -> tuple[dict, dict, str]:
    """Largest rel_err per (step, phase) and per (step, phase, tensor class) between two runs of one
    manifest (same topology), and the scale it was taken on: "magnitudes" when both runs recorded them
    (the scale diff compares on; a record with no sound bound, a parameter under Adam, is left out as diff
    never judges it), else "norm"."""
    from disttrace.analysis.magnitudes import Magnitudes

    ra, rb = Run(a), Run(b)
    # sketches of two versions are other projections but the first (store.trajectory.shared_projections)
    shared = shared_projections(ra.sketch_versions(), rb.sketch_versions())
    mags = (Magnitudes(ra), Magnitudes(rb)) if magnitudes else None
    if mags is not None and not all(m.available for m in mags):
        mags = None
    by_phase: dict[int, dict[str, float]] = {}
    by_class: dict[int, dict[str, dict[str, float]]] = {}
    key = lambda r: (r["step"], r["micro_batch"], r["phase"], r["index"], r["tensor"])  # noqa: E731
    for rank in ra.ranks():
        left = {key(r): r for r in ra.records(rank)}
        for r in rb.records(rank):
            other = left.get(key(r))
            if other is None or updates.is_update(r["tensor"]):
                continue  # an update record is held to the Adam step's bound, not to a measured noise
            m = 0.0
            if mags is not None:
                found = [
                    mag.of(
                        x["step"],
                        x["phase"],
                        int(x["index"]),
                        x["tensor"],
                        x.get("rank"),
                        int(x["micro_batch"]),
                    )
                    for mag, x in zip(mags, (other, r))
                ]
                if not all(ok for _, ok in found):
                    continue  # no sound bound: diff reports it, never judges it
                m = max((v for v, _ in found if v is not None), default=0.0)
            e = 0.0 if other.get("digest") == r.get("digest") else rel_err(other, r, m, shared)
            if e is None:
                continue
            step, phase = r["step"], r["phase"]
            cur = by_phase.setdefault(step, {})
            cur[phase] = max(cur.get(phase, 0.0), e)
            cls = by_class.setdefault(step, {}).setdefault(phase, {})
            c = tensor_class(r["tensor"])
            cls[c] = max(cls.get(c, 0.0), e)
    return by_phase, by_class, "magnitudes" if mags is not None else "norm"


def build(manifest_id: str, runs: dict[str, str], relative: float, safety: float) -> CalibrationDoc:
    """The calibration document: `safety` x the larger of the perturbed run's and the repeat's noise, per
    step and phase (`bounds`, what a reader of the first version reads) and per step, phase and tensor
    class (`bounds_by_class`, what diff uses when present). A (step, phase[, class]) whose noise is 0 (the
    perturbation did not reach it) gets no bound: the derived one holds there."""
    repeat, repeat_cls, _ = noise(Path(runs["reference"]), Path(runs["repeat"]))
    perturbed, perturbed_cls, scale = noise(Path(runs["reference"]), Path(runs["perturbed"]))
    rep_max = max((v for ph in repeat.values() for v in ph.values()), default=0.0)
    bounds = {
        str(s): {p: safety * max(v, repeat.get(s, {}).get(p, 0.0)) for p, v in ph.items() if v > 0}
        for s, ph in sorted(perturbed.items())
    }
    by_class = {
        str(s): {
            p: {
                c: safety * max(v, repeat_cls.get(s, {}).get(p, {}).get(c, 0.0))
                for c, v in sorted(cls.items())
                if v > 0
            }
            for p, cls in ph.items()
            if any(v > 0 for v in cls.values())
        }
        for s, ph in sorted(perturbed_cls.items())
    }
    return CalibrationDoc(
        kind=KIND,
        version=2,
        manifest_id=manifest_id,
        runs=runs,
        perturbation=Perturbation(relative),
        repeat_bit_identical=rep_max == 0.0,
        repeat_max_rel_err=rep_max,
        safety=safety,
        scale=scale,
        classes=list(CLASSES),
        noise={str(s): ph for s, ph in sorted(perturbed.items())},
        bounds=bounds,
        noise_by_class={
            str(s): {p: dict(sorted(c.items())) for p, c in ph.items()}
            for s, ph in sorted(perturbed_cls.items())
        },
        bounds_by_class=by_class,
    )


def _bound_value(path, where: str, v) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise BadInput(
            path, f"{where}: {v!r} is not a finite number >= 0", field=where.split(".")[0]
        )
    return float(v)


class Calibration:
    """A calibration file as diff uses it."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:  # a regular file of at most a JSON document's size (a FIFO or /dev/zero is refused unread)
            doc = orjson.loads(safeio.read_bytes(self.path, None, "json"))
        except orjson.JSONDecodeError:
            raise BadInput(self.path, "not valid JSON") from None
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            raise BadInput(self.path, f"not a calibration file (kind != {KIND!r})", field="kind")
        if not isinstance(doc.get("manifest_id"), str):
            raise BadInput(self.path, "lacks a manifest_id", field="manifest_id")
        bounds = doc.get("bounds")
        if not isinstance(bounds, dict):
            raise BadInput(self.path, "lacks bounds", field="bounds")
        self.bounds: dict[tuple[int, str], float] = {}
        for s, phases in bounds.items():
            if not (isinstance(s, str) and s.isdigit() and isinstance(phases, dict)):
                raise BadInput(
                    self.path,
                    f"bounds: step {s!r} is not a step number with phases",
                    field="bounds",
                )
            for p, v in phases.items():
                self.bounds[(int(s), p)] = _bound_value(self.path, f"bounds.{s}.{p}", v)
        # per tensor class (version 2); a file without them calibrates per step and phase only
        self.by_class: dict[tuple[int, str, str], float] | None = None
        classes = doc.get("bounds_by_class")
        if classes is not None:
            if not isinstance(classes, dict):
                raise BadInput(
                    self.path, "bounds_by_class is not an object", field="bounds_by_class"
                )
            self.by_class = {}
            for s, phases in classes.items():
                if not (isinstance(s, str) and s.isdigit() and isinstance(phases, dict)) or not all(
                    isinstance(c, dict) for c in phases.values()
                ):
                    raise BadInput(
                        self.path,
                        f"bounds_by_class: step {s!r} is not a step number with phases of classes",
                        field="bounds_by_class",
                    )
                for p, cls in phases.items():
                    for c, v in cls.items():
                        where = f"bounds_by_class.{s}.{p}.{c}"
                        self.by_class[(int(s), p, c)] = _bound_value(self.path, where, v)
        scale = doc.get("scale", "norm")
        if scale not in ("norm", "magnitudes"):
            raise BadInput(
                self.path, f"scale {scale!r} is neither norm nor magnitudes", field="scale"
            )
        # the scale its noise was measured on: a calibration on the magnitudes' scale says nothing of
        # errors taken against a record's norm (a store without magnitudes), see diff's _Tol
        self.scale = scale
        self.manifest_id: str = doc["manifest_id"]
        self.safety = doc.get("safety")  # echoed in diff's tolerance as the file states it

    def bound(self, step: int, phase: str, name: str | None = None) -> float | None:
        """The calibrated bound of a record of tensor `name` at (step, phase): its class's where the file
        has classes, else its phase's; None where nothing was measured (the derived bound holds)."""
        if name is not None and self.by_class is not None:
            return self.by_class.get((int(step), phase, tensor_class(name)))
        return self.bounds.get((int(step), phase))
