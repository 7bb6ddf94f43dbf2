"""Views of a diff result: a compact terminal view (rich) and a markdown summary (for CI job summaries).

The comparison itself is `disttrace.analysis.diff.diff_runs`, which returns a `DiffResult`; this module
only renders it. The HTML report draws the same result in `views/report.py` with the same formatters
(`disttrace.fmt`).
"""

from __future__ import annotations

from disttrace.analysis.result import DiffResult, RankEntry, RecordStats
from disttrace.fmt import abbrev, agreeing_digits, fmt_number, ranges, where

GRID_STEPS = (
    60  # steps drawn in the rank x step grid; a later first divergence moves the window to it
)


def _cell(rank_entry: RankEntry | None) -> tuple[str, str]:
    """One grid cell: (character, style)."""
    if not rank_entry or not rank_entry.inexact:
        return "·", "green"
    differing = rank_entry.differing
    rel = rank_entry.max_rel_err
    if differing and (rank_entry.hard or not rel):
        return "■", "bold red"
    if not rel:
        return ("■", "bold red") if differing else ("·", "green")
    return str(agreeing_digits(rel)), ("red" if differing else "yellow")


def _grid_cells(result: DiffResult) -> tuple[list[int], dict[int, dict[int, RankEntry]]]:
    cs = result.compared_steps
    per_step = {s: e.ranks for s, e in result.step_entries().items()}
    first, last = cs.first, cs.last
    f = result.first_divergence
    start = first
    if f and f.step - first > GRID_STEPS - 10:
        start = max(first, f.step - 5)
    steps = list(range(start, min(last, start + GRID_STEPS - 1) + 1))
    return steps, per_step


def render_rich(result: DiffResult, console) -> None:
    """A compact human view of a diff result on a rich Console."""
    from rich.table import Table
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
    tol = result.tolerance
    tol_txt = (
        "bit for bit"
        if tol.kind == "bitwise"
        else f"rtol {tol.rtol:g} atol {tol.atol:g}"
        if tol.kind == "user"
        else f"calibrated bounds from {tol.file}"
        + (" (found beside the run)" if tol.found else "")
        + f" (derived {tol.per_step:.2e} per step elsewhere)"
        if tol.kind == "calibrated"
        else f"derived bound {tol.per_step:.2e} per step × steps since agreement"
        + (
            ", relative to the magnitudes behind each gradient"
            if tol.scale == "magnitudes"
            else ", relative to each record's norm (no magnitudes recorded)"
            if tol.scale == "norm"
            else ""
        )
    )
    console.print(
        Text(
            f"mode {result.mode} ({tol_txt}) · steps {cs.first}..{cs.last} ({cs.count}): {cs.why}",
            style="dim",
        )
    )

    f = result.first_divergence
    if f is None:
        console.print(Text(f"EQUAL over steps {cs.first}..{cs.last}", style="bold green"))
    else:
        console.print(Text("FIRST DIVERGENCE  " + where(f), style="bold red"))
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        t.add_column("")
        t.add_column("A")
        t.add_column("B")
        a, b = f.a or RecordStats(), f.b or RecordStats()
        T = lambda v: Text(str(v))  # noqa: E731  cells quote the run store: never markup
        if f.missing_in:
            t.add_row(
                "record",
                *(("missing", "present") if f.missing_in == "a" else ("present", "missing")),
            )
        t.add_row("digest", T(abbrev(a.digest)), T(abbrev(b.digest)))
        t.add_row("sum", T(fmt_number(a.sum, ".10g")), T(fmt_number(b.sum, ".10g")))
        t.add_row("norm", T(fmt_number(a.norm, ".10g")), T(fmt_number(b.norm, ".10g")))
        if a.nonfinite or b.nonfinite:
            t.add_row(
                "non-finite",
                T(fmt_number(a.nonfinite)),
                T(fmt_number(b.nonfinite)),
                style="red",
            )
        t.add_row(
            "dtype, shape",
            T(f"{a.dtype if f.a else '-'} {a.shape if f.a else ''}"),
            T(f"{b.dtype if f.b else '-'} {b.shape if f.b else ''}"),
        )
        console.print(t)
        rel = f.rel_err
        bnd = (
            "0 (bitwise)"
            if result.mode == "bitwise"
            else f"{fmt_number(f.bound, '.3e')} ({f.bound_kind.value})"
        )
        console.print(
            Text(
                f"rel err {fmt_number(rel, '.3e')}  vs bound {bnd}"
                + (f"  ({f.note})" if f.note else ""),
                style="red",
            )
        )
        n_div = result.divergent_steps
        rec = result.recovered_steps
        msg = f"{n_div} divergent step(s) from step {f.step}"
        if rec:
            msg += f"; equal again at step(s) {ranges(rec)}"
        console.print(Text(msg, style="dim"))

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
                Text(
                    f"{fmt_number(e.bound, '.2e')} ({e.bound_kind.value})"
                    if e.bound is not None
                    else fmt_number(e.bound, ".2e")
                ),
                Text(f"step {e.step} rank {e.rank}"),
                Text(f"{fmt_number(e.max_ratio, '.2g')}" + (f" (step {w.step})" if w else "")),
                style="red" if (e.max_ratio or 0) > 1 else None,
            )
        console.print(t)

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
                "· equal   digit: -log10(max rel err), yellow within the bound, red beyond   "
                "■ missing, non-finite or bits only",
                style="dim",
            )
        )
    for w in result.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


def render_md(result: DiffResult) -> str:
    """The result as markdown, for a pull-request comment."""
    cs = result.compared_steps
    f = result.first_divergence
    lines = []
    verdict = "✅ equal" if f is None else "❌ diverged"
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
    if f is not None:
        a, b = f.a or RecordStats(), f.b or RecordStats()
        lines.append(
            f"**First divergence**: {where(f)}"
            + (f", missing in {f.missing_in.upper()}" if f.missing_in else "")
            + (f" ({f.note})" if f.note else "")
        )
        lines.append("")
        lines.append("| | A | B |")
        lines.append("| --- | --- | --- |")
        lines.append(f"| digest | `{abbrev(a.digest, 16)}` | `{abbrev(b.digest, 16)}` |")
        lines.append(f"| sum | {fmt_number(a.sum, '.10g')} | {fmt_number(b.sum, '.10g')} |")
        lines.append(f"| norm | {fmt_number(a.norm, '.10g')} | {fmt_number(b.norm, '.10g')} |")
        lines.append(f"| non-finite | {fmt_number(a.nonfinite)} | {fmt_number(b.nonfinite)} |")
        lines.append("")
        lines.append(
            f"Relative error {fmt_number(f.rel_err, '.3e')} vs bound {fmt_number(f.bound, '.3e')}"
            + (f" ({f.bound_kind.value})." if result.mode == "numeric" else ".")
        )
        lines.append("")
        lines.append("| step | ranks with differences | tensors differing | max rel err |")
        lines.append("| --- | --- | --- | --- |")
        shown = result.propagation[:20]
        for e in shown:
            rk = [str(r) for r, v in e.ranks.items() if v.differing]
            tot = sum(v.total for v in e.ranks.values())
            rels = [v.max_rel_err for v in e.ranks.values() if v.max_rel_err]
            kinds = e.bound_kind_by_phase or {}
            bounds = [
                (b, kinds[p].value if p in kinds else "derived")
                for p, b in (e.bound_by_phase or {}).items()
                if b is not None
            ]
            lines.append(
                f"| {e.step} | {', '.join(rk) or '-'} | {e.differing} / {tot} | "
                f"{fmt_number(max(rels), '.2e') if rels else '-'}"
                + (" (bound {:.2e} {})".format(*max(bounds)) if bounds else "")
                + " |"
            )
        if len(result.propagation) > len(shown):
            lines.append(f"| … | | {len(result.propagation) - len(shown)} more steps | |")
        if result.recovered_steps:
            lines.append("")
            lines.append(f"Equal again at step(s) {ranges(result.recovered_steps)}.")
    if result.numeric is not None and result.numeric.by_phase:
        lines.append("")
        lines.append("| phase | max rel err | bound there | worst err/bound |")
        lines.append("| --- | --- | --- | --- |")
        for phase, e in result.numeric.by_phase.items():
            kind = f" ({e.bound_kind.value})" if e.bound is not None else ""
            lines.append(
                f"| {phase} | {fmt_number(e.max_rel_err, '.2e')} | {fmt_number(e.bound, '.2e')}{kind} | "
                f"{fmt_number(e.max_ratio, '.2g')} |"
            )
    if result.warnings:
        lines.append("")
        for w in result.warnings:
            lines.append(f"> ⚠️ {w}")
    return "\n".join(lines) + "\n"
