"""Comparing two runs: `diff` (to the first divergence, in one process or as partials) and `zoom`
(inside the first divergent step)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.text import Text

from disttrace.cli import shared
from disttrace.cli.shared import JsonOpt, app, emit_json, handled
from disttrace.errors import BadInput, verdict_exit
from disttrace.fmt import visible
from disttrace.views.console import SafeConsole

# diff's arguments and options (declared here so that the command reads as what it does)
_RUNS = typer.Argument(
    ...,
    help="run A (usually the reference) and run B (fault, recovered, or another topology); "
    "with --merge, the partial documents to combine",
    show_default=False,
)
_MODE = typer.Option(
    None,
    "--mode",
    help="bitwise | numeric (default: bitwise when the topologies are equal, or the records show one, "
    "numeric otherwise)",
)
_RTOL = typer.Option(None, "--rtol", help="numeric: override the derived bound (relative)")
_ATOL = typer.Option(None, "--atol", help="numeric: absolute part of an explicit bound")
_ALLOW_EDITION_MISMATCH = typer.Option(
    False, "--allow-edition-mismatch", help="compare runs of different editions anyway"
)
_CALIBRATION = typer.Option(
    None,
    "--calibration",
    help="numeric: a `disttrace calibrate` "
    "file of A's or B's manifest; its measured bounds replace the "
    "derived ones where it has them (default: the calibration.json "
    "beside A's or B's run, if it calibrates that run's manifest)",
)
_NO_CALIBRATION = typer.Option(
    False, "--no-calibration", help="numeric: ignore a calibration found beside the runs"
)
_JOBS = typer.Option(
    1,
    "--jobs",
    "-j",
    help="compare in N processes (ranks split between them when the topologies are the "
    "same, steps across topologies); the result is the one-process result",
)
_RANKS = typer.Option(
    None,
    "--ranks",
    help="a partial diff of these ranks only, e.g. 0-63 or 0,2,4-7 (same topology): its --json "
    "is a partial document for --merge; exit 1 if they diverge, 4 (no verdict) if not",
)
_STEPS = typer.Option(
    None,
    "--steps",
    help="a partial diff of these steps only (any topology; every rank read), e.g. 1-500",
)
_SHARE = typer.Option(
    None,
    "--share",
    help="K/N: a partial diff of the K-th (from 0) of N equal shares of the ranks (of the steps "
    "across topologies), e.g. a cluster node's index and the node count",
)
_MERGE = typer.Option(
    False,
    "--merge",
    help="combine partial documents (`--ranks`/`--steps` ... --json) covering every rank or "
    "step once into the whole result",
)
_MD = typer.Option(False, "--md", help="print a Markdown table (PR comment)")
_ZOOM = typer.Option(
    False,
    "--zoom",
    help="also record the first divergent step at depth on both sides and name the first module "
    "(and op) inside it that differs, as `disttrace zoom` (exit 3: a depth job failed)",
)
_DEPTH = typer.Option("module", "--depth", help="with --zoom: module | op")


@app.command()
@handled
def diff(
    runs: list[Path] = _RUNS,
    mode: str | None = _MODE,
    rtol: float | None = _RTOL,
    atol: float | None = _ATOL,
    allow_edition_mismatch: bool = _ALLOW_EDITION_MISMATCH,
    calibration: Path | None = _CALIBRATION,
    no_calibration: bool = _NO_CALIBRATION,
    jobs: int = _JOBS,
    ranks: str | None = _RANKS,
    steps: str | None = _STEPS,
    share: str | None = _SHARE,
    merge: bool = _MERGE,
    json_: bool = JsonOpt,
    md: bool = _MD,
    zoom_: bool = _ZOOM,
    depth: str = _DEPTH,
):
    """Find the first divergence (step, micro-batch, phase, rank, tensor) between two runs and how it spread.
    A numeric diff reports its sensitivity: per phase the largest bound it held records to, so an equal
    verdict reads "equal to within X" (docs/tolerance.md).
    Exit 0 equal, 1 divergent, 2 incompatible or unreadable runs, 4 a partial diff without divergence."""
    _refuse_combinations(
        jobs, zoom_, merge or not (ranks is None and steps is None and share is None)
    )
    if merge:
        _refuse_with_merge(
            {
                "--mode": mode,
                "--rtol": rtol,
                "--atol": atol,
                "--calibration": calibration,
                "--ranks": ranks,
                "--steps": steps,
                "--share": share,
            },
            {
                "--allow-edition-mismatch": allow_edition_mismatch,
                "--no-calibration": no_calibration,
                "--jobs": jobs != 1,
            },
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
    part, result = _diff(runs, merge, ranks, steps, share, jobs, opts)
    if zoom_:
        _zoom_and_exit(runs[0], runs[1], json_, md, depth=depth, rtol=rtol, atol=atol, diff=result)
    _print_and_exit(part, result, json_, md)


def _refuse_combinations(jobs: int, zoom_: bool, partial_or_merged: bool) -> None:
    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})")
    if zoom_ and partial_or_merged:
        raise BadInput("--zoom", "zooms into two whole runs, not a partial or merged diff")
    if shared.USER_COMMAND is not None and not zoom_:
        raise BadInput(
            "--", "a command after '--' replays an attached side at depth: it needs --zoom"
        )


def _refuse_with_merge(values: dict, flags: dict) -> None:
    """`--merge` takes partial documents only: any option given beside it is refused, by name."""
    given = [name for name, v in values.items() if v is not None] + [
        name for name, v in flags.items() if v
    ]
    if given:
        raise BadInput(
            "--merge",
            f"takes partial documents only, not {', '.join(given)}: the partials were made with "
            "their options, and a merge uses theirs",
        )


def _diff(runs, merge, ranks, steps, share, jobs, opts):
    """(the partial, or None; the result): merged partials, a partial diff, or the whole one."""
    from disttrace.analysis.diff import diff_runs

    part = None
    if merge:
        from disttrace.analysis.diff.parallel import merge_partials

        result = merge_partials(runs)
    elif ranks is not None or steps is not None or share is not None:
        from disttrace.analysis.diff.parallel import diff_partial, parse_share, parse_spec

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

        with StepBar(shared.err, "diff") as on_step:  # a terminal only; a pipe or CI sees nothing
            result = diff_runs(runs[0], runs[1], on_step=on_step, **opts)
    return part, result


def _print_and_exit(part, result, json_: bool, md: bool) -> None:
    from disttrace.views.diff import render_md, render_rich

    what = part.covered if part is not None else None
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
        shared.err.print(
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

    z = zoom_runs(a, b, progress=shared.err.print, command=shared.USER_COMMAND, **options)
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
