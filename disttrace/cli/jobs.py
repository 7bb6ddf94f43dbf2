"""The commands that write a run: `freeze` (the lock), `run`, `inject`, `calibrate`, `recover` and
`replay`; each run-writing one reports the one way (a summary on stderr, the run directory last on stdout,
or one JSON document)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.text import Text

from disttrace.cli import shared
from disttrace.cli.shared import (
    JsonOpt,
    ManifestArg,
    OutOpt,
    QuietOpt,
    SetOpt,
    _freeze,
    app,
    emit_json,
    handled,
    parse_params,
)
from disttrace.errors import EXIT_JOB_FAILED, BadInput, JobFailed


def _run_job_and_report(
    run_dir: Path, json_: bool, job, what: str, summarize_failure: bool = True, extra=None
) -> Path:
    """Run `job()` (our launcher, or a user's command) for `run_dir`, then report it the one way every
    run-writing command does: a summary on stderr and the run directory as the last stdout line, or one
    JSON document; a failed job still reports what it wrote (exit 3)."""
    from disttrace.analysis.facts import summary
    from disttrace.views.show import render_summary

    shared.err.print(Text(f"{what} ...", style="dim"))
    try:
        job()
    except JobFailed:
        if json_:
            emit_json(
                {
                    "run_dir": str(run_dir),
                    "complete": False,
                    **(summary(run_dir).to_dict() if summarize_failure else {}),
                }
            )
            raise typer.Exit(EXIT_JOB_FAILED) from None
        raise
    if json_:
        emit_json({"run_dir": str(run_dir), **summary(run_dir).to_dict(), **(extra or {})})
    else:
        render_summary(summary(run_dir), shared.err)
        print(run_dir)
    return run_dir


def _launch_and_report(
    run_dir: Path, json_: bool, nnodes=1, node_rank=0, rdzv_endpoint=None, quiet=False
):
    from disttrace.run.job.launch import launch
    from disttrace.views.progress import LiveProgress

    def job():
        with LiveProgress(
            run_dir, shared.err, enabled=not quiet
        ):  # stderr only: --json and stdout are unchanged
            launch(run_dir, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)

    _run_job_and_report(run_dir, json_, job, f"launching {run_dir}")


@app.command()
@handled
def freeze(
    manifest: Path | None = ManifestArg,
    set_: list[str] | None = SetOpt,
    output: Path | None = typer.Option(None, "-o", "--output", help="write the lock JSON here"),
    from_deepspeed: Path | None = typer.Option(
        None,
        "--from-deepspeed",
        help="map a DeepSpeed config (ds_config.json) onto the manifest (default: the default one)",
    ),
    world_size: int | None = typer.Option(
        None,
        "--world-size",
        help="with --from-deepspeed: the world size its batch identity is checked against",
    ),
    explain: bool = typer.Option(
        False,
        "--explain",
        help="print every manifest section's fields (name, type, default, description) and exit; "
        "with --json, as one document",
    ),
    json_: bool = JsonOpt,
):
    """Validate a manifest, check its data and tokenizer hashes, and print its manifest id.

    A manifest is one TOML file, a table a section: [experiment] (name, edition, seed), [data] and
    [tokenizer] (files and their sha256), [model] (the plain model's shape), [parallelism] (the layout:
    dp, tp, pp, zero_stage), [training] (steps, batch, optimizer), and the optional [checkpoint], [debug],
    [eval] and [record]. Freezing fills in every default and every hash and writes the result as
    canonical JSON, the lock; the sha256 of the manifest in it is the manifest id, which names the runs.
    Two runs of one id compare bit for bit; runs that differ only in [parallelism] and the batch split
    compare numerically.

    `disttrace freeze --explain` lists every field; `disttrace freeze m.toml -o lock.json` writes the lock,
    which `disttrace run lock.json` runs exactly as frozen. With --from-deepspeed, read a DeepSpeed config:
    batch identity checked with DeepSpeed's own wording, every key it cannot map named."""
    from disttrace.store.writers import write_json_atomic

    if explain:
        _explain(
            json_,
            manifest is not None or bool(set_) or output is not None or from_deepspeed is not None,
        )
        return
    if from_deepspeed is not None:
        from disttrace.config.deepspeed import freeze_from_deepspeed

        frozen, warnings = freeze_from_deepspeed(from_deepspeed, manifest, world_size, set_ or [])
        for w in warnings:
            shared.err.print(Text("deepspeed: ", style="yellow") + Text(w))
    else:
        frozen = _freeze(manifest, set_)
    doc = frozen.model_dump()
    if output:
        write_json_atomic(output, doc)
    if json_:
        emit_json(doc)
    else:
        m = frozen.manifest
        shared.err.print(
            f"[bold]{escape(m['experiment']['name'])}[/bold] edition {escape(m['experiment']['edition'])}  "
            f"world {m['parallelism']['world_size']} (dp={m['parallelism']['dp']} tp={m['parallelism']['tp']} "
            f"pp={m['parallelism']['pp']} zero={m['parallelism']['zero_stage']})"
        )
        shared.err.print(
            f"data sha256 {m['data']['sha256']}\ntokenizer sha256 {m['tokenizer']['sha256']}"
        )
        print(frozen.manifest_id)


def _explain(json_: bool, with_manifest: bool) -> None:
    """`freeze --explain`: the reference of every manifest field, from the models' own schema."""
    from disttrace.config.explain import explain
    from disttrace.config.manifest import Manifest

    if with_manifest:
        raise BadInput(
            "--explain", "describes the manifest's fields; it takes no manifest or options"
        )
    doc = explain(Manifest)
    if json_:
        emit_json(doc)
    else:
        from disttrace.views.manifest import render_manifest_fields

        render_manifest_fields(doc, shared.err)


_RUN_ID = typer.Option(
    None,
    "--run-id",
    help="multi-node: the same name on every node, so all "
    "nodes write one run dir (<out>/<id12>/reference-<run-id>)",
)
_PREPARE_ONLY = typer.Option(
    False,
    "--prepare-only",
    help="create the run dir and print it, launch "
    "nothing: then `torchrun ... -m disttrace.worker --run-dir DIR`",
)
_CALIBRATE = typer.Option(
    False,
    "--calibrate",
    help="also measure the reference's noise (a repeat and a perturbed run, as `disttrace "
    "calibrate`) and write its calibration.json beside it",
)


@app.command()
@handled
def run(
    manifest: Path | None = ManifestArg,
    set_: list[str] | None = SetOpt,
    out: Path = OutOpt,
    json_: bool = JsonOpt,
    nnodes: int = typer.Option(1, help="number of nodes (one `disttrace run` per node)"),
    node_rank: int = typer.Option(0, help="this node's rank among --nnodes"),
    rdzv_endpoint: str | None = typer.Option(None, help="HOST:PORT of the rendezvous (multi-node)"),
    run_id: str | None = _RUN_ID,
    prepare_only: bool = _PREPARE_ONLY,
    quiet: bool = QuietOpt,
    calibrate_: bool = _CALIBRATE,
    safety: float = typer.Option(
        10.0, "--safety", help="--calibrate: calibrated bound = safety x measured noise"
    ),
):
    """Run the reference path: a real multi-process torch.distributed job that records the full evidence.
    Multi-node: start one `disttrace run` per node with the same --nnodes, --rdzv-endpoint and --run-id.
    Your own script: `disttrace run -- torchrun --nproc-per-node 2 train.py` (it calls disttrace.api.attach;
    the prepared run dir reaches it in DISTTRACE_RUN_DIR; its stdout goes to stderr)."""
    from disttrace.run.job.launch import prepare, prepare_shared

    if calibrate_ and (shared.USER_COMMAND is not None or nnodes > 1 or prepare_only):
        raise BadInput(
            "--calibrate",
            "calibrates a reference this command launches on one node (not a user's command, "
            "--nnodes or --prepare-only); run `disttrace calibrate` there instead",
        )
    if shared.USER_COMMAND is not None:
        return _user_command(manifest, out, json_, "reference", None)

    frozen = _freeze(manifest, set_)
    if calibrate_:
        import math

        if not (math.isfinite(safety) and safety >= 1):  # refused before anything runs
            raise BadInput("--safety", f"must be a finite number >= 1 (got {safety})")
    if nnodes > 1:
        if not run_id or not rdzv_endpoint:
            raise BadInput(
                "--nnodes", "a multi-node run needs --rdzv-endpoint HOST:PORT and --run-id NAME"
            )
        run_dir = prepare_shared(frozen, out, "reference", run_id)
    else:
        run_dir = prepare(frozen, out, "reference")
    if prepare_only:
        shared.err.print(
            Text(
                f"prepared; start the ranks yourself: torchrun --nproc-per-node N [--nnodes ...] "
                f"-m disttrace.worker --run-dir {run_dir}"
            )
        )
        emit_json({"run_dir": str(run_dir), "prepared": True}) if json_ else print(run_dir)
        return
    if not calibrate_:
        _launch_and_report(run_dir, json_, nnodes, node_rank, rdzv_endpoint, quiet=quiet)
        return
    _launch_and_calibrate(frozen, run_dir, out, safety, json_, quiet)


def _launch_and_calibrate(
    frozen, run_dir: Path, out: Path, safety: float, json_: bool, quiet: bool
):
    """`run --calibrate`: the reference, then its calibration beside it, reported as one run."""
    from disttrace.run.job.launch import launch
    from disttrace.views.progress import LiveProgress

    extra: dict = {}

    def job():
        with LiveProgress(run_dir, shared.err, enabled=not quiet):
            launch(run_dir)
        path, doc = _calibration(frozen, out, safety, reference=run_dir)
        extra["calibration"] = str(path)
        if not json_:
            from disttrace.views.calibration import render_calibration

            render_calibration(doc, path, shared.err)

    _run_job_and_report(run_dir, json_, job, f"launching {run_dir}", extra=extra)


@app.command()
@handled
def inject(
    manifest: Path | None = ManifestArg,
    fault: str = typer.Option(..., "--fault", help="fault name (see `disttrace faults`)"),
    step: int = typer.Option(..., "--step", help="the step it fires at (steps count from 1)"),
    rank: int = typer.Option(..., "--rank", help="the global rank it fires on"),
    param: list[str] | None = typer.Option(
        None, "--param", help="fault parameter key=value (repeatable)"
    ),
    set_: list[str] | None = SetOpt,
    out: Path = OutOpt,
    json_: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Run the fault path: the same experiment with exactly one fault injected at (step, rank).
    Your own script: `disttrace inject --fault NAME --step S --rank R -- CMD ARGS...` fires the catalog entry at
    its hook point inside the attached script; a fault needing a point the script lacks is refused (exit 2)."""
    from disttrace.run import faults
    from disttrace.run.job.launch import prepare

    if shared.USER_COMMAND is not None:
        from disttrace.run.job.usercmd import fault_spec

        run_dir = _user_command(
            manifest, out, json_, "fault", fault_spec(fault, step, rank, parse_params(param))
        )
        return _warn_if_not_fired(run_dir)

    frozen = _freeze(manifest, set_)
    spec = faults.get(fault).spec(step, rank, parse_params(param), frozen.model())
    run_dir = prepare(frozen, out, "fault", fault=spec)
    _launch_and_report(run_dir, json_, quiet=quiet)
    _warn_if_not_fired(run_dir)


def _user_command(manifest, out: Path, json_: bool, path_kind: str, fault: dict | None) -> Path:
    from disttrace.run.job import usercmd

    if manifest is not None:
        raise BadInput(str(manifest), "give a manifest or a command after '--', not both")
    run_dir = usercmd.prepare(out, shared.USER_COMMAND, path_kind, fault)
    return _run_job_and_report(
        run_dir,
        json_,
        lambda: usercmd.execute(run_dir, shared.USER_COMMAND),
        f"running {' '.join(shared.USER_COMMAND)} attached to {run_dir}",
        summarize_failure=False,
    )


def _warn_if_not_fired(run_dir: Path) -> None:
    from disttrace.store.rundir import Run

    fired = Run(run_dir).fault_events()
    if not fired:
        shared.err.print(
            Text(
                "warning: the fault never fired (its hook point was not reached on that rank and step); "
                "this run is a second reference, not a fault run",
                style="yellow",
            )
        )
    elif any(e.changed is False for e in fired):
        shared.err.print(
            Text(
                "warning: the fault fired but changed nothing (its digest before and after are equal, see "
                "events.jsonl); this run is a second reference, not a fault run",
                style="yellow",
            )
        )


@app.command()
@handled
def calibrate(
    manifest: Path | None = ManifestArg,
    set_: list[str] | None = SetOpt,
    out: Path = OutOpt,
    safety: float = typer.Option(
        10.0, "--safety", help="calibrated bound = safety x measured noise"
    ),
    json_: bool = JsonOpt,
):
    """Measure run-to-run noise: the reference twice (must be bit-identical) and once with its initial
    parameters perturbed by one unit in the last place; writes <out>/<id12>/calibration.json (diff and gate
    use it by default for runs of this manifest) and prints the noise per step and phase. The last stdout
    line is the file. `disttrace run --calibrate` does the same and reports the reference run."""
    frozen = _freeze(manifest, set_)
    path, doc = _calibration(frozen, out, safety)
    if json_:
        emit_json({**doc.to_dict(), "file": str(path)})
        return
    from disttrace.views.calibration import render_calibration

    render_calibration(doc, path, shared.err)
    print(path)


def _calibration(frozen, out: Path, safety: float, reference: Path | None = None):
    """Run what a calibration needs (the reference unless given, its repeat, the perturbed reference) and
    write <out>/<id12>/calibration.json; -> (its path, the document)."""
    import math

    from disttrace.analysis.calibration import build
    from disttrace.analysis.tolerance import unit_roundoff
    from disttrace.run.job.launch import launch, prepare
    from disttrace.store.rundir import read_run_info
    from disttrace.store.writers import write_json_atomic, write_run_info

    if not (math.isfinite(safety) and safety >= 1):
        raise BadInput("--safety", f"must be a finite number >= 1 (got {safety})")
    relative = 2 * unit_roundoff(frozen.manifest)  # one unit in the last place
    dirs = {} if reference is None else {"reference": str(reference)}
    for label in ("reference", "repeat", "perturbed"):
        if label in dirs:
            continue
        run_dir = prepare(frozen, out, "reference")
        if label == "perturbed":
            info = read_run_info(run_dir).updated(perturb={"relative": relative, "seed": 1})
            write_run_info(run_dir, info)
        shared.err.print(Text(f"calibrate: {label} run {run_dir} ...", style="dim"))
        launch(run_dir)
        dirs[label] = str(run_dir)
    doc = build(frozen.manifest_id, dirs, relative, safety)
    path = Path(out) / frozen.manifest_id[:12] / "calibration.json"
    write_json_atomic(path, doc.to_dict())
    return path, doc


@app.command()
@handled
def recover(
    fault_run: Path = typer.Argument(..., help="the run to recover (usually a fault run)"),
    from_step: int | None = typer.Option(
        None, "--from-step", help="resume from this checkpoint step"
    ),
    out: Path | None = typer.Option(None, "--out", help="runs root (default: the fault run's)"),
    json_: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Run the recovered path: resume from the last checkpoint that verifies and precedes the fault, fault
    removed. With --out another runs root (the fault run's disk is full, or read-only): the checkpoint is
    copied into the recovered run and verified again, and run.json names the run it came from."""
    import shutil

    from disttrace.run.job.launch import prepare
    from disttrace.run.job.recovery import choose_checkpoint, import_checkpoint, resume_spec
    from disttrace.store.paths import inside
    from disttrace.store.rundir import read_run_info
    from disttrace.store.writers import write_run_info

    frozen, ckpt, why = choose_checkpoint(fault_run, from_step)
    shared.err.print(f"resuming from {ckpt} ({why})")
    root = out if out is not None else fault_run.resolve().parent.parent
    if inside(ckpt, root):  # read where it lies
        resume = resume_spec(frozen, root, ckpt, fault_run)
        run_dir = prepare(frozen, root, "recovered", resume=resume)
    else:
        run_dir = prepare(frozen, root, "recovered")
        try:
            copy = import_checkpoint(ckpt, run_dir, frozen.manifest_id)
            resume = resume_spec(frozen, root, copy, fault_run, copied_from=ckpt)
            write_run_info(run_dir, read_run_info(run_dir).updated(resume=resume))
        except (
            BaseException
        ):  # no rank has run in it: a recovered run without its start is not kept
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        shared.err.print(Text(f"copied into {copy} and verified", style="dim"))
    _launch_and_report(run_dir, json_, quiet=quiet)


@app.command()
@handled
def replay(
    run_dir: Path = typer.Argument(..., help="the run to replay (usually a fault run)"),
    step: int = typer.Option(
        ..., "--step", help="the step to re-execute (usually its first divergence)"
    ),
    reference: Path | None = typer.Option(
        None,
        "--reference",
        help="the reference run (default: the complete, verified reference `lab` reuses, in RUN's runs root)",
    ),
    permute_ranks: bool = typer.Option(
        False,
        "--permute-ranks",
        help="run rank r in launch slot (r + 1) % world: a divergence bound to the hardware stays on its "
        "slot, one bound to the rank's data or code moves with the rank",
    ),
    depth: str | None = typer.Option(
        None, "--depth", help="module | op: record step S at depth (zoom)"
    ),
    json_: bool = JsonOpt,
    quiet: bool = QuietOpt,
):
    """Re-execute RUN's step S from its last verified checkpoint before it, into a replay store beside RUN,
    and attribute the divergence from the trajectories alone: persistent (it reproduces), transient (the
    replay matches the reference instead), device (with --permute-ranks it stays on one physical slot),
    not-replayable (RUN is not deterministic from its checkpoint), none (RUN agrees with the reference at
    S). Exit 0 when a verdict is reached, 2 bad input, 3 the replay's job failed (docs/replay.md).
    An attached run: `disttrace replay RUN --step S -- CMD ARGS...` runs your script again with the replay's
    directory (from its start, or from the checkpoint it resumes from with run.resume)."""
    from disttrace.lab.replay import replay_run
    from disttrace.views.progress import LiveProgress
    from disttrace.views.replay import render

    def job(replay_dir):
        shared.err.print(
            Text(f"replaying step {step} of {run_dir} into {replay_dir} ...", style="dim")
        )
        if shared.USER_COMMAND is not None:
            from disttrace.run.job import usercmd

            return usercmd.execute(replay_dir, shared.USER_COMMAND)
        with LiveProgress(replay_dir, shared.err, enabled=not quiet):
            from disttrace.run.job.launch import launch

            launch(replay_dir)

    result = replay_run(
        run_dir,
        step,
        depth=depth,
        reference=reference,
        permute_ranks=permute_ranks,
        command=shared.USER_COMMAND,
        launch_job=job,
    )
    if json_:
        emit_json(result)
    else:
        render(result, shared.err)
        print(result.replay)
