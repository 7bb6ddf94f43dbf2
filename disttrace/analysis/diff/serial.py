"""The one-process diff: every compared step read and folded in this process, in step order (what
`diff_runs` does with jobs=1). Its own module because both the package's `diff_runs` and the parallel driver
(which falls back to it when there is nothing to split) call it, so the driver need not import the package
that imports the driver."""

from __future__ import annotations

from pathlib import Path

from disttrace.analysis.diff.fold import Fold, fold_result
from disttrace.analysis.diff.prepare import Setup
from disttrace.analysis.result import DiffResult


def diff_serial(
    a: str | Path,
    b: str | Path,
    mode: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    allow_edition_mismatch: bool = False,
    *,
    use_index: bool = True,
    propagate: bool = True,
    on_step=None,
    calibration: str | Path | None = None,
    find_calibration: bool = True,
) -> DiffResult:
    """diff_runs(a, b, ...) in this process; the options are diff_runs's, less `jobs`."""
    st = Setup(
        a, b, mode, rtol, atol, allow_edition_mismatch, use_index, calibration, find_calibration
    )
    fold = Fold(st.mode, st.warnings)
    for o in st.outcomes(st.steps, propagate, on_step):
        if fold.add(o) and not propagate:
            break
    return fold_result(
        fold,
        mode=st.mode,
        a=st.side_a.describe(),
        b=st.side_b.describe(),
        topo_differs=[k for k, _, _ in st.topo],
        compared=st.compared,
        ranks=st.grid_ranks,
        tolerance=st.tolerance,
        use_index=use_index,
        warnings=st.warnings,
        logical=st.logical,
    )
