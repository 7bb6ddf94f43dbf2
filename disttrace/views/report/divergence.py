"""Each run against the reference: the first divergence with its A/B rows, the rank x step grid and
the zoom into the step (the wording and cell classes are views/diffparts.py's, shared with the terminal
and markdown)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from disttrace.analysis.result import DiffResult, RankEntry
from disttrace.fmt import fmt_number, where
from disttrace.views.diffparts import (
    SENSITIVITY_COLUMNS,
    CellClass,
    ab_rows,
    cell,
    error_text,
    grid_steps,
    propagation_row,
    sensitivity_rows,
    spread_text,
    tolerance_text,
    within_text,
    zoom_ab_rows,
    zoom_error_text,
    zoom_headline,
    zoom_rows,
)

if TYPE_CHECKING:
    pass
from disttrace.views.report.parts import (
    _R,
    EQUAL_COLOUR,
    GRID_MAX_STEPS,
    HARD_COLOUR,
    WITHIN_COLOUR,
    _dark,
    _err,
    _guard,
    _lerp_colour,
    _nr,
    _table,
    _td_num,
    e,
)


def _divergence(rs: list[_R], diffs: dict[int, Any], zooms: dict[int, Any] | None = None) -> str:
    if len(rs) < 2:
        return _nr("one run only: nothing to diff against the reference")
    out = []
    for r in rs[1:]:
        d = diffs.get(r.index)
        out.append(
            f'<div class="diffblock"><h3>{rs[0].tag_html()} <span class="muted">vs</span> '
            f"{r.tag_html()}</h3>"
        )
        if isinstance(d, BaseException):
            out.append(_err("not compared", d))
        elif d is None:
            out.append(_nr("not compared"))
        else:
            out.append(_guard("the diff", _one_diff, d))
            z = (zooms or {}).get(r.index)
            if isinstance(z, BaseException):
                out.append(_err("not zoomed", z))
            elif z is not None:
                out.append(_guard("the zoom", _one_zoom, z))
        out.append("</div>")
    return "".join(out)


def _one_diff(d: DiffResult) -> str:
    cs = d.compared_steps
    tol_txt = tolerance_text(d.tolerance)
    out = [
        f'<p class="muted">mode <b>{e(d.mode)}</b> ({e(tol_txt)}) · compared steps '
        f"{e(cs.first)}..{e(cs.last)} ({e(cs.count)}): {e(cs.why)}</p>"
    ]
    f = d.first_divergence
    if f is None:
        out.append(f'<p class="verdict ok">EQUAL over steps {e(cs.first)}..{e(cs.last)}</p>')
        out.append(f'<p class="muted">{e(within_text(d))}</p>')
    else:
        out.append(f'<p class="verdict bad">First divergence: {e(where(f))}</p>')
        rows = [
            [
                e(row.label),
                *(f"<code>{e(x)}</code>" if row.code else _td_num(e(x)) for x in (row.a, row.b)),
            ]
            for row in ab_rows(f)
        ]
        out.append(
            '<div class="row"><div>' + _table(("", "A (reference)", "B"), rows) + "</div>"
            f'<div class="muted">{e(error_text(f, d.mode))}</div></div>'
        )
        out.append(f'<p class="muted">{e(spread_text(d))}</p>')
    out.append(_diff_grid(d))
    prop = d.propagation
    if prop:
        rows = []
        for row in map(propagation_row, prop[:20]):
            rel = row.max_rel_err
            rows.append(
                [
                    _td_num(e(row.step)),
                    e(", ".join(row.ranks) or "-"),
                    _td_num(f"{e(row.differing)} / {row.total}"),
                    _td_num(e(fmt_number(rel, ".2e") if rel is not None else "-")),
                    e(", ".join(row.phases) or "-"),
                ]
            )
        more = f'<p class="muted small">… {len(prop) - 20} more steps</p>' if len(prop) > 20 else ""
        out.append(
            "<details><summary>propagation per step</summary>"
            + _table(
                ("step", "ranks differing", "tensors differing", "max rel err", "phases"), rows
            )
            + more
            + "</details>"
        )
    sens = sensitivity_rows(d)
    if sens:
        out.append(
            "<details><summary>sensitivity: the smallest relative change flagged, per phase</summary>"
            + _table(
                SENSITIVITY_COLUMNS,
                [[e(x) for x in row] for row in sens],
            )
            + "</details>"
        )
    for w in d.warnings:
        out.append(f'<p class="warn">warning: {e(w)}</p>')
    return "".join(out)


def _one_zoom(z) -> str:
    """Where inside the first divergent step the runs first differ (views/diffparts.py's zoom rows)."""
    f = z.first_divergence
    bad = f is not None and f.at_depth is not None
    out = [f'<p class="verdict {"bad" if bad else "ok"}">{e(zoom_headline(z))}</p>']
    rows = [[e(label), e(text)] for label, text in zoom_rows(z)]
    if rows:
        out.append(_table(("", ""), rows))
    ab = [
        [
            e(row.label),
            *(f"<code>{e(x)}</code>" if row.code else _td_num(e(x)) for x in (row.a, row.b)),
        ]
        for row in zoom_ab_rows(z)
    ]
    if ab:
        out.append(
            '<div class="row"><div>' + _table(("", "A (reference)", "B"), ab) + "</div>"
            f'<div class="muted">{e(zoom_error_text(z))}</div></div>'
        )
    for w in z.warnings:
        out.append(f'<p class="warn">warning: {e(w)}</p>')
    return "".join(out)


def _cell(entry: RankEntry | None) -> tuple[str, str, str, CellClass]:
    """(fill, label, description, class) of one grid cell."""
    c = cell(entry)
    label = str(c.digits) if c.digits is not None else ""
    if c.cls is CellClass.EQUAL:
        return EQUAL_COLOUR, "", c.description, c.cls
    if c.cls is CellClass.WITHIN:
        return WITHIN_COLOUR, label, c.description, c.cls
    if c.cls is CellClass.HARD:
        return HARD_COLOUR, "■", c.description, c.cls
    rel = entry.max_rel_err if entry is not None else None
    t = -math.log10(rel) if rel and rel > 0 else 0.0
    return _lerp_colour(t), label, c.description, c.cls


def _diff_grid(d: DiffResult) -> str:
    cs = d.compared_steps
    first, last = cs.first, cs.last
    ranks = d.ranks
    if not ranks:
        return _nr("no common steps to draw")
    per_step = {s: ent.ranks for s, ent in d.step_entries().items()}
    f = d.first_divergence
    steps = grid_steps(d, GRID_MAX_STEPS, lead=10)  # a late divergence: from just before it
    n = len(steps)
    cw = max(6, min(44, 760 // max(n, 1)))
    ch = 28 if len(ranks) <= 16 else max(6, 448 // len(ranks))
    left, top = 56, 22
    W = left + n * cw + 8
    H = top + len(ranks) * ch + 8
    p = [
        f'<svg class="grid" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
        f'aria-label="divergence grid, rank by step">'
    ]
    label_every = 1 if cw >= 22 else 5 if cw >= 8 else 10
    for i, s in enumerate(steps):
        if s % label_every == 0 or i == 0 or s == steps[-1]:
            p.append(
                f'<text x="{left + i * cw + cw / 2}" y="{top - 7}" text-anchor="middle" class="tick">{s}'
                "</text>"
            )
    fcell = None
    for j, rk in enumerate(ranks):
        y = top + j * ch
        if ch >= 10:
            p.append(
                f'<text x="{left - 8}" y="{y + ch / 2 + 4}" text-anchor="end" class="tick">rank {e(rk)}'
                "</text>"
            )
        for i, s in enumerate(steps):
            x = left + i * cw
            fill, lab, desc, cls = _cell((per_step.get(s) or {}).get(rk))
            p.append(
                f'<rect x="{x + 0.5}" y="{y + 0.5}" width="{cw - 1}" height="{ch - 1}" fill="{fill}" '
                f'data-step="{s}" data-rank="{e(rk)}" data-cell="{cls}">'
                f"<title>step {s} rank {e(rk)}: {e(desc)}</title></rect>"
            )
            if lab and cw >= 14 and ch >= 14:
                white = ' style="fill:#fff"' if _dark(fill) else ""
                p.append(
                    f'<text x="{x + cw / 2}" y="{y + ch / 2 + 4}" text-anchor="middle" class="cell"'
                    f"{white}>{e(lab)}</text>"
                )
            if f and s == f.step and rk == f.rank:
                fcell = (x, y)
    if fcell:
        p += _first_marker(*fcell, cw, ch)
    p.append("</svg>")
    shown = (
        ""
        if n >= (cs.count or n)
        else f'<p class="muted small">grid shows steps {steps[0]}..{steps[-1]} of {first}..{last}</p>'
    )
    return '<div class="gridbox">' + "".join(p) + "</div>" + shown + _grid_legend()


def _first_marker(x: float, y: float, cw: float, ch: float) -> list[str]:
    """The frame around the first divergent cell: dark outside, yellow inside, on any fill."""
    return [
        f'<rect x="{x - 0.5}" y="{y - 0.5}" width="{cw + 1}" height="{ch + 1}" fill="none" '
        f'stroke="#111" stroke-width="3"><title>first divergence</title></rect>',
        f'<rect x="{x + 2}" y="{y + 2}" width="{max(cw - 4, 1)}" height="{max(ch - 4, 1)}" fill="none" '
        f'stroke="#ffd400" stroke-width="2"><title>first divergence</title></rect>',
    ]


def _grid_legend() -> str:
    sw = []
    sw.append(
        f'<span class="key"><i style="background:{EQUAL_COLOUR}"></i>{CellClass.EQUAL.legend}</span>'
    )
    sw.append(
        f'<span class="key"><i style="background:{WITHIN_COLOUR}"></i>{CellClass.WITHIN.legend}</span>'
    )
    ramp = "".join(
        f'<i style="background:{_lerp_colour(t)}" title="rel err 1e-{t}"></i>'
        for t in range(9, -1, -1)
    )
    sw.append(f'<span class="key ramp">{CellClass.BEYOND.legend}: rel err 1e-9 {ramp} 1</span>')
    sw.append(
        f'<span class="key"><i style="background:{HARD_COLOUR}"></i>{CellClass.HARD.legend}</span>'
    )
    sw.append(
        '<span class="key"><i style="background:#fff;border:2px solid #111;box-shadow:inset 0 0 0 2px #ffd400">'
        "</i>first divergence</span>"
    )
    return (
        '<div class="legend">'
        + "".join(sw)
        + '</div><p class="muted small">a cell\'s digit: -log10 of its '
        "largest relative error (0 = every digit wrong); hover a cell for its tensors</p>"
    )
