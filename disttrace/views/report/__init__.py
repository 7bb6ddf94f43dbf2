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

The page is one module a section: `runs` (the runs, manifests, topology), `loss`, `divergence`,
`evidence` (memory, collectives, checkpoints, gate), on `parts` (escaping, tables, colours, ticks) and put
together by `page`.
"""

from disttrace.views.report.page import CSP, render_html

__all__ = ["CSP", "render_html"]
