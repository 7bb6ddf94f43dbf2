"""The HTML page of `disttrace report RUN... -o report.html` (disttrace/report.py builds and writes it).

    render_html([ref, fault, recovered], report_facts([ref, fault, recovered]))   # disttrace/report.py

The first run is the reference: every other run comes with its diff against it. The page holds the manifest, the rank
topology, the loss curves of all runs on one plot, the divergence grid (rank x step) of each run against the
reference, the memory ledger against theory, the collective summary, the checkpoint table and the gate
verdict where one was written. It needs nothing else to be read: no network, no external script, style
sheet or font; plots are inline SVG, style is inline CSS, and there is no script at all.

It reads no file: disttrace/report.py's report_facts reads the run store (no torch), this renders what it
gathered. A run that is incomplete, or lacks a file, still gets its page: a missing piece says "not
recorded", a piece that cannot be read says why, and an incomplete run is marked as such wherever it appears. Only a path that is not a run directory at all is bad input.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disttrace.analysis.result import DiffResult, RankEntry
from disttrace.errors import BadInput
from disttrace.fmt import abbrev, fmt_number, ranges, where
from disttrace.store.records import Topology, TopologyRank
from disttrace.views.diffparts import (
    CellClass,
    ab_rows,
    cell,
    error_text,
    tolerance_text,
    zoom_ab_rows,
    zoom_error_text,
    zoom_headline,
    zoom_rows,
)

if TYPE_CHECKING:
    from disttrace.report import ReportFacts, RunEvidence

PALETTE = ("#1f6fd1", "#d1341f", "#1e9e54", "#8e44ad", "#e08a00", "#7f5539", "#0f9aa8", "#c2185b")
DASHES = ("", "9 5", "2 5", "12 4 2 4", "6 3", "1 3")
WIDTHS = (3.2, 2.2, 2.6, 2.0, 2.0, 2.0)
COORD_COLOURS = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
EQUAL_COLOUR = "#cfeedd"
WITHIN_COLOUR = "#ffe680"
HARD_COLOUR = "#4a1486"
NODATA_COLOUR = "#eceff3"
# relative error -> colour: 1e-9 (pale) .. 1 (dark red), on -log10(rel)
REL_STOPS = (
    (0.0, (127, 0, 0)),
    (3.0, (215, 48, 31)),
    (6.0, (252, 141, 89)),
    (9.0, (253, 212, 158)),
)
GRID_MAX_STEPS = 120
LOSS_TABLE_MAX_ROWS = 40
NOT_RECORDED = "not recorded"


# ---------------------------------------------------------------- small helpers


def e(x: Any) -> str:
    """Escape anything for HTML text or an attribute value."""
    return html.escape("" if x is None else str(x), quote=True)


def _nr(what: str = NOT_RECORDED) -> str:
    return f'<p class="nr">{e(what)}</p>'


def _err(what: str, exc: BaseException) -> str:
    return f'<p class="err">{e(what)}: {e(type(exc).__name__)}: {e(exc)}</p>'


def _guard(what: str, fn: Callable[..., str], *args) -> str:
    """One piece of the page: a piece that cannot be read says so and never takes the page down."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a report shows what it can and names what it could not read
        return _err(f"{what} could not be read", exc)


def _or(value: Any, absent: str) -> Any:
    return absent if value is None else value


def _badge(text: str, kind: str) -> str:
    return f'<span class="badge b-{kind}">{e(text)}</span>'


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024
    return str(n)


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """head: plain text (escaped); rows: cells already HTML."""
    h = "".join(f"<th>{e(c)}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in r) + "</tr>"
        for r in rows
    )
    return f'<table class="{e(cls)}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _td_num(x: str, title: str | None = None) -> str:
    t = f' title="{e(title)}"' if title else ""
    return f'<td class="num"{t}>{x}</td>'


def _nice_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], float]:
    span = hi - lo
    if not span > 0:
        return [lo], 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if raw <= step:
            break
    t = math.ceil(lo / step - 1e-9) * step
    out = []
    while t <= hi + step * 1e-9:
        out.append(round(t, 12))
        t += step
    return out, step


def _tick_label(v: float, step: float) -> str:
    decimals = max(
        0,
        -math.floor(math.log10(step))
        + (1 if round(step / 10 ** math.floor(math.log10(step)), 6) == 2.5 else 0),
    )
    return f"{v:.{decimals}f}"


def _lerp_colour(t: float) -> str:
    """-log10(rel err) -> colour along REL_STOPS."""
    t = min(max(t, REL_STOPS[0][0]), REL_STOPS[-1][0])
    for (a, ca), (b, cb) in zip(REL_STOPS, REL_STOPS[1:]):
        if t <= b:
            f = (t - a) / (b - a)
            rgb = tuple(round(x + (y - x) * f) for x, y in zip(ca, cb))
            return "#{:02x}{:02x}{:02x}".format(*rgb)
    return "#{:02x}{:02x}{:02x}".format(*REL_STOPS[-1][1])


# ---------------------------------------------------------------- the runs


class _R:
    """One run as the page sees it."""

    def __init__(self, path: Path, label: str, colour: str, index: int, evidence: RunEvidence):
        self.evidence = evidence
        self.path = path
        self.label = label
        self.colour = colour
        self.index = index
        state = evidence.state
        self.info, self.info_error = state.info, state.info_error
        self.kind = self.info.get("path") or "?"
        self.complete = state.complete

    def status_badge(self) -> str:
        return _badge("complete", "ok") if self.complete else _badge("INCOMPLETE", "warn")

    def name_html(self) -> str:
        return (
            f'<span class="swatch" style="background:{self.colour}"></span><b>{e(self.label)}</b>'
        )

    def tag_html(self) -> str:
        """The name, marked where the run is incomplete."""
        return self.name_html() + ("" if self.complete else " " + self.status_badge())


def _labels(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    out = []
    for i, p in enumerate(paths):
        lab = names[i] if names.count(names[i]) == 1 else f"{p.parent.name}/{p.name}"
        out.append(lab if out.count(lab) == 0 else f"{lab} ({i + 1})")
    return out


# ---------------------------------------------------------------- sections


def _overview(rs: list[_R], diffs: dict[int, Any]) -> str:
    from disttrace.analysis.facts import failure_text

    rows = []
    for r in rs:
        info = r.info
        fault = info.get("fault")
        resume = info.get("resume")
        what = []
        if fault:
            what.append(
                f"fault <code>{e(fault.get('name'))}</code> at step {e(fault.get('step'))} "
                f"rank {e(fault.get('rank'))}"
            )
            fired = r.evidence.state.fault_fired
            if fired is not None:
                what.append(
                    f"fired at step {e(fired.step)} micro-batch {e(fired.micro_batch)} "
                    f"{e(fired.phase)} rank {e(fired.rank)}"
                )
            else:
                what.append('<span class="warn">no fault_fired event recorded</span>')
        if isinstance(resume, dict):
            what.append(
                f"resumed from <code>{e(resume.get('checkpoint'))}</code> (step {e(resume.get('step'))})"
            )
        for f in r.evidence.state.failures:
            what.append(f'<span class="bad">{e(f.get("event"))}: {e(failure_text(f))}</span>')
        if r.info_error:
            what.append(f'<span class="bad">run.json: {e(r.info_error)}</span>')
        if r.index == 0:
            vs = _badge("reference", "na")
        else:
            d = diffs.get(r.index)
            if isinstance(d, DiffResult):
                f = d.first_divergence
                vs = (
                    _badge("equal", "ok")
                    if f is None
                    else _badge(f"diverged at step {f.step}", "bad")
                )
            else:
                vs = _badge("not compared", "na")
        gate = r.evidence.state.verdict
        gate_html = (
            (_badge("gate PASS", "ok") if gate.passed else _badge("gate FAIL", "bad"))
            if gate
            else '<span class="nr">no verdict</span>'
        )
        rows.append(
            [
                r.name_html(),
                f"<code>{e(r.kind)}</code>",
                r.status_badge(),
                vs,
                gate_html,
                "<br>".join(what) or '<span class="nr">-</span>',
                f'<code class="path">{e(r.path)}</code>',
            ]
        )
    return _table(
        ("run", "path", "state", "vs reference", "gate", "what happened", "directory"), rows, "wide"
    )


KEY_SETTINGS = (
    (
        "model",
        ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "max_seq_len"),
    ),
    (
        "parallelism",
        ("world_size", "dp", "tp", "pp", "zero_stage", "architecture", "backend", "pp_schedule"),
    ),
    (
        "training",
        (
            "steps",
            "micro_batch_size",
            "grad_accum_steps",
            "optimizer",
            "lr",
            "dtype",
            "weight_decay",
        ),
    ),
    ("checkpoint", ("interval",)),
    ("debug", ("deterministic", "collective_timeout_s")),
    ("eval", ("batch_size", "max_batches", "loss_rtol")),
)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _manifest(rs: list[_R]) -> str:
    r0 = rs[0]
    m0 = r0.evidence.manifest
    m = m0.doc  # shown as stored, every key
    exp = m.get("experiment") or {}
    data, tok = m.get("data") or {}, m.get("tokenizer") or {}
    head = [
        ("experiment", f"<b>{e(exp.get('name', NOT_RECORDED))}</b>"),
        ("edition", f"<code>{e(exp.get('edition', NOT_RECORDED))}</code>"),
        ("manifest id", f'<code class="path">{e(m0.manifest_id)}</code>'),
        ("description", e(exp.get("description", "-"))),
        ("seed", e(exp.get("seed", NOT_RECORDED))),
        (
            "data",
            f"<code>{e(data.get('path', NOT_RECORDED))}</code> sha256 <code>{e(abbrev(data.get('sha256'), 16))}"
            f"</code> · eval split {e(data.get('eval_percent', '-'))}%",
        ),
        (
            "tokenizer",
            f"{e(tok.get('kind', NOT_RECORDED))} sha256 <code>{e(abbrev(tok.get('sha256'), 16))}</code>",
        ),
        (
            "source",
            f"<code>{e(m0.source)}</code>"
            + (
                " with <code>" + e(" ".join(f"--set {o}" for o in m0.overrides or [])) + "</code>"
                if m0.overrides
                else ""
            ),
        ),
    ]
    out = [
        '<table class="kv">'
        + "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in head)
        + "</table>"
    ]
    cards = []
    for section, keys in KEY_SETTINGS:
        sec = m.get(section)
        if not isinstance(sec, dict):
            continue
        items = "".join(f"<tr><th>{e(k)}</th><td>{e(sec[k])}</td></tr>" for k in keys if k in sec)
        if items:
            cards.append(
                f'<div class="card"><h4>{e(section)}</h4><table class="kv small">{items}</table></div>'
            )
    out.append(f'<div class="cards">{"".join(cards)}</div>')
    # the others: same manifest, or which fields differ
    base = _flatten(m)
    rows = []
    for r in rs[1:]:
        try:
            other = _flatten(r.evidence.manifest.doc)
        except Exception as exc:  # noqa: BLE001
            rows.append([r.name_html(), _err("manifest", exc)])
            continue
        if r.evidence.manifest.manifest_id == m0.manifest_id:
            rows.append([r.name_html(), _badge("same manifest id", "ok")])
            continue
        diff = [k for k in sorted(base.keys() | other.keys()) if base.get(k) != other.get(k)]
        cells = "<br>".join(
            f"<code>{e(k)}</code>: {e(base.get(k, '—'))} → {e(other.get(k, '—'))}"
            for k in diff[:20]
        )
        more = f"<br>… {len(diff) - 20} more" if len(diff) > 20 else ""
        rows.append(
            [
                r.name_html(),
                f"{_badge('other manifest ' + abbrev(r.evidence.manifest.manifest_id), 'warn')}<br>"
                f"{cells or 'ids differ, fields equal'}{more}",
            ]
        )
    if rows:
        out.append("<h3>the other runs</h3>" + _table(("run", "manifest"), rows))
    return "".join(out)


def _topo_key(topo: Topology | None) -> Any:
    if topo is None:
        return None
    return (repr(topo.mesh_shape), repr([(x.rank, x.coords, x.host) for x in topo.ranks]))


def _topology(rs: list[_R]) -> str:
    out, seen = [], {}
    for r in rs:
        topo = r.evidence.topology
        if isinstance(topo, BadInput):
            out.append(f"<h3>{r.name_html()}</h3>" + _err("topology.json", topo))
            continue
        if isinstance(topo, BaseException):
            raise topo  # not a malformed document: the section says it could not be read
        key = _topo_key(topo)
        if key is not None and key in seen:
            out.append(
                f'<p class="muted">{r.name_html()}: same rank topology as {e(seen[key])}.</p>'
            )
            continue
        if key is not None:
            seen[key] = rs[rs.index(r)].label
        out.append(f"<h3>{r.tag_html()}</h3>" + _one_topology(r, topo))
    return "".join(out)


def _one_topology(r: _R, topo: Topology | None) -> str:
    if topo is None or not topo.as_read():  # an empty document holds no topology either
        par = r.evidence.manifest.doc.get("parallelism") or {}
        declared = " ".join(
            f"{k}={par[k]}" for k in ("world_size", "dp", "tp", "pp", "zero_stage") if k in par
        )
        return _nr(f"topology.json not recorded; the manifest declares {declared or 'nothing'}")
    dims = list(topo.mesh_dims or ("pp", "dp", "tp"))
    ranks = sorted(topo.ranks, key=lambda x: x.rank)
    shape = topo.mesh_shape
    rows = []
    for x in ranks:
        c = x.coords
        cells = [
            _td_num(e(x.rank)),
            e(x.host),
            _td_num(e(x.node_rank)),
            _td_num(e(x.local_rank)),
        ]
        for d in dims:
            v = c.get(d)
            col = COORD_COLOURS[v % len(COORD_COLOURS)] if isinstance(v, int) else NODATA_COLOUR
            txt = "#fff" if _dark(col) else "#1c2230"
            cells.append(
                f'<td class="num"><span class="chip" style="background:{col};color:{txt}">{e(v)}</span></td>'
            )
        rows.append(cells)
    table = _table(("rank", "host", "node", "local", *dims), rows)
    grid = _topology_svg(ranks, dims)
    groups = []
    for d, gs in topo.groups.items():
        if shape.get(d, 1) > 1 or d not in shape:
            groups.append(f"<li><b>{e(d)}</b> groups: <code>{e(gs)}</code></li>")
    mesh = " × ".join(f"{d}={shape.get(d, '?')}" for d in dims)
    return (
        f"<p>world size <b>{e(topo.world_size or len(ranks))}</b> · mesh {e(mesh)}</p>"
        f'<div class="row"><div>{table}</div><div>{grid}</div></div>'
        + (f"<ul>{''.join(groups)}</ul>" if groups else "")
    )


def _topology_svg(ranks: list[TopologyRank], dims: list[str]) -> str:
    """Rows: mesh dimensions; columns: ranks; a cell's colour and number: the rank's coordinate."""
    if not ranks:
        return _nr("no ranks recorded")
    n = len(ranks)
    cw = max(14, min(40, 640 // max(n, 1)))
    ch, left, top = 26, 40, 20
    w, h = left + n * cw + 4, top + len(dims) * ch + 4
    parts = [
        f'<svg class="topo" width="{w}" height="{h}" viewBox="0 0 {w} {h}" role="img" '
        f'aria-label="rank topology grid">'
    ]
    for i, x in enumerate(ranks):
        if cw >= 18 or i % 4 == 0:
            parts.append(
                f'<text x="{left + i * cw + cw / 2}" y="{top - 6}" text-anchor="middle" class="tick">'
                f"{e(x.rank)}</text>"
            )
    for j, d in enumerate(dims):
        y = top + j * ch
        parts.append(
            f'<text x="{left - 6}" y="{y + ch / 2 + 4}" text-anchor="end" class="axis">{e(d)}</text>'
        )
        for i, x in enumerate(ranks):
            v = x.coords.get(d)
            col = COORD_COLOURS[v % len(COORD_COLOURS)] if isinstance(v, int) else NODATA_COLOUR
            parts.append(
                f'<rect x="{left + i * cw + 1}" y="{y + 1}" width="{cw - 2}" height="{ch - 2}" rx="3" '
                f'fill="{col}"><title>rank {e(x.rank)}: {e(d)}={e(v)}</title></rect>'
            )
            if cw >= 16:
                white = ' style="fill:#fff"' if _dark(col) else ""
                parts.append(
                    f'<text x="{left + i * cw + cw / 2}" y="{y + ch / 2 + 4}" text-anchor="middle" '
                    f'class="cell"{white}>{e(v)}</text>'
                )
    parts.append("</svg>")
    return (
        "".join(parts)
        + '<p class="muted small">columns: ranks · rows: mesh dimension · colour: coordinate</p>'
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
    # legend, below the plot: it never covers a curve
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
    p.append("</svg>")
    return '<div class="plotbox">' + "".join(p) + "</div>"


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
        msg = f"{d.divergent_steps} divergent step(s) from step {f.step}"
        if d.recovered_steps:
            msg += f"; equal again at step(s) {ranges(d.recovered_steps)}"
        out.append(f'<p class="muted">{e(msg)}</p>')
    out.append(_diff_grid(d))
    prop = d.propagation
    if prop:
        rows = []
        for ent in prop[:20]:
            ranks = ent.ranks
            rk = [str(k) for k, v in ranks.items() if v.differing]
            tot = sum(v.total for v in ranks.values())
            rels = [v.max_rel_err for v in ranks.values() if v.max_rel_err is not None]
            phases = sorted({p for v in ranks.values() for p in v.max_rel_err_by_phase})
            rows.append(
                [
                    _td_num(e(ent.step)),
                    e(", ".join(rk) or "-"),
                    _td_num(f"{e(ent.differing)} / {tot}"),
                    _td_num(e(fmt_number(max(rels), ".2e") if rels else "-")),
                    e(", ".join(phases) or "-"),
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
    start = first
    if (
        f and f.step - first > GRID_MAX_STEPS - 20
    ):  # a late divergence: start the grid just before it
        start = max(first, f.step - 10)
    steps = list(range(start, min(last, start + GRID_MAX_STEPS - 1) + 1))
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
        x, y = fcell
        p.append(
            f'<rect x="{x - 0.5}" y="{y - 0.5}" width="{cw + 1}" height="{ch + 1}" fill="none" '
            f'stroke="#111" stroke-width="3"><title>first divergence</title></rect>'
        )
        p.append(
            f'<rect x="{x + 2}" y="{y + 2}" width="{max(cw - 4, 1)}" height="{max(ch - 4, 1)}" fill="none" '
            f'stroke="#ffd400" stroke-width="2"><title>first divergence</title></rect>'
        )
    p.append("</svg>")
    shown = (
        ""
        if n >= (cs.count or n)
        else f'<p class="muted small">grid shows steps {steps[0]}..{steps[-1]} of {first}..{last}</p>'
    )
    return '<div class="gridbox">' + "".join(p) + "</div>" + shown + _grid_legend()


def _dark(fill: str) -> bool:
    """White text on this fill? (relative luminance of a #rrggbb colour)"""
    try:
        r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    except ValueError:
        return False
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5


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


def _memory(rs: list[_R]) -> str:
    rows, notes, footnotes = [], [], []
    for r in rs:
        mem = r.evidence.memory
        if isinstance(mem, BaseException):
            notes.append(_err(f"{r.label}: memory ledger", mem))
            continue
        recs, torn = mem.last, mem.torn
        notes += [f'<p class="warn">{e(r.label)}: {e(t)}</p>' for t in torn]
        if not recs:
            rows.append(
                [r.tag_html(), f'<td colspan="9" class="nr">memory ledger {NOT_RECORDED}</td>']
            )
            continue
        for rec in recs:
            pred = rec.get("predicted") if isinstance(rec.get("predicted"), dict) else {}
            ratio = rec.get("ratio_model_state")
            if isinstance(ratio, (int, float)):
                kind = (
                    "ok" if abs(ratio - 1) <= 0.05 else "warn" if abs(ratio - 1) <= 0.25 else "bad"
                )
                ratio_html = _badge(f"{ratio:.4f}", kind)
            else:
                ratio_html = '<span class="nr">-</span>'
            gap = [str(g) for g in rec.get("gap") or []]
            marks = []
            for g in gap:
                if g not in footnotes:
                    footnotes.append(g)
                marks.append(f'<sup class="fn">[{footnotes.index(g) + 1}]</sup>')
            rows.append(
                [
                    r.tag_html(),
                    _td_num(e(rec.get("rank"))),
                    _td_num(e(rec.get("step"))),
                    _td_num(
                        e(_bytes(rec.get("params"))),
                        f"{rec.get('params')} B · predicted {pred.get('params')} B",
                    ),
                    _td_num(
                        e(_bytes(rec.get("grads"))),
                        f"{rec.get('grads')} B · predicted {pred.get('grads')} B",
                    ),
                    _td_num(
                        e(_bytes(rec.get("optimizer"))),
                        f"{rec.get('optimizer')} B · predicted {pred.get('optimizer')} B",
                    ),
                    _td_num(
                        f"<b>{e(_bytes(rec.get('model_state')))}</b> / {e(_bytes(pred.get('total')))}",
                        f"{rec.get('model_state')} B measured / {pred.get('total')} B predicted",
                    ),
                    f'<td class="num">{ratio_html}</td>',
                    _td_num(e(_bytes(rec.get("activations_saved")))),
                    " ".join(marks) or '<span class="muted">none</span>',
                ]
            )
    if not rows:
        return "".join(notes) or _nr("memory ledger not recorded in any run")
    head = (
        "run",
        "rank",
        "step",
        "params",
        "grads",
        "optimizer",
        "model state: measured / predicted",
        "ratio",
        "activations saved",
        "gap notes",
    )
    fn = "".join(f"<li>{e(g)}</li>" for g in footnotes)
    return (
        _table(head, rows, "wide")
        + (f'<ol class="footnotes">{fn}</ol>' if fn else "")
        + '<p class="muted small">last recorded step per rank; predicted: the ZeRO formula for this strategy '
        "(disttrace.plan.costs); ratio = measured / predicted model state. Hover a figure for exact bytes.</p>"
        + "".join(notes)
    )


def _collectives(rs: list[_R]) -> str:
    rows, notes = [], []
    for r in rs:
        name = r.tag_html()
        res = r.evidence.sync
        if res is None:
            rows.append([name, f'<td colspan="4" class="nr">collective trace {NOT_RECORDED}</td>'])
            continue
        if isinstance(res, BaseException):
            rows.append([name, f'<td colspan="4">{_err("collective trace", res)}</td>'])
            continue
        groups = list(res.groups.items())
        if res.first_mismatch is None:
            status = _badge("in sync", "ok")
        else:
            msg = res.first_mismatch.message
            status = _badge("DESYNC", "bad") + f'<div class="bad small">{e(msg)}</div>'
        if not groups:
            rows.append([name, '<td colspan="3" class="nr">no process group recorded</td>', status])
        for k, (g, v) in enumerate(groups):
            rows.append(
                [
                    name if k == 0 else "",
                    f"<code>{e(g)}</code>",
                    _td_num(e(v.ops)),
                    _td_num(e(_bytes(v.bytes)), f"{v.bytes} B"),
                    status if k == 0 else "",
                ]
            )
        unfinished = res.unfinished
        if unfinished:
            u = unfinished[0]
            notes.append(
                f'<p class="warn">{e(r.label)}: {len(unfinished)} collective(s) issued but never finished, '
                f"first: rank {e(u.rank)} group {e(u.group)} seq {e(u.seq)} {e(u.op)}</p>"
            )
        for w in res.warnings:
            notes.append(f'<p class="warn">{e(r.label)}: {e(w)}</p>')
        for st in r.evidence.stragglers[:3]:
            notes.append(
                f'<p class="warn">{e(r.label)}: straggler: rank {e(st.rank)} at step {e(st.step)} '
                f"took {e(st.seconds)} s to reach its collective (others {e(st.others_median)} s)"
                "</p>"
            )
    head = ("run", "process group (ranks)", "ops", "bytes (first member)", "sync")
    return (
        _table(head, rows)
        + '<p class="muted small">every member of a group must issue the same sequence of '
        "(op, shapes, dtype); the first disagreement is named</p>" + "".join(notes)
    )


def _checkpoints(rs: list[_R]) -> str:
    rows = []
    for r in rs:
        name = r.tag_html()
        if isinstance(r.evidence.checkpoints, BaseException):
            rows.append(
                [name, f'<td colspan="4">{_err("checkpoints", r.evidence.checkpoints)}</td>']
            )
            continue
        cks = r.evidence.checkpoints.checkpoints
        resume = r.info.get("resume") if isinstance(r.info.get("resume"), dict) else None
        if resume:
            name += f'<div class="muted small">resumed from <code>{e(resume.get("checkpoint"))}</code></div>'
        if not cks:
            rows.append([name, f'<td colspan="4" class="nr">checkpoints {NOT_RECORDED}</td>'])
            continue
        for k, c in enumerate(cks):
            ok = c.verified
            rows.append(
                [
                    name if k == 0 else "",
                    f"<code>{e(c.checkpoint)}</code>",
                    _td_num(e(c.step if c.step is not None else "-")),
                    _badge("verified", "ok") if ok else _badge("BAD", "bad"),
                    e(c.detail) if ok else f'<span class="bad">{e(c.detail)}</span>',
                ]
            )
    return (
        _table(("run", "checkpoint", "step", "sha256", "detail"), rows)
        + '<p class="muted small">every file of every checkpoint is read and hashed against its INDEX.json</p>'
    )


def _gate(rs: list[_R]) -> str:
    out = []
    for r in rs:
        if not r.evidence.state.has_verdict:
            continue
        v = r.evidence.state.verdict
        out.append(f"<h3>{r.tag_html()} ")
        if v is None:
            out.append(f"</h3>{_nr('verdict.json could not be read')}")
            continue
        out.append((_badge("PASS", "ok") if v.passed else _badge("FAIL", "bad")) + "</h3>")
        if v.reference:
            out.append(f'<p class="muted">against reference <code>{e(v.reference)}</code></p>')
        else:
            out.append('<p class="muted">no reference given</p>')
        rows = []
        for c in v.checks:
            res = {True: _badge("pass", "ok"), False: _badge("FAIL", "bad")}.get(
                c.passed, _badge("n/a", "na")
            )
            rows.append([f"<code>{e(c.name)}</code>", res, e(c.reason)])
        out.append(_table(("check", "result", "reason"), rows))
        for fl in v.flags:
            out.append(f'<p class="warn">flag: {e(fl)}</p>')
        ev = v.eval  # the evaluator's document, as it wrote it
        if isinstance(ev, dict) and "eval_loss" in ev:
            out.append(
                f'<p class="muted">evaluation ({e(ev.get("process", "?"))}): eval loss '
                f"{e(fmt_number(ev.get('eval_loss'), '.6f'))}, token accuracy "
                f"{e(fmt_number(ev.get('token_accuracy'), '.4f'))}"
                f" on {e(ev.get('tokens'))} tokens of checkpoint {e(ev.get('checkpoint'))}</p>"
            )
    if not out:
        return _nr(
            "no gate verdict recorded (run `disttrace gate RUN --reference REF` to write one)"
        )
    return "".join(out)


# ---------------------------------------------------------------- the page

CSS = """
:root{--fg:#1c2230;--muted:#5d6676;--line:#e2e6ee;--bg:#f3f5f9;--card:#fff;--ok:#17753a;--bad:#c0281f;
--warn:#9a5a00}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:14px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif}
header{background:#1c2230;color:#fff;padding:22px 36px 18px}
header h1{margin:0;font-size:22px;font-weight:650;letter-spacing:.2px}
header .sub{color:#b8c0d0;margin-top:4px;font-size:13px}
header .sub code{color:#dfe5f0}
nav{background:#262e3f;padding:7px 36px;font-size:13px}
nav a{color:#cdd6e6;text-decoration:none;margin-right:18px}
nav a:hover{color:#fff;text-decoration:underline}
main{max-width:1240px;margin:0 auto;padding:8px 28px 48px}
section{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:16px 22px 18px;
margin:18px 0;box-shadow:0 1px 2px rgba(20,30,50,.05);overflow-x:auto}
h2{font-size:17px;margin:0 0 12px;padding-bottom:8px;border-bottom:1px solid var(--line)}
h3{font-size:14.5px;margin:18px 0 8px}
h4{font-size:12px;margin:0 0 4px;text-transform:uppercase;letter-spacing:.6px;color:var(--muted)}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
table.wide{width:100%}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid var(--line);vertical-align:top}
thead th{font-weight:600;color:var(--muted);background:#f7f8fb;border-bottom:1px solid #d6dbe4;white-space:nowrap}
table.kv th{color:var(--muted);font-weight:500;white-space:nowrap;width:1%}
table.small td,table.small th{padding:2px 8px;border:none}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,"Liberation Mono",monospace;font-size:12.5px}
code.path{word-break:break-all;color:#44506a}
.badge{display:inline-block;padding:1px 9px;border-radius:999px;font-size:12px;font-weight:600;white-space:nowrap}
.b-ok{background:#dcf3e3;color:var(--ok)}.b-bad{background:#fde1df;color:var(--bad)}
.b-warn{background:#fff0d1;color:var(--warn)}.b-na{background:#eaedf2;color:var(--muted)}
.swatch{display:inline-block;width:11px;height:11px;border-radius:3px;margin-right:6px;vertical-align:-1px}
.chip{display:inline-block;min-width:22px;padding:0 6px;border-radius:4px;color:#fff;text-align:center;
font-weight:600}
.nr{color:var(--muted);font-style:italic}
.err{color:var(--bad)}
.warn{color:var(--warn)}
.bad{color:var(--bad)}
.muted{color:var(--muted)}
.small{font-size:12px}
.verdict{font-weight:650;font-size:14.5px;margin:8px 0;padding:7px 12px;border-radius:6px;display:inline-block}
.verdict.ok{background:#e5f6ea;color:var(--ok)}
.verdict.bad{background:#fde8e6;color:var(--bad)}
.banner{background:#fff4dc;border:1px solid #f0cf87;color:#6b4500;border-radius:8px;padding:10px 14px;margin:16px 0 0}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-top:12px}
.card{border:1px solid var(--line);border-radius:8px;padding:8px 10px;background:#fbfcfe;min-width:190px}
.row{display:flex;flex-wrap:wrap;gap:28px;align-items:flex-start}
.diffblock{border-top:1px dashed var(--line);margin-top:10px;padding-top:2px}
h2+.diffblock{border-top:none;margin-top:0}
svg text{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Arial,sans-serif}
svg .tick{font-size:11px;fill:#5d6676}
svg .axis{font-size:12px;fill:#3a4356;font-weight:600}
svg .legend{font-size:12.5px;fill:#1c2230}
svg .cell{font-size:11px;fill:#1c2230;font-weight:600}
svg .gridline{stroke:#e6e9f0;stroke-width:1}
.legend{display:flex;flex-wrap:wrap;gap:16px;font-size:12px;color:var(--muted);margin:6px 0 0}
.legend .key{display:inline-flex;align-items:center;gap:5px}
.legend i{display:inline-block;width:14px;height:12px;border-radius:2px;border:1px solid rgba(0,0,0,.08)}
.legend .ramp i{width:9px;border-radius:0;margin:0 -3px 0 0}
.delta{font-size:11px;margin-left:4px;padding:0 4px;border-radius:3px}
.delta.eq{color:var(--ok);background:#ecf8f0}.delta.ne{color:var(--bad);background:#fdeeee}
details{margin-top:8px}
summary{cursor:pointer;color:#34405a;font-size:13px}
tbody td:first-child{white-space:nowrap}
sup.fn{color:#34405a;font-weight:600;margin-right:2px}
ol.footnotes{font-size:12.5px;color:#34405a;margin:8px 0 0;padding-left:22px}
.losssum{font-size:13px;margin:4px 0 0}
footer{color:var(--muted);font-size:12px;text-align:center;padding:10px}
"""

SECTIONS = (
    ("runs", "Runs"),
    ("manifest", "Manifest"),
    ("topology", "Rank topology"),
    ("loss", "Loss curves"),
    ("divergence", "Divergence"),
    ("memory", "Memory ledger"),
    ("collectives", "Collectives"),
    ("checkpoints", "Checkpoints"),
    ("gate", "Gate verdict"),
)


def render_html(run_dirs: list[Path | str], facts: ReportFacts) -> str:
    """The report page as a string (disttrace/report.py gathers `facts` and writes it). facts.diffs[i]: run i
    against the first run, or why it could not be compared; facts.evidence[i]: what analysis found of run i;
    facts.zooms[i]: its zoom into the first divergent step (analysis/zoom.py's ZoomResult, or why it could
    not be read), where `disttrace zoom` recorded both sides at depth."""
    if not run_dirs:
        raise BadInput("RUN", "give at least one run directory (the first is the reference)")
    paths = [Path(p) for p in run_dirs]  # report_facts already read each as a run directory
    labels = _labels(paths)
    rs = [
        _R(p, labels[i], PALETTE[i % len(PALETTE)], i, facts.evidence[i])
        for i, p in enumerate(paths)
    ]
    diffs = facts.diffs

    body = {
        "runs": _guard("the run list", _overview, rs, diffs),
        "manifest": _guard("the manifest", _manifest, rs),
        "topology": _guard("the topology", _topology, rs),
        "loss": _guard("the losses", _loss, rs),
        "divergence": _guard("the divergence", _divergence, rs, diffs, facts.zooms),
        "memory": _guard("the memory ledger", _memory, rs),
        "collectives": _guard("the collective trace", _collectives, rs),
        "checkpoints": _guard("the checkpoints", _checkpoints, rs),
        "gate": _guard("the gate verdict", _gate, rs),
    }
    incomplete = [r for r in rs if not r.complete]
    banner = ""
    if incomplete:
        banner = (
            '<div class="banner"><b>Incomplete run(s):</b> '
            + ", ".join(f"{e(r.label)} (<code>{e(r.path)}</code>)" for r in incomplete)
            + " have no COMPLETE marker: the job did not finish, and what they hold stops where it stopped.</div>"
        )
    exp = rs[0].evidence.manifest.experiment
    title = (
        "?" if isinstance(exp, BaseException) else f"{_or(exp.name, '?')} ({_or(exp.edition, '?')})"
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())
    nav = "".join(f'<a href="#{k}">{e(t)}</a>' for k, t in SECTIONS)
    sections = "".join(f'<section id="{k}"><h2>{e(t)}</h2>{body[k]}</section>' for k, t in SECTIONS)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>disttrace report: {e(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>disttrace report · {e(title)}</h1>"
        f'<div class="sub">{len(rs)} run(s) · reference <code>{e(rs[0].label)}</code> · manifest '
        f"<code>{e(abbrev(rs[0].evidence.manifest.manifest_id, 12))}</code> · generated {e(stamp)}</div></header>"
        f"<nav>{nav}</nav><main>{banner}{sections}</main>"
        "<footer>disttrace: did this distributed run compute the same thing as the reference, and if not, where "
        "did it first go wrong? Read from the run store only.</footer></body></html>\n"
    )


# the page is inert whatever a run store holds: it writes no script, so none may run; nothing is fetched
# (inline styles only: the page colours cells with style attributes; CSS cannot load anything under this)
CSP = (
    "default-src 'none'; script-src 'none'; object-src 'none'; style-src 'unsafe-inline'; img-src data:; "
    "font-src 'none'; connect-src 'none'; base-uri 'none'; form-action 'none'"
)
