"""What a run holds, as `disttrace show` reports it: the facts are gathered here, from the run store only;
views/show.py renders them. Each `*Facts` prints its `show --json` document with `to_json()`.

The store's lines come as the models its readers validate them with (store/documents.py, store/events.py:
run.json's `FaultSpec` and `ResumeSpec`, each event's `EventLine`, the memory ledger's `MemoryLine`); a
document echoes them as the store holds them (`as_stored()`: every key, in the file's order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from disttrace.analysis.sync import (
    Straggler,
    SyncResult,
    WireVolume,
    check_sync,
    find_stragglers,
    predicted_dp_volume,
    wire_volume,
)
from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc, as_stored, omit_none
from disttrace.store import checkpoints as checkpoint
from disttrace.store.documents import FaultSpec, MemoryLine, ResumeSpec, Topology
from disttrace.store.events import EventLine, FaultEvent, LiveCheckFailed
from disttrace.store.manifest import ParallelismView
from disttrace.store.records import FAILURE_EVENTS
from disttrace.store.rundir import Run

VIEWS = ("summary", "checkpoints", "topology", "collectives", "memory", "events", "records")


@dataclass
class RankCounts(JsonDoc):
    steps: int
    records: int


@dataclass
class RunSummary(JsonDoc):
    """`disttrace show RUN --json`, and what a run command prints after its job."""

    path: str | None  # reference | fault | recovered
    complete: bool
    manifest_id: str | None
    experiment: str | None
    edition: str | None
    topology: dict[str, int]  # world_size, dp, tp, pp, zero_stage (and ep, cp when > 1)
    fault: FaultSpec | None = as_stored()  # run.json's fault spec
    resume: ResumeSpec | None = as_stored()  # run.json's resume spec
    loss: dict[str, float]  # step -> loss
    ranks: dict[str, RankCounts]
    records: int  # trajectory records over all ranks
    step_seconds: list[float]  # rank 0, in step order
    fault_fired: list[FaultEvent] = as_stored()
    failures: list[EventLine] = as_stored()  # the FAILURE_EVENTS lines
    stragglers: list[Straggler]
    checkpoints: list[str]
    warnings: list[str]
    # "zero-code" when the command never called attach (the manifest's record.source); absent otherwise
    recorded: str | None = omit_none()


def summary(run_dir: Path | str) -> RunSummary:
    run = Run(run_dir)
    m = run.manifest
    counts, torn = {}, []
    for rank in run.ranks():
        idx = run.step_index(rank)
        counts[rank] = RankCounts(
            steps=len(idx.records), records=sum(e.records for e in idx.records)
        )
        if idx.torn:
            torn.append(idx.torn)
    events = run.event_lines()
    info = run.run_info
    times = run.step_times(0)  # rank 0's, kept whether the run recorded or not
    if times.torn:
        torn.append(times.torn)
    step_seconds = {e["step"]: e["seconds"] for e in times.records}
    return RunSummary(
        path=info.path,
        complete=run.complete,
        manifest_id=run.manifest_id,
        experiment=m.experiment.name,
        edition=m.experiment.edition,
        topology=_layout(m.parallelism),
        fault=info.fault,
        resume=info.resume,
        loss={str(k): v for k, v in run.losses().items()},
        ranks={str(k): v for k, v in counts.items()},
        records=sum(c.records for c in counts.values()),
        step_seconds=[step_seconds[k] for k in sorted(step_seconds)],
        fault_fired=[e for e in events if isinstance(e, FaultEvent)],
        failures=[e for e in events if e.event in FAILURE_EVENTS],
        stragglers=find_stragglers(run),
        checkpoints=[p.name for p in run.checkpoint_dirs()],
        warnings=torn,
        recorded=m.record.source,
    )


def _layout(par: ParallelismView) -> dict[str, int]:
    """world_size, dp, tp, pp, zero_stage as the manifest states them (unstated: 1, and ZeRO stage 0)."""
    fields = ("world_size", "dp", "tp", "pp", "zero_stage")
    stated = par.model_dump(include=set(fields), exclude_unset=True)
    out = {k: stated.get(k, 1 if k != "zero_stage" else 0) for k in fields}
    for k in (
        "ep",
        "cp",
    ):  # only a layout that uses them states them: other summaries keep their keys
        v = (par.model_extra or {}).get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            out[k] = v
    return out


def failure_text(e: EventLine) -> str:
    """What one failure event (FAILURE_EVENTS) says, in a line: a live check names the step, the phase and
    the group whose copies differ; a failed rank or job its error or reason (`RankFailed.error`,
    `JobFailed.reason`; either kind may carry the other's as an extra, from another writer)."""
    if isinstance(e, LiveCheckFailed):
        return f"step {e.step}: {e.phase} copies over group {e.group} differ"
    return str(getattr(e, "reason", None) or getattr(e, "error", None))


@dataclass
class CheckpointFact(JsonDoc):
    checkpoint: str
    step: int | None  # None: a partial write, never published
    verified: bool
    detail: str


@dataclass
class CheckpointFacts(JsonDoc):
    checkpoints: list[CheckpointFact]

    @property
    def all_verified(self) -> bool:
        """Every published checkpoint verifies (a partial write is listed, not judged)."""
        return all(c.verified for c in self.checkpoints if c.step is not None)


def checkpoints(run: Run) -> CheckpointFacts:
    out = []
    for p in run.checkpoint_dirs():
        ok, reason = checkpoint.status(p, run.manifest_id)
        out.append(CheckpointFact(p.name, int(p.name.split("-")[1]), ok, reason))
    for name in run.partial_checkpoints():
        out.append(CheckpointFact(name, None, False, "partial write (never published)"))
    return CheckpointFacts(out)


@dataclass
class CollectiveFacts(JsonDoc):
    """The collective trace: per-group sync (analysis/sync.py's document), the tensor traffic per step under
    the ring model, and the ZeRO paper's prediction for this strategy."""

    sync: SyncResult
    wire_volume: WireVolume
    predicted_bytes_per_step: int | None
    # ZeRO-3 with accumulation gathers the parameters once per micro-batch; the paper's 3(n-1)/n Psi counts
    # one forward and backward per step: the micro-batches per step where that gap applies, else None
    zero3_regathers: int | None = None

    def measured_over_predicted(self) -> list[tuple[str, float, float | None]]:
        """(step, ring bytes measured, their ratio to the prediction) for each step after set-up."""
        out = []
        for step, classes in self.wire_volume.steps.items():
            if step == "0":
                continue  # set-up (DDP's initial parameter broadcast)
            total = sum(r.ring_bytes for r in classes.values())
            pred = self.predicted_bytes_per_step
            out.append((step, total, total / pred if pred else None))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.sync.to_dict(),
            "wire_volume": self.wire_volume.to_dict(),
            "predicted_bytes_per_step": self.predicted_bytes_per_step,
        }


def collectives(run: Run) -> CollectiveFacts:
    m = run.manifest
    accum = m.training.grad_accum_steps or 1
    zero3 = m.parallelism.zero_stage == 3 and accum > 1
    return CollectiveFacts(
        sync=check_sync(run),
        wire_volume=wire_volume(run),
        predicted_bytes_per_step=predicted_dp_volume(run.manifest_doc),
        zero3_regathers=accum if zero3 else None,
    )


@dataclass
class MemoryFacts(JsonDoc):
    memory: list[MemoryLine] = as_stored()  # the ledger's lines, every rank (memory/rank-N.jsonl)

    def last_per_rank(self) -> list[tuple[int, MemoryLine]]:
        """Each rank's last ledger line, by rank (in file order: the last line a rank wrote)."""
        last = {r.rank: r for r in self.memory}
        return sorted(last.items(), key=lambda kv: str(kv[0]))


def memory_lines(run: Run, rank: int, torn: list | None = None) -> list[MemoryLine]:
    """`memory/rank-N.jsonl` as MemoryLine models, each validated once as it is read (`Run.memory`)."""
    return list(run.memory(rank, torn))


def memory(run: Run) -> MemoryFacts:
    rows: list[MemoryLine] = []
    for rank in run.ranks("memory"):
        rows += memory_lines(run, rank, [])
    return MemoryFacts(rows)


@dataclass
class EventFacts(JsonDoc):
    events: list[EventLine] = as_stored()


@dataclass
class RankRecords(JsonDoc):
    records: int
    steps: int
    bytes: int


@dataclass
class RecordCounts(JsonDoc):
    """Trajectory records per rank, read from the step index (no record is parsed)."""

    records: int
    bytes: int
    bytes_per_record: float | None
    ranks: dict[str, RankRecords] = field(default_factory=dict)


def record_counts(run: Run) -> RecordCounts:
    per_rank: dict[str, RankRecords] = {}
    for rank in run.ranks():
        entries = run.step_index(rank).records
        per_rank[str(rank)] = RankRecords(
            records=sum(e.records for e in entries),
            steps=len(entries),
            bytes=sum(e.length for e in entries),
        )
    total = sum(v.records for v in per_rank.values())
    size = sum(v.bytes for v in per_rank.values())
    return RecordCounts(total, size, round(size / total, 1) if total else None, per_rank)


@dataclass
class TopologyFacts(JsonDoc):
    """topology.json (None: not written); its document is the file as the run wrote it."""

    topology: Topology | None

    def to_dict(self) -> dict[str, Any]:
        return self.topology.as_read() if self.topology is not None else {}


def gather(run_dir: Path | str, view: str):
    """The facts of one `show` view."""
    if view not in VIEWS:
        raise BadInput("VIEW", f"unknown view '{view}'; one of: {', '.join(VIEWS)}")
    run = Run(run_dir)
    if view == "summary":
        return summary(run_dir)
    if view == "checkpoints":
        return checkpoints(run)
    if view == "topology":
        return TopologyFacts(run.topology())
    if view == "records":
        return record_counts(run)
    if view == "collectives":
        return collectives(run)
    if view == "memory":
        return memory(run)
    return EventFacts(run.event_lines())


def export_records(run: Run, out) -> int:
    """Every trajectory record of every rank as JSON lines on `out` (a binary stream), rank by rank in
    file order (which is the order key within a rank); each line validated as readers read it. Returns
    the count. The export for tools that want JSON: DuckDB, Polars, jq."""
    n = 0
    for rank in run.ranks():
        for rec in run.records(rank):
            out.write(orjson.dumps(rec) + b"\n")
            n += 1
    return n
