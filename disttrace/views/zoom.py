"""Views of a zoom result (analysis/zoom.py's `ZoomResult`): the diff it started from, then where inside the
step the runs first differ. The rows and their wording are views/diffparts.py's, shared with the HTML report
(views/report/); this module only styles them."""

from __future__ import annotations

from disttrace.views import diff as diff_view
from disttrace.views.diffparts import zoom_ab_rows, zoom_error_text, zoom_headline, zoom_rows


def render_rich(z, console) -> None:
    from rich.table import Table
    from rich.text import Text

    diff_view.render_rich(z.diff, console)
    console.print(
        Text(
            zoom_headline(z),
            style="bold red" if z.first_divergence and z.first_divergence.at_depth else "bold",
        )
    )
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column("")
    t.add_column("")
    for label, text in zoom_rows(z):
        t.add_row(label, Text(text))
    console.print(t)
    rows = zoom_ab_rows(z)
    if rows:
        t = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
        t.add_column("")
        t.add_column("A")
        t.add_column("B")
        for row in rows:
            t.add_row(row.label, Text(row.a), Text(row.b), style="red" if row.alert else None)
        console.print(t)
        console.print(Text(zoom_error_text(z), style="red"))
    for w in z.warnings:
        console.print(Text(f"warning: {w}", style="yellow"))


def render_md(z) -> str:
    lines = [diff_view.render_md(z.diff).rstrip("\n"), "", f"#### {zoom_headline(z)}", ""]
    rows = zoom_rows(z)
    if rows:
        lines += ["| | |", "| --- | --- |"]
        lines += [f"| {label} | {text} |" for label, text in rows]
        lines.append("")
    ab = zoom_ab_rows(z)
    if ab:
        lines += ["| | A | B |", "| --- | --- | --- |"]
        for row in ab:
            a, b = (f"`{row.a}`", f"`{row.b}`") if row.code else (row.a, row.b)
            lines.append(f"| {row.label} | {a} | {b} |")
        lines += ["", zoom_error_text(z) + "."]
    for w in z.warnings:
        lines += ["", f"> ⚠️ {w}"]
    return "\n".join(lines) + "\n"
