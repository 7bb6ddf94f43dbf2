"""Which checkpoint a recovered path resumes from: the last one that verifies and precedes the fault."""

from __future__ import annotations

from pathlib import Path

from disttrace.config.freezing import Frozen
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


def resume_spec(
    frozen: Frozen, root: Path, ckpt: Path, from_run: Path, copied_from: Path | None = None
) -> dict:
    """run.json's `resume`: the checkpoint relative to <root>/<id12>/, so the run store stays movable.
    `copied_from`: where the checkpoint lay before import_checkpoint copied it into the runs root."""
    import os

    base = (Path(root) / frozen.manifest_id[:12]).resolve()
    if not inside(ckpt, root):  # the worker refuses a resume path outside its runs root: say so now
        raise BadInput(
            "--out",
            f"{ckpt} is outside the runs root {root}: copy it into the run first (import_checkpoint)",
        )
    return {
        "checkpoint": os.path.relpath(ckpt.resolve(), base),
        "step": int(ckpt.name.split("-")[1]),
        "from_run": str(Path(from_run).resolve()),
        **({"copied_from": str(Path(copied_from).resolve())} if copied_from else {}),
    }


IMPORTED = (
    "resume"  # <recovered run>/resume/checkpoints/step-N: the checkpoint it resumed from, copied
)


def import_checkpoint(ckpt: Path, run_dir: Path, manifest_id: str) -> Path:
    """Copy a verified checkpoint of another runs root into `run_dir` (a recovered run in another root: a
    worker loads only checkpoints inside its own runs root, since run.json may come from elsewhere), and
    verify the copy again before it is published under its final name. Every file is read through
    store/safeio.py inside the run it came from, and only the files its INDEX lists (and the INDEX) are
    copied. Returns the copy."""
    import os
    import shutil

    from disttrace.store import safeio
    from disttrace.store.checkpoints import INDEX, verified_index
    from disttrace.store.writers import writing

    source_run = ckpt.parent.parent
    index = verified_index(ckpt, manifest_id, source_run)
    final = Path(run_dir) / IMPORTED / "checkpoints" / ckpt.name
    partial = final.with_name(final.name + ".partial")
    try:
        partial.mkdir(parents=True)
        for name in [*sorted(index.files), INDEX]:
            with (
                writing(partial / name),
                safeio.open_file(ckpt / name, source_run) as src,
                open(partial / name, "xb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
        verified_index(
            partial, manifest_id, run_dir
        )  # the copy, read back: the same bytes or refused
        os.replace(partial, final)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


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
