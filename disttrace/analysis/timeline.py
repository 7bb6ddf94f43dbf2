"""`disttrace trace RUN -o trace.json`: a Chrome trace-event file (opens in Perfetto or chrome://tracing).

One process per rank; track 0 is compute (each step split into forward+backward up to the first gradient
collective, then the rest), one track per process group for its collectives, with sizes in args.
Read from the run store only: the trace is a data file that Perfetto draws, built here like any other
analysis. Events on one track never overlap (an op that starts before the previous one on its track ended
is drawn from that end: the track is a queue). The events are the trace-event format's own dicts."""

from __future__ import annotations

from disttrace.analysis.sync import load_traces
from disttrace.store.rundir import Run


def build_trace(run: Run) -> dict:
    steps = {r: run.step_index(r).records for r in run.ranks()}
    traces, _ = load_traces(run)
    t0 = _origin(steps, traces)

    def us(t):
        return round((t - t0) * 1e6, 3)

    events: list[dict] = []
    group_tid: dict[str, int] = {}
    for rank in sorted(set(steps) | set(traces)):
        events.append(
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        events.append(
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}}
        )
        events += _compute_events(rank, steps.get(rank, []), us)
        for group, ops in traces.get(rank, {}).items():
            tid = group_tid.setdefault(group, len(group_tid) + 1)
            events += _collective_events(rank, tid, group, ops, us)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"run": str(run.path), "manifest_id": run.manifest_id},
    }


def _origin(steps: dict, traces: dict) -> float:
    """The earliest time any step or collective started: the trace's zero."""
    t0 = None
    for entries in steps.values():
        for e in entries:
            t = e.time
            if "start" in t:
                t0 = t["start"] if t0 is None else min(t0, t["start"])
    for per_group in traces.values():
        for ops in per_group.values():
            for op in ops:
                if op.start is not None:
                    t0 = op.start if t0 is None else min(t0, op.start)
    return t0 or 0.0


def _compute_events(rank: int, entries, us) -> list[dict]:
    """A rank's steps on its compute track: the spans the engine timed, else forward+backward up to the
    first gradient collective and the rest."""
    out, last = [], 0.0
    for e in entries:
        t = e.time
        if "start" not in t or "end" not in t:
            continue
        mid = t.get("collective_issue", t["end"])
        blocks = (
            [(f"step {e.step} {name}", a, b) for name, a, b in t["spans"]]
            if t.get("spans")
            else [
                (f"step {e.step} forward+backward", t["start"], mid),
                (f"step {e.step} reduce+optimizer", mid, t["end"]),
            ]
        )
        for name, a, b in blocks:
            start = max(us(a), last)
            end = max(us(b), start)
            out.append(
                {
                    "ph": "X",
                    "name": name,
                    "pid": rank,
                    "tid": 0,
                    "ts": start,
                    "dur": end - start,
                    "args": {"step": e.step, "records": e.records},
                }
            )
            last = end
    return out


def _collective_events(rank: int, tid: int, group: str, ops, us) -> list[dict]:
    """A rank's collectives of one process group on that group's track."""
    out: list[dict] = [
        {
            "ph": "M",
            "name": "thread_name",
            "pid": rank,
            "tid": tid,
            "args": {"name": f"group [{group}]"},
        }
    ]
    last = 0.0
    for op in ops:
        if op.start is None:
            continue  # an op the trace never saw start: nowhere on the timeline
        start = max(us(op.start), last)
        end = max(us(op.end if op.end is not None else op.start), start)
        out.append(
            {
                "ph": "X",
                "name": op.op,
                "pid": rank,
                "tid": tid,
                "ts": start,
                "dur": end - start,
                "cat": "collective",
                "args": {
                    "seq": op.seq,
                    "step": op.step,
                    "shapes": op.shapes,
                    "dtype": op.dtype,
                    "bytes": op.bytes,
                    "finished": op.end is not None,
                },
            }
        )
        last = end
    return out
