"""Cross-rank collective check, read from the run store only: within every process group, all members must
issue the same sequence of (op, shapes, dtype). The first disagreement is reported the way a desync
should be: group, sequence number, the minority rank(s) and both sides.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass

from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.store.documents import CollectiveLine
from disttrace.store.rundir import Run


def load_traces(run: Run) -> tuple[dict[int, dict[str, list[CollectiveLine]]], list[str]]:
    """rank -> group -> issued ops in order (with `end` set from the op's end line when it completed)."""
    traces: dict[int, dict[str, list[CollectiveLine]]] = {}
    warnings: list[str] = []
    for rank in run.ranks("collectives"):
        torn: list = []
        groups: dict[str, list[CollectiveLine]] = {}
        by_key: dict[tuple, CollectiveLine] = {}
        seen_fr: set = set()
        for rec in run.collectives(rank, torn):
            if rec.lost is not None:
                # the Flight Recorder's ring wrapped past entries not yet copied (run/record/flightrec.py)
                warnings.append(
                    f"rank {rank}: {rec.lost} collective(s) lost from the trace near step "
                    f"{rec.step} (Flight Recorder ring overwritten before it was copied)"
                )
                continue
            if rec.fr_seq is not None:
                # a dump from a signal handler may repeat entries a dump in progress wrote
                key = (rec.pg, rec.fr_seq, rec.op in P2P)
                if key in seen_fr:
                    continue
                seen_fr.add(key)
            if rec.op is not None:
                groups.setdefault(rec.group, []).append(rec)
                by_key[(rec.group, rec.seq)] = rec
                if rec.op in P2P:  # point-to-point pairs a send with a recv: not a group sequence
                    groups[rec.group].pop()
                    groups.setdefault(f"p2p:{rec.group}", []).append(rec)
            elif rec.end is not None and (rec.group, rec.seq) in by_key:
                by_key[(rec.group, rec.seq)].end = rec.end
        traces[rank] = groups
        warnings += torn
    return traces, warnings


P2P = {"send", "recv_", "recv_any_source_"}


def fingerprint(rec: CollectiveLine) -> tuple:
    shapes = tuple(tuple(s) for s in rec.shapes or [])
    if rec.op and "alltoall" in rec.op:
        # an all-to-all with uneven splits (expert parallel's tokens) sends as many rows as routing gave
        # each rank: its members agree on the op, the dtype and a row's shape, not on the row count
        shapes = tuple(s[1:] for s in shapes)
    return (rec.op, shapes, rec.dtype)


def describe(rec: CollectiveLine | None) -> str:
    if rec is None:
        return "nothing"
    shapes = ",".join("x".join(map(str, s)) or "scalar" for s in rec.shapes or [])
    return f"{rec.op} [{shapes}] {rec.dtype}"


@dataclass
class GroupSync(JsonDoc):
    """One process group's trace: its members, how many collectives, the bytes rank 0 of it moved."""

    ranks: list[int] | str  # point-to-point pairs: "src->dst" as the trace names them
    ops: int
    bytes: int
    note: str | None = omit_none()


@dataclass
class Mismatch(JsonDoc):
    """The first collective of a group whose members issued different things."""

    group: list[int]
    seq: int
    ranks: list[int]  # the minority
    majority_ranks: list[int]
    minority: str  # what the minority issued
    majority: str
    start: float
    step: int | None
    message: str


@dataclass
class Unfinished(JsonDoc):
    rank: int
    group: str
    seq: int
    op: str


@dataclass
class SyncResult(JsonDoc):
    """Within every process group, did every member issue the same sequence of collectives."""

    ok: bool
    groups: dict[str, GroupSync]
    first_mismatch: Mismatch | None
    mismatches: list[Mismatch]
    unfinished: list[Unfinished]  # issued, never finished (a hang, or a rank that died)
    warnings: list[str]


def check_sync(run: Run) -> SyncResult:
    traces, warnings = load_traces(run)
    groups: dict[str, GroupSync] = {}
    mismatches: list[Mismatch] = []
    for gkey in sorted({g for t in traces.values() for g in t}):
        if gkey.startswith("p2p:"):
            groups[gkey] = GroupSync(
                ranks=gkey[4:],
                ops=sum(len(t.get(gkey, [])) for t in traces.values()),
                bytes=sum(x.bytes or 0 for t in traces.values() for x in t.get(gkey, [])),
                note="point-to-point: counted, not sequence-checked",
            )
            continue
        members = [int(r) for r in gkey.split(",")] if gkey != "?" else sorted(traces)
        present = [r for r in members if r in traces]
        seqs = {r: traces[r].get(gkey, []) for r in present}
        groups[gkey] = GroupSync(
            ranks=members,
            ops=max((len(v) for v in seqs.values()), default=0),
            bytes=sum(x.bytes or 0 for x in seqs[present[0]]) if present else 0,
        )
        found = _first_mismatch(members, seqs, run.complete)
        if found is not None:
            mismatches.append(found)
    # the tracer writes an `end` line; the Flight Recorder's records say `done`
    unfinished = sorted(
        {
            (r, g, rec.seq, rec.op)
            for r, t in traces.items()
            for g, lst in t.items()
            for rec in lst
            if rec.end is None and not rec.done
        }
    )
    first = min(mismatches, key=lambda m: m.start) if mismatches else None
    return SyncResult(
        ok=first is None,
        groups=groups,
        first_mismatch=first,
        mismatches=mismatches,
        unfinished=[Unfinished(r, g, s, o) for r, g, s, o in unfinished],
        warnings=warnings,
    )


def _first_mismatch(
    members: list[int], seqs: dict[int, list[CollectiveLine]], complete: bool
) -> Mismatch | None:
    """The first collective of one group whose members issued different things (later ops of a desynced
    group are noise); None where they agree."""
    n = max((len(v) for v in seqs.values()), default=0)
    for k in range(n):
        recs = {r: (v[k] if k < len(v) else None) for r, v in seqs.items()}
        if any(v is None for v in recs.values()) and not complete:
            return None  # a rank's trace ended (it died or hung earlier): not a desync of this op
        prints = {r: (fingerprint(v) if v else None) for r, v in recs.items()}
        if len(set(prints.values())) <= 1:
            continue
        majority, _ = Counter(prints.values()).most_common(1)[0]
        minority = sorted(r for r, p in prints.items() if p != majority)
        agree = sorted(r for r, p in prints.items() if p == majority)
        example = next(recs[r] for r in agree) if agree else None
        odd = recs[minority[0]]
        return Mismatch(
            group=members,
            seq=k,
            ranks=minority,
            majority_ranks=agree,
            minority=describe(odd),
            majority=describe(example),
            start=min((v.start for v in recs.values() if v), default=0.0),
            step=(odd or example).step if (odd or example) is not None else None,
            message=f"collective desync in group {members} at sequence {k}: rank(s) {minority} "
            f"issued {describe(odd)}, rank(s) {agree} issued {describe(example)}",
        )
    return None


@dataclass
class Straggler(JsonDoc):
    """A rank that reached its step's first gradient collective late: its time from the step's start, and
    the median of the other ranks'."""

    step: int
    rank: int
    seconds: float
    others_median: float

    def text(self) -> str:
        return (
            f"rank {self.rank} at step {self.step} took {self.seconds}s to reach its collective "
            f"(others {self.others_median}s)"
        )


def find_stragglers(run: Run, min_seconds: float = 0.1, factor: float = 2.0) -> list[Straggler]:
    """A straggler makes everyone wait: per step, compare each rank's time from step start to issuing its
    first gradient collective with the other ranks'. Numerics cannot show this; timing does."""
    per_step: dict[int, dict[int, float]] = {}
    for rank in run.ranks():
        for entry in run.step_index(rank).records:
            t = entry.time
            if "collective_issue" in t and "start" in t:
                per_step.setdefault(entry.step, {})[rank] = t["collective_issue"] - t["start"]
    return stragglers(per_step, min_seconds, factor)


def stragglers(
    per_step: dict[int, dict[int, float]], min_seconds: float = 0.1, factor: float = 2.0
) -> list[Straggler]:
    """find_stragglers on {step: {rank: seconds to the first gradient collective}}: a rank later than the
    median of the other ranks by more than `min_seconds` and more than `factor` times it."""
    out = []
    for step, times in sorted(per_step.items()):
        if len(times) < 2:
            continue
        # each rank's median of the others, from one sort of the step's times: the others are `ordered`
        # without one copy of the rank's own time (at `at`), so their middle one is ordered[k] or ordered[k + 1]
        ordered = sorted(times.values())
        k = (len(ordered) - 1) // 2
        for rank, t in times.items():
            at = bisect.bisect_left(ordered, t)
            median = ordered[k] if k < at else ordered[k + 1]
            if t - median > min_seconds and t > factor * median:
                out.append(Straggler(step, rank, round(t, 4), round(median, 4)))
    return out


# ring-algorithm bytes each rank sends per op, as a multiple of the op's recorded input bytes, for a group
# of n ranks: all-reduce 2(n-1)/n of the buffer; all-gather (n-1)/n of the gathered output = (n-1) x the
# input shard; reduce-scatter (n-1)/n of the input; broadcast and point-to-point: the buffer once.
RING = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: float(n - 1),
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


def op_class(op: str) -> str | None:
    o = op.lower()
    if o in ("send", "recv_", "recv_any_source_"):
        return "p2p"
    for key, cls in (
        ("reduce_scatter", "reduce_scatter"),
        ("allreduce", "allreduce"),
        ("all_reduce", "allreduce"),
        ("allgather", "allgather"),
        ("all_gather", "allgather"),
        ("broadcast", "broadcast"),
    ):
        if key in o:
            return cls
    return None


@dataclass
class ClassVolume(JsonDoc):
    """One collective class's traffic at one step: calls, the buffers' bytes, the ring model's bytes sent."""

    calls: int = 0
    bytes: int = 0
    ring_bytes: float = 0.0


@dataclass
class WireVolume(JsonDoc):
    """One rank's tensor traffic per step (str of the step) and collective class."""

    rank: int
    steps: dict[str, dict[str, ClassVolume]]


def wire_volume(run: Run, rank: int = 0) -> WireVolume:
    """Per step, for one rank: calls and bytes per collective class and the ring model's bytes on the wire,
    counting tensor traffic (floating point: gradients, parameters, activations), not the small integer
    and byte messages of object collectives (checkpoint planning, topology exchange)."""
    traces, _ = load_traces(run)
    steps: dict[int, dict[str, ClassVolume]] = {}
    for group, ops in traces.get(rank, {}).items():
        members = group.removeprefix("p2p:").split(",")
        n = len(members) if members != ["?"] else 1
        for op in ops:
            cls = op_class(op.op)
            if cls is None or not str(op.dtype or "").startswith(("float", "bfloat")):
                continue
            step = op.step if op.step is not None else 0
            row = steps.setdefault(step, {}).setdefault(cls, ClassVolume())
            row.calls += 1
            row.bytes += op.bytes or 0
            row.ring_bytes += RING[cls](n) * (op.bytes or 0) if n > 1 else 0.0
    return WireVolume(rank, {str(s): v for s, v in sorted(steps.items())})


def predicted_dp_volume(manifest: dict) -> int | None:
    """The plan's data-parallel bytes per rank per step for this run's ZeRO stage (no TP/PP traffic)."""
    from disttrace.plan.costs import comm_bytes_per_device, count_params

    try:
        m, p, t = manifest["model"], manifest["parallelism"], manifest["training"]
        if p["tp"] > 1 or p["pp"] > 1 or p.get("architecture") != "allreduce":
            return None
        psi = count_params(
            m["dim"], m["n_layers"], m["n_heads"], m["n_kv_heads"], m["vocab_size"], m["ffn_hidden"]
        )
        per = {"float32": 4, "float64": 8}.get(t["dtype"], 4)
        return comm_bytes_per_device(psi, p["dp"], per)[str(p["zero_stage"])]
    except (KeyError, TypeError, ValueError):
        return None
