"""Views of a diff result: a compact terminal view (rich) and a markdown summary (for CI job summaries).

The comparison itself is `disttrace.analysis.diff.diff_runs`, which returns a `DiffResult`; this module
only renders it. The HTML report draws the same result in `views/report/`; the wording of the tolerance
and bounds, the A/B rows and the grid's cell classes are `views/diffparts.py`'s, shared by all three.
"""

from __future__ import annotations

from disttrace.analysis.result import DiffResult, RankEntry
from disttrace.fmt import fmt_number, ranges, where
from disttrace.views.diffparts import (
    SENSITIVITY_COLUMNS,
    CellClass,
    ab_rows,
    bound_text,
    cell,
    error_text,
    grid_steps,
    propagation_row,
    sensitivity_rows,
    spread_text,
    tolerance_text,
    within_text,
)

GRID_STEPS = (
    60  # steps drawn in the rank x step grid; a later first divergence moves the window to it
)


# each cell class's character (None: the agreeing digits) and style on a terminal
CELL_STYLE = {
    CellClass.EQUAL: ("·", "green"),
    CellClass.WITHIN: (None, "yellow"),
    CellClass.BEYOND: (None, "red"),
    CellClass.HARD: ("■", "bold red"),
}


def _cell(rank_entry: RankEntry | None) -> tuple[str, str]:
    """One grid cell: (character, style)."""
    c = cell(rank_entry)
    ch, style = CELL_STYLE[c.cls]
    return ch or (str(c.digits) if c.digits is not None else "~"), style


def _grid_cells(result: DiffResult) -> tuple[list[int], dict[int, dict[int, RankEntry]]]:
    per_step = {s: e.ranks for s, e in result.step_entries().items()}
    return grid_steps(result, GRID_STEPS, lead=5), per_step


def render_rich(result: DiffResult, console, partial: str | None = None) -> None:
    """A compact human view of a diff result on a rich Console. `partial` names what a partial diff read
    (its ranks or steps): no divergence there is then no verdict, never "equal"."""
    from rich.text import Text

    _rich_sides(result, console)
    _rich_first(result, console, partial)
    _rich_phases(result, console)
    _rich_grid(result, console)
    for w in result.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


def _rich_sides(result: DiffResult, console) -> None:
    """Both runs, and what they were compared on."""
    from rich.text import Text

    cs = result.compared_steps
    for label, s in (("a", result.a), ("b", result.b)):
        t = Text()
        t.append(f"{label.upper()} ", style="bold")
        t.append(f"{s.kind or '?':<10} ", style="cyan")
        t.append(s.path)
        t.append(
            "  complete" if s.complete else "  INCOMPLETE",
            style="green" if s.complete else "yellow",
        )
        t.append(f"  manifest {(s.manifest_id or '')[:12]}", style="dim")
        console.print(t)
    tol_txt = tolerance_text(result.tolerance)
    console.print(
        Text(
            f"mode {result.mode} ({tol_txt}) · steps {cs.first}..{cs.last} ({cs.count}): {cs.why}",
            style="dim",
        )
    )


def _rich_first(result: DiffResult, console, partial: str | None) -> None:
    """The verdict: equal, nothing found in a partial diff, or the first divergence side by side."""
    from rich.table import Table
    from rich.text import Text

    cs = result.compared_steps
    f = result.first_divergence
    if f is None and partial is not None:
        console.print(
            Text(
                f"NO DIVERGENCE in {partial} over steps {cs.first}..{cs.last} "
                "(a partial diff: no verdict on the rest)",
                style="bold yellow",
            )
        )
    elif f is None:
        console.print(Text(f"EQUAL over steps {cs.first}..{cs.last}", style="bold green"))
        console.print(Text(within_text(result), style="green"))
    else:
        console.print(Text("FIRST DIVERGENCE  " + where(f), style="bold red"))
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        t.add_column("")
        t.add_column("A")
        t.add_column("B")
        for row in ab_rows(f):  # Text: cells quote the run store, never markup
            t.add_row(row.label, Text(row.a), Text(row.b), style="red" if row.alert else None)
        console.print(t)
        console.print(Text(error_text(f, result.mode), style="red"))
        console.print(Text(spread_text(result), style="dim"))


def _rich_phases(result: DiffResult, console) -> None:
    """The largest relative error of each phase, against its bound."""
    from rich.table import Table
    from rich.text import Text

    if result.numeric is not None and result.numeric.by_phase:
        t = Table(
            title="largest relative error per phase",
            box=None,
            header_style="bold",
            title_justify="left",
        )
        for c in ("phase", "max rel err", "bound there", "at", "worst err/bound"):
            t.add_column(c)
        for phase, e in result.numeric.by_phase.items():
            w = e.max_ratio_at
            t.add_row(
                Text(str(phase)),
                Text(fmt_number(e.max_rel_err, ".2e")),
                Text(bound_text(e.bound, e.bound_kind, ".2e")),
                Text(f"step {e.step} rank {e.rank}"),
                Text(f"{fmt_number(e.max_ratio, '.2g')}" + (f" (step {w.step})" if w else "")),
                style="red" if (e.max_ratio or 0) > 1 else None,
            )
        console.print(t)
    rows = sensitivity_rows(result)
    if rows:
        t = Table(
            title="sensitivity: the smallest relative change flagged, per phase",
            box=None,
            header_style="bold",
            title_justify="left",
        )
        for c in SENSITIVITY_COLUMNS:
            t.add_column(c)
        for row in rows:
            t.add_row(*map(Text, row), style="yellow" if row[-1] == "none" else None)
        console.print(t)


def _rich_grid(result: DiffResult, console) -> None:
    """The rank x step grid, a character a cell."""
    from rich.text import Text

    cs = result.compared_steps
    steps, per_step = _grid_cells(result)
    if steps and result.ranks:
        head = Text("rank  ")
        for s in steps:
            head.append("|" if s % 10 == 0 else " ", style="dim")
        console.print(Text(f"steps {steps[0]}..{steps[-1]} (| every 10th step)", style="dim"))
        console.print(head)
        for r in result.ranks:
            line = Text(f"{r:>4}  ")
            for s in steps:
                ch, style = _cell((per_step.get(s) or {}).get(r))
                line.append(ch, style=style)
            console.print(line)
        if len(steps) < cs.count:
            console.print(
                Text(f"(grid shows {len(steps)} of {cs.count} compared steps)", style="dim")
            )
        console.print(
            Text(
                "· bit-identical   digit: -log10(max rel err), yellow "
                f"{CellClass.WITHIN.legend}, red {CellClass.BEYOND.legend}   "
                f"■ {CellClass.HARD.legend}",
                style="dim",
            )
        )


def render_md(result: DiffResult, partial: str | None = None) -> str:
    """The result as markdown, for a pull-request comment (`partial`: as render_rich's)."""
    cs = result.compared_steps
    f = result.first_divergence
    lines = []
    verdict = "✅ equal" if f is None else "❌ diverged"
    if partial is not None:
        verdict = (
            f"no divergence in {partial} (partial: no verdict on the rest)"
            if f is None
            else f"❌ diverged in {partial} (partial)"
        )
    lines.append(f"### disttrace diff: {verdict} ({result.mode})")
    lines.append("")
    lines.append("| run | path | kind | complete | manifest |")
    lines.append("| --- | --- | --- | --- | --- |")
    for label, s in (("a", result.a), ("b", result.b)):
        lines.append(
            f"| {label.upper()} | `{s.path}` | {s.kind or '?'} | {'yes' if s.complete else 'no'} | "
            f"`{(s.manifest_id or '')[:12]}` |"
        )
    lines.append("")
    lines.append(f"Compared steps {cs.first}..{cs.last} ({cs.count}): {cs.why}.")
    lines.append("")
    lines.append(f"Held to: {tolerance_text(result.tolerance)}.")
    lines.append("")
    if f is None and partial is None:
        within = within_text(result)
        lines.append(f"{within[:1].upper()}{within[1:]}.")
        lines.append("")
    if f is not None:
        lines.append(
            f"**First divergence**: {where(f)}"
            + (f", missing in {f.missing_in.upper()}" if f.missing_in else "")
            + (f" ({f.note})" if f.note else "")
        )
        lines.append("")
        lines.append("| | A | B |")
        lines.append("| --- | --- | --- |")
        for row in ab_rows(f):
            a, b = (f"`{row.a}`", f"`{row.b}`") if row.code else (row.a, row.b)
            lines.append(f"| {row.label} | {a} | {b} |")
        lines.append("")
        lines.append(error_text(f, result.mode) + ".")
        lines.append("")
        lines += _md_propagation(result)
        if result.recovered_steps:
            lines.append("")
            lines.append(f"Equal again at step(s) {ranges(result.recovered_steps)}.")
    lines += _md_phases(result)
    if result.warnings:
        lines.append("")
        for w in result.warnings:
            lines.append(f"> ⚠️ {w}")
    return "\n".join(lines) + "\n"


def _md_propagation(result: DiffResult) -> list[str]:
    """The propagation table: each step from the first divergence on (the first 20)."""
    lines = []
    lines.append("| step | ranks with differences | tensors differing | max rel err |")
    lines.append("| --- | --- | --- | --- |")
    shown = result.propagation[:20]
    for row in map(propagation_row, shown):
        lines.append(
            f"| {row.step} | {', '.join(row.ranks) or '-'} | {row.differing} / {row.total} | "
            f"{fmt_number(row.max_rel_err, '.2e') if row.max_rel_err is not None else '-'}"
            + (f" (bound {bound_text(*row.worst_bound, '.2e')})" if row.worst_bound else "")
            + " |"
        )
    if len(result.propagation) > len(shown):
        lines.append(f"| … | | {len(result.propagation) - len(shown)} more steps | |")
    return lines


def _md_phases(result: DiffResult) -> list[str]:
    """The largest relative error of each phase against its bound (a numeric diff)."""
    if result.numeric is None or not result.numeric.by_phase:
        return []
    lines = []
    lines.append("")
    lines.append("| phase | max rel err | bound there | worst err/bound |")
    lines.append("| --- | --- | --- | --- |")
    for phase, e in result.numeric.by_phase.items():
        lines.append(
            f"| {phase} | {fmt_number(e.max_rel_err, '.2e')} | {bound_text(e.bound, e.bound_kind, '.2e')} | "
            f"{fmt_number(e.max_ratio, '.2g')} |"
        )
    rows = sensitivity_rows(result)
    if rows:
        lines.append("")
        lines.append("Sensitivity (the smallest relative change each phase would have flagged):")
        lines.append("")
        lines.append("| " + " | ".join(SENSITIVITY_COLUMNS) + " |")
        lines.append("|" + " --- |" * len(SENSITIVITY_COLUMNS))
        for row in rows:
            lines.append("| " + " | ".join(row) + " |")
    return lines
