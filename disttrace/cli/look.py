"""Looking at one run: `show`, `watch` (a run another process writes), and the fault catalog (`faults`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer
from rich.text import Text

from disttrace.cli import shared
from disttrace.cli.shared import JsonOpt, app, emit_json, handled
from disttrace.errors import BadInput, verdict_exit
from disttrace.views.console import SafeConsole


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
        shared.err.print(Text(f"{n} records", style="dim"))
        return
    result = run_facts.gather(run_dir, view)
    render(result, shared.err, Run(run_dir).topology() if view == "summary" else None)
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

    raise typer.Exit(watch_run(run_dir, shared.err, timeout_s=timeout))


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
