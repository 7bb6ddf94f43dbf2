"""`disttrace report`: diff every run against the first (analysis), render the page (views/report.py), write
it atomically.

    build_report([ref, fault, recovered], Path("report.html"))

Reads the run store only (no torch).
"""

from __future__ import annotations

from pathlib import Path

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.result import DiffResult
from disttrace.errors import BadInput
from disttrace.store.rundir import Run
from disttrace.views.report import render_html


def diffs_against_first(run_dirs: list[Path]) -> dict[int, DiffResult | BaseException]:
    """Run i against run 0, for i >= 1; a pair that cannot be compared keeps its reason, shown on the page."""
    out: dict[int, DiffResult | BaseException] = {}
    for i, run_dir in enumerate(run_dirs[1:], 1):
        try:
            out[i] = diff_runs(run_dirs[0], run_dir)
        except Exception as exc:  # noqa: BLE001 - incompatible runs are shown as such, not fatal to the page
            out[i] = exc
    return out


def zooms_of(run_dirs: list[Path], diffs: dict) -> dict:
    """Run i's zoom into its first divergent step, where `disttrace zoom` already recorded both sides at depth
    (nothing is launched here: lab/zoom.py's stored_zoom reads the depth runs it finds)."""
    from disttrace.lab.zoom import stored_zoom

    out: dict = {}
    for i, d in diffs.items():
        if isinstance(d, DiffResult) and d.first_divergence is not None:
            try:
                z = stored_zoom(d, run_dirs[0], run_dirs[i])
            except Exception as exc:  # noqa: BLE001 - shown on the page as not zoomed, with why
                z = exc
            if z is not None:
                out[i] = z
    return out


def build_report(run_dirs: list[Path], output: Path) -> Path:
    """Write the report of `run_dirs` (the first is the reference) to `output`, atomically; return its path."""
    if not run_dirs:
        raise BadInput("RUN", "give at least one run directory (the first is the reference)")
    for (
        p
    ) in run_dirs:  # a path that is not a run directory is bad input, before anything is computed
        Run(p)
    diffs = diffs_against_first([Path(p) for p in run_dirs])
    page = render_html(run_dirs, diffs, zooms_of(run_dirs, diffs))
    from disttrace.store.rundir import write_atomic

    output = Path(output)
    write_atomic(output, page.encode("utf-8"))  # follows no link, replaces only a regular file
    return output
