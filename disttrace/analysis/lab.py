"""What a lab found (`disttrace lab --json`): each path's outcome against the reference, whether the fault's
expected signature held, the learner's prediction judged, and whether the attribution is accepted. The lab
(lab/method.py) runs the jobs and builds these; views/lab.py renders them."""

from __future__ import annotations

from dataclasses import dataclass

from disttrace.analysis.result import DiffResult, Divergence
from disttrace.jsondoc import JsonDoc, omit_none


@dataclass
class Prediction(JsonDoc):
    """The learner's prediction, written before the run, against the first divergence found."""

    held: bool
    missed: list[str]  # each coordinate that missed, predicted against observed
    predicted: dict  # phase, step, rank as parsed (step and rank may be None)
    observed: dict | None  # the first divergence's coordinates


@dataclass
class PathOutcome(JsonDoc):
    """One path of the lab: how its job ended, where it first differs from the reference, the gate."""

    run_dir: str
    exit: int | None = omit_none()  # the job's exit (fault and recovered paths)
    resumed_from_step: int | None = omit_none()  # recovered path
    final_loss: float | None = None
    first_divergence: Divergence | None = None
    equal_to_reference: bool | None = omit_none()  # recovered path
    gate: bool = False
    gate_failed: list[str] | None = omit_none()  # the failed checks (fault and recovered paths)


@dataclass
class LabPaths(JsonDoc):
    reference: PathOutcome
    fault: PathOutcome
    recovered: PathOutcome | None  # None: no checkpoint to recover from


@dataclass
class Signature(JsonDoc):
    expect: str  # the fault's expected signature (its catalog entry)
    observed: str
    held: bool


@dataclass
class LabDiffs(JsonDoc):
    fault: DiffResult
    recovered: DiffResult | None


@dataclass
class LabResult(JsonDoc):
    """`disttrace lab --json`."""

    manifest_id: str
    fault: dict  # the fault spec as the run's run.json holds it
    paths: LabPaths
    expected_signature: Signature
    prediction: Prediction | None
    accepted: bool  # the fault explains the divergence and the recovered path rejoins the reference
    diffs: LabDiffs


def judge_prediction(pred: dict | None, first: Divergence | None) -> Prediction | None:
    if pred is None:
        return None
    if first is None:
        return Prediction(False, ["no divergence was found"], pred, None)
    missed = [
        f"{k}: predicted {pred[k]}, observed {getattr(first, k)}"
        for k in ("phase", "step", "rank")
        if pred.get(k) is not None and pred[k] != getattr(first, k)
    ]
    observed = {k: getattr(first, k) for k in ("step", "micro_batch", "phase", "rank", "tensor")}
    return Prediction(not missed, missed, pred, observed)
