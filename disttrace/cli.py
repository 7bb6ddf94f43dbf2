"""disttrace command line. Human output goes to stderr (rich); stdout carries what pipelines consume:
the run directory as the last line of a run command, or exactly one JSON document with --json.

Exit codes: 0 ok/equal/pass, 1 divergence or failed gate, 2 bad input, 3 the distributed job failed,
4 a partial diff (some ranks or steps) that found no divergence: no verdict.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import typer
from rich.markup import escape
from rich.text import Text

from disttrace.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    BadInput,
    DisttraceError,
    JobFailed,
    verdict_exit,
)
from disttrace.fmt import visible
from disttrace.views.console import SafeConsole

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="Reproducibility harness for distributed PyTorch training: freeze a manifest, run the reference, "
    "inject one fault, recover, diff to the first divergence, and gate the result.",
    epilog="Start: `disttrace run` (the embedded default manifest), then `disttrace lab --list`. "
    "Exit codes: 0 ok / equal / pass, 1 divergence or failed gate, 2 bad input (one line naming the file "
    "and field), 3 the distributed job failed, 4 a partial diff without divergence (no verdict). --json "
    "prints one JSON document on stdout; a run command's "
    "last stdout line is its run directory.",
)
# emoji off: a ":smile:" in a tensor name or a path prints as written
err = SafeConsole(
    stderr=True, no_color=bool(os.environ.get("NO_COLOR")) or None, highlight=False, emoji=False
)

ManifestArg = typer.Argument(
    None,
    help="manifest TOML (default: manifests/default.toml), or a lock `freeze -o` wrote (.json), run as frozen",
    show_default=False,
)
SetOpt = typer.Option(None, "--set", help="override a manifest key: section.key=value (repeatable)")
OutOpt = typer.Option(Path("runs"), "--out", help="runs root directory")
JsonOpt = typer.Option(False, "--json", help="print exactly one JSON document on stdout")
QuietOpt = typer.Option(
    False,
    "--quiet",
    "-q",
    help="no live progress on stderr (step, loss, s/step, ETA, "
    "checkpoints, faults, failed ranks, stalls)",
)


def emit_json(obj) -> None:
    """One document on stdout: a dict, or a typed result (its `to_json()`)."""
    from disttrace.jsondoc import dumps

    sys.stdout.write(dumps(obj))
    sys.stdout.flush()


def one_line(e: Exception) -> str:
    return str(e).replace("\r", "\\r").replace("\n", "\\n")


def handled(fn):
    """Turn our errors into the exit-code contract with a one-line message; never a traceback for bad input."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobFailed as e:
            err.print(Text("job failed: ", style="red") + Text(visible(str(e))), soft_wrap=True)
            if kwargs.get("json_"):
                emit_json({"run_dir": e.run_dir, "complete": False, "error": one_line(e)})
            elif e.run_dir:
                print(e.run_dir)
            raise typer.Exit(e.exit_code) from None
        # text from files and users: never markup, never two lines, made visible before rich sees it
        # (rich would expand a tab and drop a carriage return, so the line would not say what was raised)
        except DisttraceError as e:
            err.print(Text("error: ", style="red") + Text(visible(str(e))), soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except OSError as e:  # the disk filled up, or a path cannot be written: never a traceback
            import errno

            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            err.print(
                Text("error: ", style="red") + Text(visible(f"{e.filename or ''}: {e.strerror}")),
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_JOB_FAILED if full else EXIT_BAD_INPUT) from None
        except KeyboardInterrupt:
            err.print("interrupted")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        # a bug of ours: one line, and never an exit code that reads as a verdict
        except Exception as e:
            err.print(
                Text("internal error: ", style="red") + Text(visible(f"{type(e).__name__}: {e}")),
                soft_wrap=True,
            )
            raise typer.Exit(EXIT_JOB_FAILED) from None

    return wrapper


def _freeze(manifest: Path | None, sets: list[str] | None):
    from disttrace.config.manifest import freeze, read_lock

    if manifest is not None and manifest.suffix == ".json":
        if sets:
            raise BadInput(
                "--set", "a lock is run as frozen: freeze again with the override instead"
            )
        return read_lock(manifest)
    return freeze(manifest, sets or [])


# ---------------------------------------------------------------- freeze


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
    json_: bool = JsonOpt,
):
    """Validate a manifest, check data and tokenizer hashes, and print its canonical lock and manifest id.
    With --from-deepspeed, read a DeepSpeed config: batch identity checked with DeepSpeed's own wording,
    every key it cannot map named."""
    from disttrace.store.rundir import write_json_atomic

    if from_deepspeed is not None:
        from disttrace.config.deepspeed import freeze_from_deepspeed

        frozen, warnings = freeze_from_deepspeed(from_deepspeed, manifest, world_size, set_ or [])
        for w in warnings:
            err.print(Text("deepspeed: ", style="yellow") + Text(w))
    else:
        frozen = _freeze(manifest, set_)
    doc = frozen.model_dump()
    if output:
        write_json_atomic(output, doc)
    if json_:
        emit_json(doc)
    else:
        m = frozen.manifest
        err.print(
            f"[bold]{escape(m['experiment']['name'])}[/bold] edition {escape(m['experiment']['edition'])}  "
            f"world {m['parallelism']['world_size']} (dp={m['parallelism']['dp']} tp={m['parallelism']['tp']} "
            f"pp={m['parallelism']['pp']} zero={m['parallelism']['zero_stage']})"
        )
        err.print(f"data sha256 {m['data']['sha256']}\ntokenizer sha256 {m['tokenizer']['sha256']}")
        print(frozen.manifest_id)


# ---------------------------------------------------------------- the three paths


def _run_job_and_report(
    run_dir: Path, json_: bool, job, what: str, summarize_failure: bool = True, extra=None
) -> Path:
    """Run `job()` (our launcher, or a user's command) for `run_dir`, then report it the one way every
    run-writing command does: a summary on stderr and the run directory as the last stdout line, or one
    JSON document; a failed job still reports what it wrote (exit 3)."""
    from disttrace.analysis.facts import summary
    from disttrace.views.show import render_summary

    err.print(Text(f"{what} ...", style="dim"))
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
        render_summary(summary(run_dir), err)
        print(run_dir)
    return run_dir


def _launch_and_report(
    run_dir: Path, json_: bool, nnodes=1, node_rank=0, rdzv_endpoint=None, quiet=False
):
    from disttrace.run.launch import launch
    from disttrace.views.progress import LiveProgress

    def job():
        with LiveProgress(
            run_dir, err, enabled=not quiet
        ):  # stderr only: --json and stdout are unchanged
            launch(run_dir, nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint)

    _run_job_and_report(run_dir, json_, job, f"launching {run_dir}")


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
    run_id: str | None = typer.Option(
        None,
        "--run-id",
        help="multi-node: the same name on every node, so all "
        "nodes write one run dir (<out>/<id12>/reference-<run-id>)",
    ),
    prepare_only: bool = typer.Option(
        False,
        "--prepare-only",
        help="create the run dir and print it, launch "
        "nothing: then `torchrun ... -m disttrace.worker --run-dir DIR`",
    ),
    quiet: bool = QuietOpt,
    calibrate_: bool = typer.Option(
        False,
        "--calibrate",
        help="also measure the reference's noise (a repeat and a perturbed run, as `disttrace "
        "calibrate`) and write its calibration.json beside it",
    ),
    safety: float = typer.Option(
        10.0, "--safety", help="--calibrate: calibrated bound = safety x measured noise"
    ),
):
    """Run the reference path: a real multi-process torch.distributed job that records the full evidence.
    Multi-node: start one `disttrace run` per node with the same --nnodes, --rdzv-endpoint and --run-id.
    Your own script: `disttrace run -- torchrun --nproc-per-node 2 train.py` (it calls disttrace.api.attach;
    the prepared run dir reaches it in DISTTRACE_RUN_DIR; its stdout goes to stderr)."""
    from disttrace.run.launch import prepare, prepare_shared

    if calibrate_ and (USER_COMMAND is not None or nnodes > 1 or prepare_only):
        raise BadInput(
            "--calibrate",
            "calibrates a reference this command launches on one node (not a user's command, "
            "--nnodes or --prepare-only); run `disttrace calibrate` there instead",
        )
    if USER_COMMAND is not None:
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
        err.print(
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
    from disttrace.run.launch import launch
    from disttrace.views.progress import LiveProgress

    extra: dict = {}

    def job():
        with LiveProgress(run_dir, err, enabled=not quiet):
            launch(run_dir)
        path, doc = _calibration(frozen, out, safety, reference=run_dir)
        extra["calibration"] = str(path)
        if not json_:
            _print_calibration(path, doc)

    _run_job_and_report(run_dir, json_, job, f"launching {run_dir}", extra=extra)


def parse_params(params: list[str] | None) -> dict:
    out = {}
    for p in params or []:
        if "=" not in p:
            raise BadInput("--param", f"'{p}' is not of the form key=value")
        k, v = p.split("=", 1)
        out[k.strip()] = v.strip()
    return out


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
    from disttrace.run.launch import prepare

    if USER_COMMAND is not None:
        from disttrace.run.usercmd import fault_spec

        run_dir = _user_command(
            manifest, out, json_, "fault", fault_spec(fault, step, rank, parse_params(param))
        )
        return _warn_if_not_fired(run_dir)

    frozen = _freeze(manifest, set_)
    spec = faults.get(fault).spec(step, rank, parse_params(param), frozen.model())
    run_dir = prepare(frozen, out, "fault", fault=spec)
    _launch_and_report(run_dir, json_, quiet=quiet)
    _warn_if_not_fired(run_dir)


USER_COMMAND: list[str] | None = (
    None  # what followed `--` on `disttrace run|inject|replay|zoom|diff ... -- CMD ARGS...`
)


def _user_command(manifest, out: Path, json_: bool, path_kind: str, fault: dict | None) -> Path:
    from disttrace.run import usercmd

    if manifest is not None:
        raise BadInput(str(manifest), "give a manifest or a command after '--', not both")
    run_dir = usercmd.prepare(out, USER_COMMAND, path_kind, fault)
    return _run_job_and_report(
        run_dir,
        json_,
        lambda: usercmd.execute(run_dir, USER_COMMAND),
        f"running {' '.join(USER_COMMAND)} attached to {run_dir}",
        summarize_failure=False,
    )


def _warn_if_not_fired(run_dir: Path) -> None:
    from disttrace.store.rundir import Run

    fired = Run(run_dir).fault_events()
    if not fired:
        err.print(
            Text(
                "warning: the fault never fired (its hook point was not reached on that rank and step); "
                "this run is a second reference, not a fault run",
                style="yellow",
            )
        )
    elif any(e.changed is False for e in fired):
        err.print(
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
        emit_json({**doc, "file": str(path)})
        return
    _print_calibration(path, doc)
    print(path)


def _calibration(frozen, out: Path, safety: float, reference: Path | None = None):
    """Run what a calibration needs (the reference unless given, its repeat, the perturbed reference) and
    write <out>/<id12>/calibration.json; -> (its path, the document)."""
    import math

    from disttrace.analysis.calibration import build
    from disttrace.analysis.tolerance import unit_roundoff
    from disttrace.run.launch import launch, prepare
    from disttrace.store.rundir import read_json, write_json_atomic

    if not (math.isfinite(safety) and safety >= 1):
        raise BadInput("--safety", f"must be a finite number >= 1 (got {safety})")
    relative = 2 * unit_roundoff(frozen.manifest)  # one unit in the last place
    dirs = {} if reference is None else {"reference": str(reference)}
    for label in ("reference", "repeat", "perturbed"):
        if label in dirs:
            continue
        run_dir = prepare(frozen, out, "reference")
        if label == "perturbed":
            info = read_json(run_dir / "run.json")
            write_json_atomic(
                run_dir / "run.json", {**info, "perturb": {"relative": relative, "seed": 1}}
            )
        err.print(Text(f"calibrate: {label} run {run_dir} ...", style="dim"))
        launch(run_dir)
        dirs[label] = str(run_dir)
    doc = build(frozen.manifest_id, dirs, relative, safety)
    path = Path(out) / frozen.manifest_id[:12] / "calibration.json"
    write_json_atomic(path, doc)
    return path, doc


def _print_calibration(path: Path, doc: dict) -> None:
    err.print(
        Text(
            f"repeat run bit-identical: {doc['repeat_bit_identical']} (max rel err "
            f"{doc['repeat_max_rel_err']:.2e}); perturbation {doc['perturbation']['relative']:.2e} "
            f"relative; noise taken on the {doc['scale']} scale"
        )
    )
    for step, phases in doc["noise"].items():
        err.print(Text(f"  step {step}: " + ", ".join(f"{p} {v:.2e}" for p, v in phases.items())))
    err.print(
        Text(
            f"calibrated bound = {doc['safety']:g} x noise, per step, phase and tensor class "
            f"({', '.join(doc['classes'])}), written to {path}"
        )
    )


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
    """Run the recovered path: resume from the last checkpoint that verifies and precedes the fault, fault removed."""
    from disttrace.run.launch import prepare
    from disttrace.run.recovery import choose_checkpoint, resume_spec

    frozen, ckpt, why = choose_checkpoint(fault_run, from_step)
    err.print(f"resuming from {ckpt} ({why})")
    root = out if out is not None else fault_run.resolve().parent.parent
    run_dir = prepare(frozen, root, "recovered", resume=resume_spec(frozen, root, ckpt, fault_run))
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
    from disttrace.run.replay import replay_run
    from disttrace.views.progress import LiveProgress
    from disttrace.views.replay import render

    def job(replay_dir):
        err.print(Text(f"replaying step {step} of {run_dir} into {replay_dir} ...", style="dim"))
        if USER_COMMAND is not None:
            from disttrace.run import usercmd

            return usercmd.execute(replay_dir, USER_COMMAND)
        with LiveProgress(replay_dir, err, enabled=not quiet):
            from disttrace.run.launch import launch

            launch(replay_dir)

    result = replay_run(
        run_dir,
        step,
        depth=depth,
        reference=reference,
        permute_ranks=permute_ranks,
        command=USER_COMMAND,
        launch_job=job,
    )
    if json_:
        emit_json(result)
    else:
        render(result, err)
        print(result.replay)


# ---------------------------------------------------------------- reading runs


@app.command()
@handled
def show(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    view: str = typer.Argument(
        "summary", help="summary | checkpoints | topology | collectives | memory | events | records"
    ),
    jsonl: bool = typer.Option(
        False,
        "--jsonl",
        help="with `records`: print every trajectory record as one "
        "JSON line on stdout (the export for DuckDB, Polars, jq)",
    ),
    json_: bool = JsonOpt,
):
    """Show a run: manifest, topology, loss per step, record counts, completeness, or one evidence view.
    `checkpoints` verifies each one (every file's sha256, every pickle scanned unrun) and exits 1 when a
    published checkpoint does not verify. `records --jsonl` exports the trajectory."""
    from disttrace.analysis import facts as run_facts
    from disttrace.store.rundir import Run
    from disttrace.views.show import render

    if jsonl:
        if view != "records":
            raise BadInput("--jsonl", "only the `records` view exports JSON lines")
        n = run_facts.export_records(Run(run_dir), sys.stdout.buffer)
        sys.stdout.buffer.flush()
        err.print(Text(f"{n} records", style="dim"))
        return
    result = run_facts.gather(run_dir, view)
    render(result, err, Run(run_dir).topology() if view == "summary" else None)
    if json_:
        emit_json(result)
    if view == "checkpoints":
        raise typer.Exit(verdict_exit(result.all_verified))


@app.command()
@handled
def watch(
    run_dir: Path = typer.Argument(
        ..., help="a run directory another process (or node, or torchrun) writes"
    ),
    timeout: float | None = typer.Option(
        None,
        "--timeout",
        help="give up (exit 3) when nothing was "
        "written to the run for this many seconds (default: twice the "
        "manifest's collective timeout plus 60 s)",
    ),
):
    """Follow a run while another process writes it, with the same live progress as `run` (step, loss, s/step,
    ETA, checkpoints, faults, failed ranks, stalls), and exit with its outcome: 0 complete, 3 failed (a rank
    failed, or its launcher is gone before the run was complete, or --timeout), 2 not a run."""
    from disttrace.views.progress import watch as watch_run

    raise typer.Exit(watch_run(run_dir, err, timeout_s=timeout))


@app.command("faults")
@handled
def faults_cmd(json_: bool = JsonOpt):
    """List the fault catalog: name, hook point, expected first divergence, parameters."""
    from rich.table import Table

    from disttrace.run.faults import catalog

    cat = catalog()
    if json_:
        emit_json(cat)
        return
    t = Table(title="fault catalog")
    for col in ("name", "hook point", "first divergence", "parameters", "what it does"):
        t.add_column(col)
    for f in cat:
        t.add_row(
            f["name"],
            f["point"],
            f["expect"],
            ", ".join(f"{k}={v}" for k, v in f["params"].items()),
            f["description"],
        )
    SafeConsole(no_color=bool(os.environ.get("NO_COLOR")) or None).print(t)


@app.command()
@handled
def diff(
    runs: list[Path] = typer.Argument(
        ...,
        help="run A (usually the reference) and run B (fault, recovered, or another topology); "
        "with --merge, the partial documents to combine",
        show_default=False,
    ),
    mode: str | None = typer.Option(
        None,
        "--mode",
        help="bitwise | numeric (default: bitwise when the "
        "topologies are equal, numeric otherwise)",
    ),
    rtol: float | None = typer.Option(
        None, "--rtol", help="numeric: override the derived bound (relative)"
    ),
    atol: float | None = typer.Option(
        None, "--atol", help="numeric: absolute part of an explicit bound"
    ),
    allow_edition_mismatch: bool = typer.Option(
        False, "--allow-edition-mismatch", help="compare runs of different editions anyway"
    ),
    calibration: Path | None = typer.Option(
        None,
        "--calibration",
        help="numeric: a `disttrace calibrate` "
        "file of A's or B's manifest; its measured bounds replace the "
        "derived ones where it has them (default: the calibration.json "
        "beside A's or B's run, if it calibrates that run's manifest)",
    ),
    no_calibration: bool = typer.Option(
        False, "--no-calibration", help="numeric: ignore a calibration found beside the runs"
    ),
    jobs: int = typer.Option(
        1,
        "--jobs",
        "-j",
        help="compare in N processes (ranks split between them when the topologies are the "
        "same, steps across topologies); the result is the one-process result",
    ),
    ranks: str | None = typer.Option(
        None,
        "--ranks",
        help="a partial diff of these ranks only, e.g. 0-63 or 0,2,4-7 (same topology): its --json "
        "is a partial document for --merge; exit 1 if they diverge, 4 (no verdict) if not",
    ),
    steps: str | None = typer.Option(
        None,
        "--steps",
        help="a partial diff of these steps only (any topology; every rank read), e.g. 1-500",
    ),
    share: str | None = typer.Option(
        None,
        "--share",
        help="K/N: a partial diff of the K-th (from 0) of N equal shares of the ranks (of the steps "
        "across topologies), e.g. a cluster node's index and the node count",
    ),
    merge: bool = typer.Option(
        False,
        "--merge",
        help="combine partial documents (`--ranks`/`--steps` ... --json) covering every rank or "
        "step once into the whole result",
    ),
    json_: bool = JsonOpt,
    md: bool = typer.Option(False, "--md", help="print a Markdown table (PR comment)"),
    zoom_: bool = typer.Option(
        False,
        "--zoom",
        help="also record the first divergent step at depth on both sides and name the first module "
        "(and op) inside it that differs, as `disttrace zoom` (exit 3: a depth job failed)",
    ),
    depth: str = typer.Option("module", "--depth", help="with --zoom: module | op"),
):
    """Find the first divergence (step, micro-batch, phase, rank, tensor) between two runs and how it spread.
    Exit 0 equal, 1 divergent, 2 incompatible or unreadable runs, 4 a partial diff without divergence."""
    from disttrace.analysis.diff import diff_runs
    from disttrace.views.diff import render_md, render_rich

    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})")
    if zoom_ and (merge or ranks is not None or steps is not None or share is not None):
        raise BadInput("--zoom", "zooms into two whole runs, not a partial or merged diff")
    if USER_COMMAND is not None and not zoom_:
        raise BadInput(
            "--", "a command after '--' replays an attached side at depth: it needs --zoom"
        )
    if merge:
        given = [
            name
            for name, v in (
                ("--mode", mode),
                ("--rtol", rtol),
                ("--atol", atol),
                ("--calibration", calibration),
                ("--ranks", ranks),
                ("--steps", steps),
                ("--share", share),
            )
            if v is not None
        ] + [
            name
            for name, v in (
                ("--allow-edition-mismatch", allow_edition_mismatch),
                ("--no-calibration", no_calibration),
                ("--jobs", jobs != 1),
            )
            if v
        ]
        if given:
            raise BadInput(
                "--merge",
                f"takes partial documents only, not {', '.join(given)}: the partials were made with "
                "their options, and a merge uses theirs",
            )
    elif len(runs) != 2:
        raise BadInput(
            " ".join(str(r) for r in runs) or "diff",
            f"takes two runs A B (got {len(runs)}), or --merge PARTIAL.json...",
        )
    if mode not in (None, "bitwise", "numeric"):
        raise BadInput("--mode", f"'{mode}' is not bitwise or numeric")
    opts = dict(
        mode=mode,
        rtol=rtol,
        atol=atol,
        allow_edition_mismatch=allow_edition_mismatch,
        calibration=calibration,
        find_calibration=not no_calibration,
    )
    part = None
    if merge:
        from disttrace.analysis.partial import merge_partials

        result = merge_partials(runs)
    elif ranks is not None or steps is not None or share is not None:
        from disttrace.analysis.partial import diff_partial, parse_share, parse_spec

        part = diff_partial(
            runs[0],
            runs[1],
            ranks=parse_spec(ranks, "--ranks") if ranks is not None else None,
            steps=parse_spec(steps, "--steps", limit=1 << 22) if steps is not None else None,
            share=parse_share(share) if share is not None else None,
            jobs=jobs,
            **opts,
        )
        result = part.result
    elif jobs > 1:
        result = diff_runs(runs[0], runs[1], jobs=jobs, **opts)
    else:
        from disttrace.views.progress import StepBar

        with StepBar(err, "diff") as on_step:  # a terminal only; a pipe or CI sees nothing
            result = diff_runs(runs[0], runs[1], on_step=on_step, **opts)
    what = part.covered if part is not None else None
    if zoom_:
        _zoom_and_exit(runs[0], runs[1], json_, md, depth=depth, rtol=rtol, atol=atol, diff=result)
    if json_:
        emit_json(part if part is not None else result)
    elif md:
        print(visible(render_md(result, partial=what), keep_newlines=True))
    else:
        render_rich(
            result,
            SafeConsole(
                stderr=False, no_color=bool(os.environ.get("NO_COLOR")) or None, emoji=False
            ),
            partial=what,
        )
    if part is not None:
        err.print(
            Text(
                f"partial diff of {what}: "
                + (
                    "they diverge (so do the runs)"
                    if part.diverged
                    else "no divergence there, no verdict on the rest"
                )
                + "; `disttrace diff --merge` of every share gives the whole result",
                style="yellow",
            ),
            soft_wrap=True,
        )
        raise typer.Exit(part.exit_code)
    raise typer.Exit(verdict_exit(result.equal))


def _zoom_and_exit(a, b, json_: bool, md: bool, **options) -> None:
    """`zoom` and `diff --zoom`: replay both sides at depth, show the result, exit with its verdict."""
    from disttrace.lab.zoom import zoom as zoom_runs
    from disttrace.views.zoom import render_md, render_rich

    z = zoom_runs(a, b, progress=err.print, command=USER_COMMAND, **options)
    if json_:
        emit_json(z)
    elif md:
        print(visible(render_md(z), keep_newlines=True))
    else:
        render_rich(
            z,
            SafeConsole(
                stderr=False, no_color=bool(os.environ.get("NO_COLOR")) or None, emoji=False
            ),
        )
    raise typer.Exit(verdict_exit(z.equal))


@app.command()
@handled
def zoom(
    run_a: Path = typer.Argument(..., help="first run (usually the reference)"),
    run_b: Path = typer.Argument(..., help="second run (fault, or another topology)"),
    depth: str = typer.Option(
        "module",
        "--depth",
        help="module: every module's output and output gradient; op: every aten op's output too "
        "(runs of one topology)",
    ),
    step: int | None = typer.Option(
        None, "--step", help="zoom into this step (default: diff's first divergent step)"
    ),
    mode: str | None = typer.Option(None, "--mode", help="bitwise | numeric, as diff"),
    rtol: float | None = typer.Option(None, "--rtol", help="numeric: an explicit bound, as diff"),
    atol: float | None = typer.Option(None, "--atol", help="numeric: absolute part, as diff"),
    json_: bool = JsonOpt,
    md: bool = typer.Option(False, "--md", help="print Markdown (PR comment)"),
):
    """diff A B, then record the first divergent step at depth on both sides and name the first module (forward
    in execution order, then backward) and, at op depth, the first op whose output differs (docs/zoom.md).
    Exit 0 equal, 1 a divergence found, 2 bad input, 3 a depth job failed."""
    if mode not in (None, "bitwise", "numeric"):
        raise BadInput("--mode", f"'{mode}' is not bitwise or numeric")
    if step is not None and step < 1:
        raise BadInput("--step", f"step {step} does not exist: steps count from 1")
    _zoom_and_exit(run_a, run_b, json_, md, depth=depth, step=step, mode=mode, rtol=rtol, atol=atol)


@app.command()
@handled
def gate(
    run_dir: Path = typer.Argument(..., help="the run to judge"),
    reference: Path | None = typer.Option(
        None, "--reference", help="the reference run to compare with"
    ),
    policy: Path | None = typer.Option(
        None,
        "--policy",
        help="a gate policy TOML ([eval] loss_rtol, or your own evaluation: command, metric, rtol, "
        "data, data_sha256 (docs/gate.md); [checks] required / require_all); default: the "
        "reference's manifest",
    ),
    require_all: bool = typer.Option(
        False, "--require-all", help="every check must apply: a check that is n/a fails (for CI)"
    ),
    replay: int = typer.Option(
        0,
        "--replay",
        help="re-execute this many steps, drawn at random, from the run's own checkpoints and demand "
        "its stored records reproduce bit for bit (a forged but self-consistent store fails)",
    ),
    replay_seed: int | None = typer.Option(
        None,
        "--replay-seed",
        help="the draw's seed (default: a fresh random one; verdict.json says which)",
    ),
    json_: bool = JsonOpt,
):
    """The independent evaluation gate: checkpoint integrity, collective sync, gradient equivalence, the eval
    metric scored by a fresh process on the held-out split, completeness. The thresholds are the reference's
    (or --policy's), never the candidate's own. Exit 0 pass, 1 fail, 2 bad input."""
    from disttrace.gate.verdict import gate as judge
    from disttrace.views.gate import render

    if replay < 0 or (replay_seed is not None and replay_seed < 0):
        raise BadInput("--replay", "must be a number >= 0")
    verdict = judge(
        run_dir,
        reference,
        policy_file=policy,
        require_all=require_all,
        replay=replay,
        replay_seed=replay_seed,
    )
    if json_:
        emit_json(verdict)
    else:
        render(verdict, err)
    raise typer.Exit(verdict_exit(verdict.passed))


@app.command()
@handled
def lab(
    manifest: Path | None = ManifestArg,
    fault: str | None = typer.Option(
        None, "--fault", help="the single fault (see `disttrace faults`)"
    ),
    step: int | None = typer.Option(None, "--step"),
    rank: int | None = typer.Option(None, "--rank"),
    param: list[str] | None = typer.Option(None, "--param", help="fault parameter key=value"),
    predict: str | None = typer.Option(
        None,
        "--predict",
        help="your prediction, written before the run: PHASE[@STEP[:RANK]], e.g. backward@3:1",
    ),
    list_: bool = typer.Option(
        False, "--list", help="list the curriculum's labs and which can run"
    ),
    set_: list[str] | None = SetOpt,
    out: Path = OutOpt,
    json_: bool = JsonOpt,
    quiet: bool = QuietOpt,
    zoom_: bool = typer.Option(
        False,
        "--zoom",
        help="also zoom into the fault path's first divergent step: the module (and op) inside it",
    ),
    depth: str = typer.Option("module", "--depth", help="with --zoom: module | op"),
):
    """The whole method in one command: reference (reused if verified), one fault, recover, diff, gate.
    Exit 0 when the attribution is accepted, 1 when not."""
    if list_:
        from disttrace.lab.curriculum import list_labs
        from disttrace.views.lab import render_labs

        labs = list_labs()
        emit_json(labs) if json_ else render_labs(labs, err)
        return
    if fault is None or step is None or rank is None:
        raise BadInput("lab", "--fault, --step and --rank are required (or --list)")
    from disttrace.lab import method as lab_mod
    from disttrace.views.progress import LiveProgress

    result = lab_mod.run_lab(
        manifest,
        fault,
        step,
        rank,
        parse_params(param),
        set_ or [],
        out,
        predict,
        progress=lambda msg: err.print(msg, soft_wrap=True),
        follow=lambda run_dir, path: LiveProgress(run_dir, err, label=path, enabled=not quiet),
        zoom_depth=depth if zoom_ else None,
    )
    if json_:
        emit_json(result)
    else:
        from disttrace.views.lab import render

        render(result, err)
        print(result.paths.fault.run_dir)
    raise typer.Exit(verdict_exit(result.accepted))


@app.command()
@handled
def plan(
    manifest: Path | None = typer.Argument(None, help="plan this manifest's model and topology"),
    set_: list[str] | None = SetOpt,
    params: str | None = typer.Option(
        None, "--params", help="parameter count, e.g. 7.5B (instead of a manifest)"
    ),
    dp: int = typer.Option(1, "--dp"),
    tp: int = typer.Option(1, "--tp"),
    pp: int = typer.Option(1, "--pp"),
    zero_stage: int = typer.Option(0, "--zero-stage"),
    optimizer: str = typer.Option("adam", "--optimizer"),
    precision: str = typer.Option("mixed", "--precision", help="mixed | fp32"),
    seq: int | None = typer.Option(None, "--seq"),
    micro_batch: int = typer.Option(1, "--micro-batch"),
    hidden: int | None = typer.Option(None, "--hidden"),
    heads: int | None = typer.Option(None, "--heads"),
    layers: int | None = typer.Option(None, "--layers"),
    micro_batches: int = typer.Option(1, "--micro-batches", help="pipeline micro-batches per step"),
    json_: bool = JsonOpt,
):
    """Predict without running: model-state memory per device for ZeRO 0-3, activation memory per layer,
    pipeline bubble, communication volume per device. Instant even for a 1T-parameter manifest."""
    from disttrace.plan import costs as plan_mod

    if params is not None:
        result = plan_mod.plan_cli_args(
            params,
            dp,
            tp,
            pp,
            zero_stage,
            optimizer,
            precision,
            seq,
            micro_batch,
            hidden,
            heads,
            layers,
            micro_batches,
        )
    else:
        frozen_doc = _plan_manifest(manifest, set_)
        result = plan_mod.plan_from_manifest(frozen_doc)
    if json_:
        emit_json(result)
    else:
        from disttrace.views.plan import render_plan

        render_plan(result, err)


def _plan_manifest(manifest, sets):
    """A plan needs the shapes, not the data: validate without hashing files."""
    from disttrace.config.manifest import DEFAULT_MANIFEST, apply_overrides, read_toml, validate

    path = Path(manifest) if manifest else DEFAULT_MANIFEST
    return validate(apply_overrides(read_toml(path), sets or []), path).model_dump(mode="json")


@app.command()
@handled
def trace(
    run_dir: Path = typer.Argument(..., help="a run directory"),
    output: Path = typer.Option(
        Path("trace.json"), "-o", "--output", help="where to write the trace"
    ),
):
    """Write a Chrome trace-event timeline (Perfetto, chrome://tracing): one process per rank, compute and
    one track per process group, collectives with their sizes."""
    from disttrace.analysis.timeline import build_trace
    from disttrace.store.rundir import Run, write_json_atomic

    doc = build_trace(Run(run_dir))
    write_json_atomic(output, doc)
    err.print(f"{len(doc['traceEvents'])} events -> {output}")
    print(output)


@app.command()
@handled
def check(run_dir: Path = typer.Argument(..., help="a run directory"), json_: bool = JsonOpt):
    """Within one run, no reference needed: copies that must be identical across ranks (replicas) are, and
    shards that must differ do. Exit 0 consistent, 1 inconsistent, 2 bad input or nothing to check (no
    replica rule applies to the run: never a vacuous pass)."""
    from disttrace.analysis.consistency import check_run
    from disttrace.store.rundir import Run

    res = check_run(Run(run_dir))
    if json_:
        emit_json(res)
    else:
        f = res.first
        if res.consistent is None:
            err.print(
                Text(str(res.reason), style="yellow")
            )  # Text: run-store strings are never markup
        elif f is None:
            err.print(
                Text("consistent", style="green")
                + Text(f": {res.steps_checked} steps, every replica group agrees")
            )
        else:
            err.print(
                Text("inconsistent", style="red")
                + Text(
                    f" at step {f.step} micro-batch {f.micro_batch} {f.phase} tensor {f.tensor}: "
                    f"{f.message}; minority rank(s) {f.minority} vs majority {f.majority} in group {f.group}"
                ),
                soft_wrap=True,
            )
            for s in res.spread[:20]:
                err.print(
                    Text(
                        f"  step {s.step}: {s.inconsistent} inconsistent, minority {s.minority_ranks}"
                    )
                )
    if res.consistent is None:
        raise typer.Exit(EXIT_BAD_INPUT)
    raise typer.Exit(verdict_exit(res.consistent))


@app.command()
@handled
def verify(run_dir: Path = typer.Argument(..., help="a run directory"), json_: bool = JsonOpt):
    """Is the run store what its job wrote? Hashes, never loads: the files COMPLETE seals, each rank's chain of
    step hashes (an edited, removed or reordered step breaks it), every checkpoint's INDEX and every pickle
    in it by opcodes (a global outside the allowlist is damage). Exit 0 intact, 1 damaged (the first damaged
    file and step named) or unsealed (an incomplete run, or one written before seals), 2 not a run. Guards
    against accidents and after-the-fact edits, not against a writer who rewrites every hash."""
    from disttrace.store.verify import summary_line, verify_run

    v = verify_run(run_dir)
    if json_:
        emit_json(v.to_dict())
    else:
        style = {"intact": "green", "damaged": "red"}.get(v.status, "yellow")
        line = summary_line(v)
        head, _, rest = line.partition(":")
        err.print(Text(head, style=style) + Text(":" + rest), soft_wrap=True)
    raise typer.Exit(verdict_exit(v.exit_ok))


@app.command()
@handled
def report(
    runs: list[Path] = typer.Argument(..., help="runs; the first is the reference"),
    output: Path = typer.Option(
        Path("report.html"), "-o", "--output", help="the HTML file to write"
    ),
):
    """One self-contained HTML page (no network needed): manifest, topology, loss curves of every path,
    divergence grid, memory ledger against theory, collectives, checkpoints, gate verdict."""
    from disttrace.report import build_report

    print(build_report(runs, output))


def main():
    global USER_COMMAND
    argv = sys.argv[1:]
    if (
        len(argv) > 1 and argv[0] in ("run", "inject", "replay", "zoom", "diff") and "--" in argv
    ):  # a user command, passed through whole
        cut = argv.index("--")
        USER_COMMAND = argv[cut + 1 :]
        sys.argv = [sys.argv[0], *argv[:cut]]
    try:
        app()
    except BadInput as e:  # raised outside a command (should not happen, but never a traceback)
        err.print(f"error: {e}")
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    main()
