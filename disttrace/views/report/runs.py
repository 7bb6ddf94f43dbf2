"""The runs, their manifests and their rank topology: the page's first three sections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disttrace.analysis.result import DiffResult
from disttrace.errors import BadInput
from disttrace.fmt import abbrev
from disttrace.store.documents import Topology, TopologyRank

if TYPE_CHECKING:
    pass
from disttrace.views.report.parts import (
    _R,
    COORD_COLOURS,
    NODATA_COLOUR,
    NOT_RECORDED,
    _badge,
    _dark,
    _err,
    _nr,
    _table,
    _td_num,
    e,
)


def _overview(rs: list[_R], diffs: dict[int, Any]) -> str:
    rows = []
    for r in rs:
        what = _what_happened(r)
        vs = _vs_reference(r, diffs)
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


def _what_happened(r: _R) -> list[str]:
    """A run's fault and whether it fired, where it resumed from, how it failed (HTML pieces)."""
    from disttrace.analysis.facts import failure_text

    info = r.info
    fault, resume = info.fault, info.resume
    what = []
    if fault is not None:
        what.append(
            f"fault <code>{e(fault.name)}</code> at step {e(fault.step)} rank {e(fault.rank)}"
        )
        fired = r.evidence.state.fault_fired
        if fired is not None:
            what.append(
                f"fired at step {e(fired.step)} micro-batch {e(fired.micro_batch)} "
                f"{e(fired.phase)} rank {e(fired.rank)}"
            )
        else:
            what.append('<span class="warn">no fault_fired event recorded</span>')
    if resume is not None:
        what.append(f"resumed from <code>{e(resume.checkpoint)}</code> (step {e(resume.step)})")
    for f in r.evidence.state.failures:
        what.append(f'<span class="bad">{e(f.event)}: {e(failure_text(f))}</span>')
    if r.info_error:
        what.append(f'<span class="bad">run.json: {e(r.info_error)}</span>')
    return what


def _vs_reference(r: _R, diffs: dict[int, Any]) -> str:
    """The badge of a run against the reference: equal, where it diverged, or not compared."""
    if r.index == 0:
        vs = _badge("reference", "na")
    else:
        d = diffs.get(r.index)
        if isinstance(d, DiffResult):
            f = d.first_divergence
            vs = _badge("equal", "ok") if f is None else _badge(f"diverged at step {f.step}", "bad")
        else:
            vs = _badge("not compared", "na")
    return vs


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
    head = _manifest_head(m0, m)
    out = [
        '<table class="kv">'
        + "".join(f"<tr><th>{e(k)}</th><td>{v}</td></tr>" for k, v in head)
        + "</table>"
    ]
    out.append(_manifest_cards(m))
    rows = _manifest_others(rs, m0, m)
    if rows:
        out.append("<h3>the other runs</h3>" + _table(("run", "manifest"), rows))
    return "".join(out)


def _manifest_head(m0, m: dict) -> list[tuple[str, str]]:
    """(label, HTML) of the reference's experiment, data, tokenizer and where its manifest came from."""
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
    return head


def _manifest_cards(m: dict) -> str:
    """The key settings of each section, one card a section."""
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
    return f'<div class="cards">{"".join(cards)}</div>'


def _manifest_others(rs: list[_R], m0, m: dict) -> list[list[str]]:
    """The other runs: the same manifest, or which fields differ."""
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
    return rows


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
