"""The page itself: its style sheet, its sections in order, and its content security policy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from disttrace.errors import BadInput
from disttrace.fmt import abbrev

if TYPE_CHECKING:
    from disttrace.report import ReportFacts
from disttrace.views.report.divergence import _divergence
from disttrace.views.report.evidence import _checkpoints, _collectives, _gate, _memory
from disttrace.views.report.loss import _loss
from disttrace.views.report.parts import _R, PALETTE, _guard, _labels, _or, e
from disttrace.views.report.runs import _manifest, _overview, _topology

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
