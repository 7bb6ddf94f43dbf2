"""The commands that read a run store, or a manifest, and launch nothing: `plan`, `trace`, `check`,
`verify` and `report`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from disttrace.cli import shared
from disttrace.cli.shared import JsonOpt, SetOpt, app, emit_json, handled
from disttrace.errors import EXIT_BAD_INPUT, verdict_exit


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
    from disttrace.plan import layout as plan_mod

    if params is not None:
        result = plan_mod.plan_cli_args(
            plan_mod.PlanRequest(
                params,
                dp=dp,
                tp=tp,
                pp=pp,
                zero_stage=zero_stage,
                optimizer=optimizer,
                precision=precision,
                seq=seq,
                micro_batch=micro_batch,
                hidden=hidden,
                heads=heads,
                n_layers=layers,
                micro_batches=micro_batches,
            )
        )
    else:
        frozen_doc = _plan_manifest(manifest, set_)
        result = plan_mod.plan_from_manifest(frozen_doc)
    if json_:
        emit_json(result)
    else:
        from disttrace.views.plan import render_plan

        render_plan(result, shared.err)


def _plan_manifest(manifest, sets):
    """A plan needs the shapes, not the data: validate without hashing files."""
    from disttrace.config.freezing import apply_overrides, read_toml, validate
    from disttrace.config.manifest import DEFAULT_MANIFEST

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
    from disttrace.store.rundir import Run
    from disttrace.store.writers import write_json_atomic

    doc = build_trace(Run(run_dir))
    write_json_atomic(output, doc)
    shared.err.print(f"{len(doc['traceEvents'])} events -> {output}")
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
            shared.err.print(
                Text(str(res.reason), style="yellow")
            )  # Text: run-store strings are never markup
        elif f is None:
            shared.err.print(
                Text("consistent", style="green")
                + Text(f": {res.steps_checked} steps, every replica group agrees")
            )
        else:
            shared.err.print(
                Text("inconsistent", style="red")
                + Text(
                    f" at step {f.step} micro-batch {f.micro_batch} {f.phase} tensor {f.tensor}: "
                    f"{f.message}; minority rank(s) {f.minority} vs majority {f.majority} in group {f.group}"
                ),
                soft_wrap=True,
            )
            for s in res.spread[:20]:
                shared.err.print(
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
        shared.err.print(Text(head, style=style) + Text(":" + rest), soft_wrap=True)
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
