"""Measured run-to-run noise (`disttrace calibrate MANIFEST`): where the derived bound of tolerance.py is in
doubt, measure instead. The reference runs twice (same bits expected: determinism) and once with its
initial parameters perturbed by one unit in the last place (run/perturb.py, as TTrace estimates its
thresholds); the largest relative error per (step, phase) between the reference and the perturbed run is
the noise, and `safety` times it is the calibrated bound that `diff --calibration FILE` uses (a phase the
perturbation never reached, noise 0, keeps its derived bound). No torch here: it reads run stores."""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from disttrace.analysis import tolerance
from disttrace.errors import BadInput
from disttrace.store import safeio
from disttrace.store.rundir import Run

KIND = "disttrace-calibration"
DEFAULT_SAFETY = 10.0


def rel_err(ra: dict, rb: dict) -> float | None:
    """diff's relative error of two records (norm, sum and sketch terms); None without finite statistics."""
    if any(r.get(k) is None for r in (ra, rb) for k in ("sum", "norm")):
        return None
    na, nb = float(ra["norm"]), float(rb["norm"])
    scale = max(na, nb, 1e-300)
    numel = max(int(ra.get("numel") or 0), int(rb.get("numel") or 0), 1)
    return max(abs(na - nb) / scale, *tolerance.projection_terms(ra, rb, scale * math.sqrt(numel)))


def noise(a: Path, b: Path) -> dict[int, dict[str, float]]:
    """Largest rel_err per (step, phase) between two runs of one manifest (same topology)."""
    ra, rb = Run(a), Run(b)
    out: dict[int, dict[str, float]] = {}
    for rank in ra.ranks():
        key = lambda r: (r["step"], r["micro_batch"], r["phase"], r["index"], r["tensor"])  # noqa: E731
        left = {key(r): r for r in ra.records(rank)}
        for r in rb.records(rank):
            other = left.get(key(r))
            if other is None:
                continue
            e = 0.0 if other.get("digest") == r.get("digest") else rel_err(other, r)
            if e is None:
                continue
            cur = out.setdefault(r["step"], {})
            cur[r["phase"]] = max(cur.get(r["phase"], 0.0), e)
    return out


def build(manifest_id: str, runs: dict[str, str], relative: float, safety: float) -> dict:
    repeat = noise(Path(runs["reference"]), Path(runs["repeat"]))
    perturbed = noise(Path(runs["reference"]), Path(runs["perturbed"]))
    rep_max = max((v for ph in repeat.values() for v in ph.values()), default=0.0)
    bounds = {
        str(s): {p: safety * max(v, repeat.get(s, {}).get(p, 0.0)) for p, v in ph.items() if v > 0}
        for s, ph in sorted(perturbed.items())
    }
    return {
        "kind": KIND,
        "version": 1,
        "manifest_id": manifest_id,
        "runs": runs,
        "perturbation": {
            "relative": relative,
            "what": "initial parameters x (1 +- relative), signs seeded",
        },
        "repeat_bit_identical": rep_max == 0.0,
        "repeat_max_rel_err": rep_max,
        "safety": safety,
        "noise": {str(s): ph for s, ph in sorted(perturbed.items())},
        "bounds": bounds,
    }


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
                if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                    raise BadInput(
                        self.path,
                        f"bounds.{s}.{p}: {v!r} is not a finite number >= 0",
                        field="bounds",
                    )
                self.bounds[(int(s), p)] = float(v)
        self.manifest_id = doc["manifest_id"]
        self.doc = doc

    def bound(self, step: int, phase: str) -> float | None:
        return self.bounds.get((int(step), phase))
