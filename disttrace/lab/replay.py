"""`disttrace replay RUN --step S`: re-execute RUN's step S from its last verified checkpoint before it.

The replay is a run store of its own kind (run.json `path: "replay"`, directory `replay-<S>` beside RUN,
`replay.of` naming RUN), written by the ordinary job and recorder and sealed like any other, so `verify`,
`show` and `diff` read it. It resumes from RUN's last checkpoint at or before S-1 that verifies (recover's
machinery; the manifest's initial state when there is none), runs to S and stops. RUN's fault goes with it
only when the fault's nature says it recurs when its step is executed again (faults.RECURRENCES): a
standing bug does, a bit flip does not, a faulty device does, wherever its slot is. With
`permute_ranks`, logical rank r runs in launch slot (r + 1) % world (worker.take_permuted_rank).

The attribution (analysis/attribution.py) then reads the three stores only. docs/replay.md.
"""

from __future__ import annotations

from pathlib import Path

from disttrace.analysis.attribution import ReplayResult, attribute
from disttrace.errors import BadInput
from disttrace.store.documents import FaultSpec, ReplaySpec
from disttrace.store.rundir import Run

DEPTHS = ("module", "op")


def default_reference(run_dir: Path) -> Path | None:
    """The reference `lab` reuses for RUN: a complete, verified reference run of its manifest in its runs
    root (runs/<id12>/reference*). An attached run's: the same beside it, checkpoints or not (a user's
    script need not save any)."""
    from disttrace.store.verify import find_reference, verify_run

    run = Run(run_dir)
    here = Path(run_dir).resolve()
    if not run.attached:
        return find_reference(here.parent.parent, run.manifest_id)
    for d in sorted(here.parent.glob("reference*"), reverse=True):
        try:
            ref = Run(d)
            if ref.complete and ref.manifest_id == run.manifest_id and verify_run(d).exit_ok:
                return d
        except BadInput:
            continue
    return None


def kept_fault(spec: FaultSpec | None, where: Path | str = "run.json") -> dict | None:
    """RUN's fault as its run.json states it, if it recurs when its step is executed again; else None (the
    replay runs without it)."""
    from disttrace.run import faults

    if spec is None:
        return None
    cls = faults.REGISTRY.get(spec.name)
    if cls is None:
        raise BadInput(where, f"unknown fault '{spec.name}'", field="fault.name")
    return spec.doc() if cls.recurrence in ("persistent", "device") else None


def _with_depth(frozen, step: int, depth: str):
    """The replay's manifest with `record.depth` = {step, level}: depth recording at step S only (the
    data and tokenizer stay the ones RUN's lock resolved and hashed)."""
    import hashlib

    from disttrace.config.freezing import canonical_json, validate

    manifest = {**frozen.manifest, "record": {**frozen.manifest.get("record", {})}}
    manifest["record"]["depth"] = {"step": step, "level": depth}
    canonical = validate(manifest, frozen.source).model_dump(mode="json")
    return frozen.model_copy(
        update={
            "manifest": canonical,
            "manifest_id": hashlib.sha256(canonical_json(canonical)).hexdigest(),
        }
    )


def prepare_replay(
    run_dir: Path, step: int, *, depth: str | None = None, permute_ranks: bool = False
) -> Path:
    """Create the replay's run directory (nothing launched): lock, run.json with resume, stop and link."""
    from disttrace.run.job.launch import prepare
    from disttrace.run.job.recovery import checkpoint_before, resume_spec
    from disttrace.store.records import PATH_KINDS

    run_dir = Path(run_dir)
    run = Run(run_dir)
    if run.attached:
        raise BadInput(
            run_dir,
            "an attached run (disttrace.api): give its script's command after '--' "
            "(disttrace replay RUN --step S -- torchrun ... train.py)",
        )
    kind = run.run_info.path
    if kind not in PATH_KINDS or kind == "replay":
        raise BadInput(run_dir / "run.json", f"cannot replay a '{kind}' run", field="path")
    _check_step_and_depth(run, run_dir, step, depth)
    frozen, ckpt, why = checkpoint_before(run_dir, step - 1)
    world = frozen.model().world_size
    if permute_ranks and world < 2:
        raise BadInput("--permute-ranks", "a world of one rank has nothing to permute")
    root = run_dir.resolve().parent.parent
    resume = resume_spec(frozen, root, ckpt, run_dir) if ckpt is not None else None
    if depth is not None:
        frozen = _with_depth(frozen, step, depth)
    return prepare(
        frozen,
        root,
        "replay",
        folder=run.manifest_id,
        fault=kept_fault(run.run_info.fault, run.path / "run.json"),
        resume=resume,
        name=f"replay-{step}",
        extra={
            "stop_after": step,
            "replay": ReplaySpec(
                of=str(run_dir.resolve()),
                step=step,
                rank_shift=1 if permute_ranks else None,
                from_=why,
                depth=depth,
            ).doc(),
        },
    )


def prepare_attached_replay(
    run_dir: Path, step: int, command: list[str], *, depth: str | None = None
) -> Path:
    """An attached run's replay directory (beside it, nothing launched), for its script to attach to."""
    import os
    import time

    from disttrace.store.documents import RunInfo
    from disttrace.store.writers import new_run_dir, write_run_info

    run_dir = Path(run_dir)
    run = Run(run_dir)
    if not run.attached:
        raise BadInput(
            run_dir,
            "not an attached run: replay it without a command (disttrace replays its own jobs)",
        )
    if not command:
        raise BadInput("--", "no command after '--' (e.g. -- torchrun --nproc-per-node 2 train.py)")
    _check_step_and_depth(run, run_dir, step, depth)
    here = run_dir.resolve()
    replay_dir = new_run_dir(here.parent.parent, here.parent.name, f"replay-{step}")
    extra = {}
    if depth is not None:
        # what the script's attach reads (run/record/depth.py attached_spec): the step, the level, and the global
        # batch RUN counted, which places each micro-batch's records in the step's logical batch
        batch = (run.lock_info.observed or {}).get("global_batch")
        extra["depth"] = {"step": step, "level": depth, "global_batch": batch}
    info = RunInfo(
        **extra,
        path="replay",
        fault=kept_fault(run.run_info.fault, run.path / "run.json"),
        resume=None,  # the script's run.resume(...) says where it starts, if anywhere
        created=time.time(),
        pid=os.getpid(),
        command=command,
        replay=ReplaySpec(
            of=str(here),
            step=step,
            rank_shift=None,
            from_="the script's own start, or the checkpoint it resumes from",
            depth=depth,
        ).doc(),
    )
    write_run_info(replay_dir, info)
    return replay_dir


def _recorded_steps(run: Run) -> list[int]:
    steps: set[int] | None = None
    for r in run.ranks():
        s = {e.step for e in run.step_index(r).records}
        steps = s if steps is None else steps & s
    return sorted(steps or ())


def _ranges(steps: list[int]) -> str:
    from disttrace.fmt import ranges

    return ranges(steps)


def replay_run(
    run_dir: Path,
    step: int,
    *,
    depth: str | None = None,
    reference: Path | None = None,
    permute_ranks: bool = False,
    command: list[str] | None = None,
    launch_job=None,
) -> ReplayResult:
    """Replay RUN's step `step` and attribute its divergence (docs/replay.md). Raises BadInput (exit 2) for
    bad input or when no reference is found, JobFailed (exit 3) when the replay's job fails.
    `command`: an attached run's script (`disttrace replay RUN --step S -- CMD`), run with the replay's
    directory in DISTTRACE_RUN_DIR (usercmd.execute). `launch_job(run_dir)`, if given, runs the job (a
    caller's live progress); else run/job/launch.py's launch, or usercmd.execute with a command."""
    run_dir = Path(run_dir)
    if reference is None:
        reference = default_reference(run_dir)
        if reference is None:
            raise BadInput(
                "--reference",
                f"no complete, verified reference run of {run_dir}'s manifest in its runs root: "
                "give --reference REF",
            )
    from disttrace.analysis.diff import diff_runs

    # a reference that is not a run, or not of RUN's experiment, is bad input before any job starts
    diff_runs(reference, run_dir, propagate=False)
    if command is not None:
        if permute_ranks:
            raise BadInput(
                "--permute-ranks",
                "an attached script's launcher places its ranks: a replay with a command is not permuted",
            )
        from disttrace.run.job import usercmd

        replay_dir = prepare_attached_replay(run_dir, step, command, depth=depth)
        (launch_job or (lambda d: usercmd.execute(d, command)))(replay_dir)
        return attribute(run_dir, replay_dir, reference)
    replay_dir = prepare_replay(run_dir, step, depth=depth, permute_ranks=permute_ranks)
    if launch_job is None:
        from disttrace.run.job.launch import launch

        launch(replay_dir)
    else:
        launch_job(replay_dir)
    return attribute(run_dir, replay_dir, reference)


def _check_step_and_depth(run: Run, run_dir: Path, step: int, depth: str | None) -> None:
    """A replay's --depth is a known level and its --step a step the run recorded (bad input otherwise)."""
    if depth is not None and depth not in DEPTHS:
        raise BadInput("--depth", f"'{depth}' is not one of {', '.join(DEPTHS)}")
    recorded = _recorded_steps(run)
    if step not in recorded:
        raise BadInput(
            "--step",
            f"step {step} is not a recorded step of {run_dir} (recorded: "
            f"{_ranges(recorded) or 'none'})",
        )
