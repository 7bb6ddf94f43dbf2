"""The verdicts: `gate` (the independent evaluation) and `lab` (the whole method in one command)."""

from __future__ import annotations

from pathlib import Path

import typer

from disttrace.cli import shared
from disttrace.cli.shared import (
    JsonOpt,
    ManifestArg,
    OutOpt,
    QuietOpt,
    SetOpt,
    app,
    emit_json,
    handled,
    parse_params,
)
from disttrace.errors import BadInput, verdict_exit


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
        "data, data_sha256 (docs/gate.md); [equivalence] max_sensitivity / "
        "max_sensitivity_by_phase; [checks] required / require_all); default: the "
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
    from disttrace.lab.reexecute import gate_with_replay as judge
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
        render(verdict, shared.err)
    raise typer.Exit(verdict_exit(verdict.passed))


_LAB_ZOOM = typer.Option(
    False,
    "--zoom",
    help="also zoom into the fault path's first divergent step: the module (and op) inside it",
)


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
    zoom_: bool = _LAB_ZOOM,
    depth: str = typer.Option("module", "--depth", help="with --zoom: module | op"),
):
    """The whole method in one command: reference (reused if verified), one fault, recover, diff, gate.
    Exit 0 when the attribution is accepted, 1 when not."""
    if list_:
        from disttrace.lab.curriculum import list_labs
        from disttrace.views.lab import render_labs

        labs = list_labs()
        emit_json(labs) if json_ else render_labs(labs, shared.err)
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
        progress=lambda msg: shared.err.print(msg, soft_wrap=True),
        follow=lambda run_dir, path: LiveProgress(
            run_dir, shared.err, label=path, enabled=not quiet
        ),
        zoom_depth=depth if zoom_ else None,
    )
    if json_:
        emit_json(result)
    else:
        from disttrace.views.lab import render

        render(result, shared.err)
        print(result.paths.fault.run_dir)
    raise typer.Exit(verdict_exit(result.accepted))
