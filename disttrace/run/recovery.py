"""Which checkpoint a recovered path resumes from: the last one that verifies and precedes the fault."""

from __future__ import annotations

from pathlib import Path

from disttrace.config.manifest import Frozen
from disttrace.errors import BadInput
from disttrace.store import checkpoints as checkpoint
from disttrace.store.paths import contained, inside
from disttrace.store.rundir import Run


def choose_checkpoint(run_path: Path, from_step: int | None) -> tuple[Frozen, Path, str]:
    run = Run(run_path)
    frozen = Frozen.model_validate(run.lock)
    fault = run.run_info.fault
    # a checkpoint directory that is a link out of the run is refused, not followed (paths stay in the store)
    ckpts = {int(p.name.split("-")[1]): contained(p, run.path, p) for p in run.checkpoint_dirs()}
    if from_step is not None:
        if from_step not in ckpts:
            raise BadInput(
                run.path / "checkpoints",
                f"no checkpoint at step {from_step} (have: {sorted(ckpts) or 'none'})",
                field="--from-step",
            )
        checkpoint.verify(ckpts[from_step], run.manifest_id)  # raises naming the bad file
        return frozen, ckpts[from_step], f"--from-step {from_step}"
    if fault:
        # a fault at step S has touched the state saved at S, unless it acts on the checkpoint itself
        # (then the checkpoint of S is the subject: optimizer-reset's recovery shows why it is bad)
        limit = fault.step if fault.point == "checkpoint" else fault.step - 1
        why = f"last verified checkpoint at or before step {limit}, before the fault at step {fault.step}"
    else:
        limit = max(ckpts, default=0)
        why = "last verified checkpoint"
    rejected = []
    for step in sorted((s for s in ckpts if s <= limit), reverse=True):
        ok, reason = checkpoint.status(ckpts[step], run.manifest_id)
        if ok:
            note = f"; skipped: {'; '.join(rejected)}" if rejected else ""
            return frozen, ckpts[step], why + note
        rejected.append(reason)
    raise BadInput(
        run.path / "checkpoints",
        f"no checkpoint at or before step {limit} verifies"
        + (f" ({'; '.join(rejected)})" if rejected else " (none written; set checkpoint.interval)"),
    )


def resume_spec(frozen: Frozen, root: Path, ckpt: Path, from_run: Path) -> dict:
    """run.json's `resume`: the checkpoint relative to <root>/<id12>/, so the run store stays movable."""
    import os

    base = (Path(root) / frozen.manifest_id[:12]).resolve()
    if not inside(ckpt, root):  # the worker refuses a resume path outside its runs root: say so now
        raise BadInput(
            "--out",
            f"{ckpt} is outside the runs root {root}: a recovered run lives in the runs root "
            "of the run it resumes from",
        )
    return {
        "checkpoint": os.path.relpath(ckpt.resolve(), base),
        "step": int(ckpt.name.split("-")[1]),
        "from_run": str(Path(from_run).resolve()),
    }


def checkpoint_before(run_path: Path, step: int) -> tuple[Frozen, Path | None, str]:
    """The last checkpoint of the run at or before `step` that verifies, for a replay of step + 1; None
    when there is none (the replay then starts from the manifest's initial state, step 0)."""
    from disttrace.store.paths import resume_checkpoint

    run = Run(run_path)
    frozen = Frozen.model_validate(run.lock)
    ckpts = {int(p.name.split("-")[1]): contained(p, run.path, p) for p in run.checkpoint_dirs()}
    resumed = run.run_info.resume
    if resumed and resumed.step <= step and resumed.step not in ckpts:
        # a recovered run's state at its resume step is the checkpoint it resumed from (another run's)
        ckpts[resumed.step] = resume_checkpoint(run.path, resumed)
    rejected = []
    for s in sorted((s for s in ckpts if s <= step), reverse=True):
        ok, reason = checkpoint.status(ckpts[s], run.manifest_id)
        if ok:
            note = f"; skipped: {'; '.join(rejected)}" if rejected else ""
            return frozen, ckpts[s], f"last verified checkpoint at or before step {step}{note}"
        rejected.append(reason)
    why = "no checkpoint at or before step " + str(step)
    return frozen, None, why + (f" verifies ({'; '.join(rejected)})" if rejected else "")
