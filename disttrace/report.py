"""`disttrace report`: diff every run against the first and gather what the page shows of each run
(analysis), render the page (views/report/), write it atomically.

    build_report([ref, fault, recovered], Path("report.html"))

Reads the run store only (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.facts import CheckpointFacts, checkpoints, memory_lines
from disttrace.analysis.result import DiffResult
from disttrace.analysis.sync import Straggler, SyncResult, check_sync, find_stragglers
from disttrace.analysis.zoom import ZoomResult
from disttrace.errors import BadInput
from disttrace.store.documents import MemoryLine, RunInfo, Topology, Verdict
from disttrace.store.events import EventLine, FaultEvent
from disttrace.store.manifest import ExperimentView
from disttrace.store.records import FAILURE_EVENTS
from disttrace.store.rundir import Run
from disttrace.views.report import render_html


@dataclass
class RunEvidence:
    """What the page shows of one run, read from its store here so that the page reads nothing; a part
    that could not be read or computed holds why (the page names it and goes on)."""

    state: RunState
    manifest: ManifestFacts
    # topology.json; None when the run wrote none; why not, where it could not be read (BadInput: the page
    # names it under the run; anything else: the whole section could not be read)
    topology: Topology | BaseException | None
    losses: dict[int, float] | BaseException  # mean loss per step
    memory: MemoryFacts | BaseException
    sync: SyncResult | BaseException | None  # None: no collective trace recorded
    checkpoints: CheckpointFacts | BaseException
    stragglers: list[Straggler] = field(default_factory=list)  # a flag: unreadable timing is none


@dataclass
class MemoryFacts:
    """The memory ledger's last recorded step of each rank, by rank (a line of memory/rank-N.jsonl), and the
    torn tails."""

    last: list[MemoryLine]
    torn: list[str]


@dataclass
class ManifestFacts:
    """The run's manifest lock: the manifest as stored (a free-form mapping: the page shows every key and
    compares runs field by field), its id, and what it was frozen from."""

    doc: dict[str, Any]
    manifest_id: str
    source: str | None  # the lock's `source`, "-" when it names none
    overrides: list[str] | None  # the `--set` overrides it was frozen with
    experiment: (
        ExperimentView | BaseException
    )  # typed; why not, where the manifest does not validate


def manifest_facts(run: Run) -> ManifestFacts:
    lock = run.lock_info
    return ManifestFacts(
        doc=run.manifest_doc,
        manifest_id=run.manifest_id,
        source=lock.source if "source" in lock.model_fields_set else "-",
        overrides=lock.overrides,
        experiment=_attempt(lambda r: r.manifest.experiment, run),
    )


@dataclass
class RunState:
    """What the store says happened to one run: run.json, its COMPLETE marker, its events, the gate's verdict."""

    complete: bool
    # run.json; an empty one when absent or unreadable
    info: RunInfo = field(default_factory=RunInfo)
    info_error: str | None = None  # why run.json could not be read
    fault_fired: FaultEvent | None = (
        None  # the first `fault_fired` event; None also when unreadable
    )
    failures: list[EventLine] = field(default_factory=list)  # the first three failure events
    has_verdict: bool = False  # verdict.json is present (whether or not it reads as one)
    verdict: Verdict | None = None  # None when absent or malformed: a malformed one is never shown


def run_state(run: Run) -> RunState:
    try:
        info, info_error = run.run_info, None
    except BadInput as exc:
        info, info_error = RunInfo(), str(exc)
    state = RunState(complete=run.complete, info=info, info_error=info_error)
    try:
        events = run.event_lines()
        fired = [ev for ev in events if isinstance(ev, FaultEvent)]
        state.fault_fired = fired[0] if fired else None
        state.failures = [ev for ev in events if ev.event in FAILURE_EVENTS][:3]
    except BadInput:
        pass
    state.has_verdict = (run.path / "verdict.json").exists()
    try:
        state.verdict = run.verdict()
    except BadInput:
        pass
    return state


@dataclass
class ReportFacts:
    """Everything the page shows that analysis computes, run by run (the first is the reference)."""

    diffs: dict[int, DiffResult | BaseException]  # run i against the first, i >= 1
    evidence: list[RunEvidence]  # by the runs' positions
    # run i's zoom into its first divergent step, where `disttrace zoom` already recorded both sides at depth
    zooms: dict[int, ZoomResult | BaseException] = field(default_factory=dict)


def diffs_against_first(run_dirs: list[Path]) -> dict[int, DiffResult | BaseException]:
    """Run i against run 0, for i >= 1; a pair that cannot be compared keeps its reason, shown on the page."""
    out: dict[int, DiffResult | BaseException] = {}
    for i, run_dir in enumerate(run_dirs[1:], 1):
        try:
            out[i] = diff_runs(run_dirs[0], run_dir)
        except Exception as exc:  # noqa: BLE001 - incompatible runs are shown as such, not fatal to the page
            out[i] = exc
    return out


def _attempt(fn: Callable[[Run], Any], run: Run) -> Any:
    try:
        return fn(run)
    except Exception as exc:  # noqa: BLE001 - a report shows what it can and names what it could not read
        return exc


def _sync(run: Run) -> SyncResult | None:
    return check_sync(run) if run.ranks("collectives") else None


def _losses(run: Run) -> dict[int, float]:
    return {int(k): float(v) for k, v in run.losses().items()}


def _memory(run: Run) -> MemoryFacts:
    last: dict[int, MemoryLine] = {}
    torn: list[str] = []
    for rank in run.ranks("memory"):
        for rec in memory_lines(run, rank, torn):
            if rank not in last or rec.step >= last[rank].step:
                last[rank] = rec
    return MemoryFacts(last=[last[k] for k in sorted(last)], torn=torn)


def evidence(run: Run) -> RunEvidence:
    """One run's collective sync, checkpoints and stragglers (only where a trace was recorded)."""
    sync = _attempt(_sync, run)
    stragglers = []
    if isinstance(sync, SyncResult):
        found = _attempt(find_stragglers, run)
        stragglers = found if isinstance(found, list) else []
    return RunEvidence(
        sync=sync,
        checkpoints=_attempt(checkpoints, run),
        stragglers=stragglers,
        state=run_state(run),
        manifest=manifest_facts(run),
        topology=_attempt(lambda r: r.topology(), run),
        losses=_attempt(_losses, run),
        memory=_attempt(_memory, run),
    )


def report_facts(
    run_dirs: list[Path | str], diffs: dict[int, DiffResult | BaseException] | None = None
) -> ReportFacts:
    """The facts of the page of `run_dirs`: `diffs` if given (run i against the first), else computed."""
    paths = [Path(p) for p in run_dirs]
    diffs = diffs_against_first(paths) if diffs is None else diffs
    return ReportFacts(
        diffs=diffs, evidence=[evidence(Run(p)) for p in paths], zooms=zooms_of(paths, diffs)
    )


def zooms_of(
    run_dirs: list[Path], diffs: dict[int, DiffResult | BaseException]
) -> dict[int, ZoomResult | BaseException]:
    """Run i's zoom into its first divergent step, where `disttrace zoom` already recorded both sides at depth
    (nothing is launched here: lab/zoom.py's stored_zoom reads the depth runs it finds)."""
    from disttrace.lab.zoom import stored_zoom

    out: dict[int, ZoomResult | BaseException] = {}
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
    page = render_html(run_dirs, report_facts(run_dirs))
    from disttrace.store.writers import write_atomic

    output = Path(output)
    write_atomic(output, page.encode("utf-8"))  # follows no link, replaces only a regular file
    return output
