"""The loss curves of every run on one plot, how far they agree, and the table beside them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass
from disttrace.views.report.parts import (
    _R,
    DASHES,
    LOSS_TABLE_MAX_ROWS,
    NOT_RECORDED,
    WIDTHS,
    _err,
    _nice_ticks,
    _nr,
    _table,
    _td_num,
    _tick_label,
    e,
)


def _loss(rs: list[_R]) -> str:
    series: list[tuple[_R, dict[int, float]]] = []
    notes = []
    for r in rs:
        ls = r.evidence.losses
        if isinstance(ls, BaseException):
            notes.append(_err(f"{r.label}: loss records", ls))
            ls = {}
        if not ls:
            notes.append(f'<p class="nr">{e(r.label)}: loss {NOT_RECORDED}</p>')
        series.append((r, ls))
    pts = [(s, v) for _, ls in series for s, v in ls.items() if math.isfinite(v)]
    if not pts:
        return _nr("no loss recorded in any run") + "".join(notes)
    svg = _loss_svg(series)
    return svg + _loss_agreement(series) + "".join(notes) + _loss_table(series)


def _loss_agreement(series: list[tuple[_R, dict[int, float]]]) -> str:
    """How closely each run's loss follows the reference's: the point is that it usually does."""
    ref = series[0][1]
    items = []
    for r, ls in series[1:]:
        common = [s for s in ls if s in ref]
        if not common:
            items.append(f"{r.name_html()}: no step in common with the reference")
            continue
        rels = [abs(ls[s] - ref[s]) / max(abs(ref[s]), 1e-300) for s in common]
        worst = max(rels)
        span = f"steps {min(common)}..{max(common)}"
        if worst == 0:
            items.append(f"{r.name_html()}: the same loss, bit for bit, at {e(span)}")
        elif math.isfinite(worst):
            digits = max(0, int(math.floor(-math.log10(worst))))
            items.append(
                f"{r.name_html()}: largest relative loss difference {worst:.1e} over {e(span)} "
                f"(agrees to about {digits} digits)"
            )
        else:
            items.append(f"{r.name_html()}: a non-finite loss over {e(span)}")
    if not items:
        return ""
    return '<ul class="losssum">' + "".join(f"<li>{x}</li>" for x in items) + "</ul>"


def _loss_svg(series: list[tuple[_R, dict[int, float]]]) -> str:
    W, H = 900, 360
    ml, mr, mt, mb = 70, 20, 16, 46
    legend_h = 28
    pw, ph = W - ml - mr, H - mt - mb
    x0, x1, y0, y1 = _loss_ranges(series)

    def X(s: float) -> float:
        return ml + (s - x0) / (x1 - x0) * pw

    def Y(v: float) -> float:
        return mt + (1 - (v - y0) / (y1 - y0)) * ph

    total_h = H + legend_h
    p = [
        f'<svg class="plot" width="{W}" height="{total_h}" viewBox="0 0 {W} {total_h}" role="img" '
        f'aria-label="training loss per step">'
    ]
    p.append(
        f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fbfcfe" stroke="#d5dae3"/>'
    )
    p += _loss_grid(X, Y, (x0, x1, y0, y1), (ml, mt, pw, ph))
    p += _loss_lines(series, X, Y)
    p += _loss_legend(series, ml, H)
    p.append("</svg>")
    return '<div class="plotbox">' + "".join(p) + "</div>"


def _loss_ranges(series: list[tuple[_R, dict[int, float]]]) -> tuple[float, float, float, float]:
    """The plot's step and loss ranges (x0, x1, y0, y1): every finite loss inside, with a margin."""
    pts = [(s, v) for _, ls in series for s, v in ls.items() if math.isfinite(v)]
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = min(ys), max(ys)
    if y0 == y1:
        pad = abs(y0) * 0.01 or 0.5
        y0, y1 = y0 - pad, y1 + pad
    pad = (y1 - y0) * 0.06
    y0, y1 = y0 - pad, y1 + pad
    return x0, x1, y0, y1


def _loss_grid(X, Y, ranges: tuple, frame: tuple) -> list[str]:
    """The grid lines, tick labels and axis titles of the plot (X, Y: step and loss to pixels)."""
    x0, x1, y0, y1 = ranges
    ml, mt, pw, ph = frame
    p = []
    yt, ystep = _nice_ticks(y0, y1, 6)
    for t in yt:
        if y0 <= t <= y1:
            p.append(
                f'<line x1="{ml}" x2="{ml + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" class="gridline"/>'
            )
            p.append(
                f'<text x="{ml - 8}" y="{Y(t) + 4:.1f}" text-anchor="end" class="tick">'
                f"{e(_tick_label(t, ystep))}</text>"
            )
    if x1 - x0 <= 16:
        xt = [s for s in range(math.ceil(x0), math.floor(x1) + 1)]
    else:
        xt_f, _ = _nice_ticks(x0, x1, 8)
        xt = sorted({int(round(t)) for t in xt_f})
    for s in xt:
        if x0 <= s <= x1:
            p.append(
                f'<line x1="{X(s):.1f}" x2="{X(s):.1f}" y1="{mt}" y2="{mt + ph}" class="gridline"/>'
            )
            p.append(
                f'<text x="{X(s):.1f}" y="{mt + ph + 18}" text-anchor="middle" class="tick">{s}</text>'
            )
    p.append(
        f'<text x="{ml + pw / 2}" y="{mt + ph + 38}" text-anchor="middle" class="axis">step</text>'
    )
    p.append(
        f'<text x="16" y="{mt + ph / 2}" text-anchor="middle" class="axis" '
        f'transform="rotate(-90 16 {mt + ph / 2})">training loss</text>'
    )
    return p


def _loss_lines(series: list[tuple[_R, dict[int, float]]], X, Y) -> list[str]:
    """Each run's curve, dashed and wide by its place, a marker with its value at each step."""
    p = []
    for i, (r, ls) in enumerate(series):
        good = [(s, v) for s, v in sorted(ls.items()) if math.isfinite(v)]
        dash = DASHES[i % len(DASHES)]
        width = WIDTHS[i % len(WIDTHS)]
        coords = " ".join(f"{X(s):.2f},{Y(v):.2f}" for s, v in good)
        p.append(
            f'<polyline class="loss-line" data-run="{e(r.label)}" points="{coords}" fill="none" '
            f'stroke="{r.colour}" stroke-width="{width}" stroke-linecap="round" stroke-linejoin="round"'
            + (f' stroke-dasharray="{dash}"' if dash else "")
            + f"><title>{e(r.label)}</title></polyline>"
        )
        for s, v in good:
            p.append(
                f'<circle cx="{X(s):.2f}" cy="{Y(v):.2f}" r="{3.6 - 0.6 * min(i, 3):.1f}" fill="{r.colour}">'
                f"<title>{e(r.label)} step {s}: {v:.9g}</title></circle>"
            )
    return p


def _loss_legend(series: list[tuple[_R, dict[int, float]]], ml: float, H: float) -> list[str]:
    """The legend, below the plot: it never covers a curve."""
    p = []
    lx, ly = ml, H + 8
    for i, (r, _) in enumerate(series):
        dash = DASHES[i % len(DASHES)]
        p.append(
            f'<line x1="{lx}" x2="{lx + 34}" y1="{ly + 6}" y2="{ly + 6}" stroke="{r.colour}" '
            f'stroke-width="{WIDTHS[i % len(WIDTHS)]}" stroke-linecap="round"'
            + (f' stroke-dasharray="{dash}"' if dash else "")
            + "/>"
        )
        text = r.label + ("" if r.complete else " (incomplete)")
        p.append(f'<text x="{lx + 42}" y="{ly + 10}" class="legend">{e(text)}</text>')
        lx += 60 + 7.5 * len(text)
    return p


def _loss_table(series: list[tuple[_R, dict[int, float]]]) -> str:
    ref = series[0][1]
    steps = sorted({s for _, ls in series for s in ls})
    note = ""
    if len(steps) > LOSS_TABLE_MAX_ROWS:
        k = math.ceil(len(steps) / LOSS_TABLE_MAX_ROWS)
        shown = steps[::k]
        if shown[-1] != steps[-1]:
            shown.append(steps[-1])
        note = f'<p class="muted small">every {k}th step shown</p>'
        steps = shown
    rows = []
    for s in steps:
        cells = [_td_num(str(s))]
        for i, (_r, ls) in enumerate(series):
            v = ls.get(s)
            if v is None:
                cells.append('<td class="num nr">-</td>')
                continue
            txt = f"{v:.9g}"
            if i > 0 and s in ref:
                dv = v - ref[s]
                if dv == 0:
                    txt += ' <span class="delta eq">= ref</span>'
                else:
                    txt += f' <span class="delta ne">Δ {dv:+.2e}</span>'
            cells.append(_td_num(txt))
        rows.append(cells)
    head = ["step", *[r.label for r, _ in series]]
    return (
        '<details class="losstable"><summary>loss per step (Δ against the reference; a loss that agrees to '
        "6 digits can still hide a divergence)</summary>" + _table(head, rows) + note + "</details>"
    )
