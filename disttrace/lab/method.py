"""`disttrace lab`: the whole method as one command.

freeze -> reference (reused when a complete, verified one exists) -> one fault -> recover -> diff both
paths against the reference -> gate both. With --predict the learner writes down, before the run, where
the first divergence will be; the lab says whether it held, or in which coordinate it missed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.lab import (
    LabDiffs,
    LabPaths,
    LabResult,
    PathOutcome,
    Signature,
    judge_prediction,
)
from disttrace.analysis.result import DiffResult
from disttrace.config.freezing import freeze
from disttrace.errors import BadInput, JobFailed
from disttrace.gate.verdict import gate
from disttrace.run import faults
from disttrace.run.job.launch import launch, prepare
from disttrace.run.job.recovery import choose_checkpoint, resume_spec
from disttrace.store import checkpoints as checkpoint
from disttrace.store.records import PHASES
from disttrace.store.rundir import Run
from disttrace.store.verify import find_reference
from disttrace.views.lab import markup_safe

PREDICT = re.compile(r"^(?P<phase>[a-z]+)(@(?P<step>\d+)(:(?P<rank>\d+))?)?$")


def parse_prediction(text: str | None) -> dict | None:
    if not text:
        return None
    m = PREDICT.match(text.strip())
    if not m or m.group("phase") not in PHASES:
        raise BadInput(
            "--predict",
            f"'{text}' is not PHASE[@STEP[:RANK]] with PHASE one of {', '.join(PHASES)}",
        )
    return {k: (int(v) if k != "phase" and v is not None else v) for k, v in m.groupdict().items()}


@dataclass(frozen=True)
class Launched:
    """How one path's job ended: exit 0, or 3 with why (a fault may make the job fail)."""

    run_dir: str
    exit: int = 0
    reason: str | None = None


def _run(run_dir: Path, progress, follow=None, path: str = "") -> Launched:
    """Launch one path; `follow(run_dir, path)`, if given, is a context manager that shows its live progress."""
    try:
        if follow is None:
            launch(run_dir)
        else:
            with follow(run_dir, path):
                launch(run_dir)
        return Launched(str(run_dir))
    except JobFailed as e:
        progress(f"[yellow]job failed (exit 3), as a fault may make it:[/yellow] {markup_safe(e)}")
        return Launched(str(run_dir), 3, str(e))


def final_loss(run_dir: str) -> float | None:
    losses = Run(run_dir).losses()
    return losses[max(losses)] if losses else None


def expected_signature(
    spec: dict,
    fault_res: Launched,
    d_fault: DiffResult | None,
    d_rec: DiffResult | None,
    resume_step,
) -> tuple[bool, str]:
    exp = spec["expect"]
    first = d_fault.first_divergence if d_fault else None
    if exp == "exit-3":
        return fault_res.exit == 3, f"job ended with exit {fault_res.exit}"
    if exp == "refused-at-load":
        ck = Path(fault_res.run_dir) / "checkpoints" / f"step-{spec['step']:06d}"
        ok, why = checkpoint.status(ck, Run(fault_res.run_dir).manifest_id)
        return (not ok), f"checkpoint of step {spec['step']}: {why}"
    if exp == "none":
        equal = bool(d_fault and d_fault.equal)
        return equal, "numerics equal" if equal else "numerics differ"
    if exp == "resume:optimizer":
        f = d_rec.first_divergence if d_rec else None
        ok = f is not None and f.phase == "optimizer" and f.step == resume_step + 1
        return ok, (
            f"recovered run diverges at step {f.step} {f.phase}" if f else "recovered run equal"
        )
    if not first:
        return False, "no divergence found"
    ok = first.step == spec["step"] and first.phase == exp and first.rank == spec["rank"]
    return ok, f"first divergence at step {first.step} {first.phase} rank {first.rank}"


def _reference(frozen, out: Path, progress, follow) -> Path:
    """The reference path: a complete, verified one of the manifest under `out` reused, else run."""
    ref = find_reference(out, frozen.manifest_id)
    if ref:
        progress(f"reference: reusing complete, verified {markup_safe(ref)}")
        return ref
    ref = prepare(frozen, out, "reference")
    progress(f"reference: running {markup_safe(ref)}")
    res = _run(ref, progress, follow, "reference")
    if res.exit:
        raise JobFailed(f"the reference run failed: {res.reason}", str(ref))
    return ref


def _recovered(
    frozen, out: Path, fault_dir: Path, progress, follow
) -> tuple[Launched | None, int | None]:
    """The recovered path: the fault removed, resumed from the fault run's last good checkpoint (None where
    it has none), and the step it resumed from."""
    try:
        _, ckpt, why = choose_checkpoint(fault_dir, None)
        resume_step = int(ckpt.name.split("-")[1])
        rec_dir = prepare(
            frozen, out, "recovered", resume=resume_spec(frozen, out, ckpt, fault_dir)
        )
        progress(
            f"recovered: fault removed, resuming from {markup_safe(ckpt.name)} ({markup_safe(why)}): {markup_safe(rec_dir)}"
        )
        return _run(rec_dir, progress, follow, "recovered"), resume_step
    except BadInput as e:
        progress(f"[yellow]no recovery possible:[/yellow] {markup_safe(e)}")
        return None, None


def _zoomed(ref: Path, fault_dir: Path, depth: str, d_fault: DiffResult, progress):
    """The fault path's first divergence with the module (and op) inside its step (docs/zoom.md); diff's,
    where the step could not be zoomed into."""
    from disttrace.lab.zoom import zoom

    try:
        return zoom(ref, fault_dir, depth=depth, diff=d_fault, progress=progress).first_divergence
    except (BadInput, JobFailed) as e:
        progress(f"[yellow]not zoomed:[/yellow] {markup_safe(e)}")
        return d_fault.first_divergence


def _recovered_outcome(
    rec_res: Launched | None, resume_step: int | None, d_rec: DiffResult | None, g_rec
) -> PathOutcome | None:
    if rec_res is None:
        return None
    return PathOutcome(
        run_dir=rec_res.run_dir,
        exit=rec_res.exit,
        resumed_from_step=resume_step,
        final_loss=final_loss(rec_res.run_dir),
        first_divergence=d_rec.first_divergence,
        equal_to_reference=d_rec.equal,
        gate=g_rec.passed,
        gate_failed=[c.name for c in g_rec.checks if c.passed is False],
    )


def run_lab(
    manifest: Path | None,
    fault: str,
    step: int,
    rank: int,
    params: dict,
    sets: list[str],
    out: Path,
    predict: str | None,
    progress,
    follow=None,
    zoom_depth: str | None = None,
) -> LabResult:
    frozen = freeze(manifest, sets)
    spec = faults.get(fault).spec(step, rank, params, frozen.model())
    prediction = parse_prediction(predict)
    if prediction:
        progress(
            f"prediction written down before the run: first divergence in {markup_safe(predict)}"
        )
    ref = _reference(frozen, out, progress, follow)
    fault_dir = prepare(frozen, out, "fault", fault=spec)
    progress(f"fault: {markup_safe(fault)} at step {step} rank {rank}: {markup_safe(fault_dir)}")
    fault_res = _run(fault_dir, progress, follow, "fault")
    rec_res, resume_step = _recovered(frozen, out, fault_dir, progress, follow)
    progress("diff and gate ...")
    d_fault = diff_runs(ref, fault_dir)
    d_rec = diff_runs(ref, rec_res.run_dir) if rec_res else None
    g_ref = gate(ref)
    g_fault = gate(fault_dir, ref)
    g_rec = gate(Path(rec_res.run_dir), ref) if rec_res else None

    sig_ok, sig_why = expected_signature(spec, fault_res, d_fault, d_rec, resume_step)
    fault_first = d_fault.first_divergence
    if zoom_depth and fault_first is not None and not fault_res.exit:
        fault_first = _zoomed(ref, fault_dir, zoom_depth, d_fault, progress)
    recovered_ok = spec["expect"] == "resume:optimizer" or bool(  # that one's recovery diverges
        d_rec and d_rec.equal and g_rec and g_rec.passed
    )
    paths = LabPaths(
        reference=PathOutcome(
            run_dir=str(ref), final_loss=final_loss(ref), first_divergence=None, gate=g_ref.passed
        ),
        fault=PathOutcome(
            run_dir=str(fault_dir),
            exit=fault_res.exit,
            final_loss=final_loss(fault_dir),
            first_divergence=fault_first,
            gate=g_fault.passed,
            gate_failed=[c.name for c in g_fault.checks if c.passed is False],
        ),
        recovered=_recovered_outcome(rec_res, resume_step, d_rec, g_rec),
    )
    return LabResult(
        manifest_id=frozen.manifest_id,
        fault=spec,
        paths=paths,
        expected_signature=Signature(expect=spec["expect"], observed=sig_why, held=sig_ok),
        prediction=judge_prediction(prediction, d_fault.first_divergence),
        accepted=sig_ok and recovered_ok and g_ref.passed,
        diffs=LabDiffs(fault=d_fault, recovered=d_rec),
    )
