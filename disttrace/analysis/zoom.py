"""Zoom: compare two runs' depth records of one step and name the first module (and op) whose output differs
(docs/zoom.md). Reads the run store only; no torch.

    result = zoom_result(diff, deep_a, deep_b, depth="module")

Order inside the step: every forward record before every backward one; forward in execution order (micro-batch,
then the order the rank ran them), backward in its own. A module's forward record is written when its forward
returns, so a module comes after the modules inside it: the first module whose output differs is the
innermost one that made the difference.

Equality, with diff's own rules (analysis/diff/tol.py's comparator, analysis/tolerance.py's bounds): runs of one
topology compare record by record, bitwise (same rank, micro-batch, module, call, op index); runs of two
topologies compare logical tensors (a module's output over the step's whole batch, combined from each rank's
pieces by their offsets, output gradients weighted to the step's mean loss) within the derived bound of the
`forward` phase (forward outputs) or the `backward` phase (output gradients) at that step. Op depth compares
runs of one topology only (an op's outputs are laid out as the engine splits them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from disttrace.analysis import tolerance
from disttrace.analysis.diff.tol import _Tol
from disttrace.analysis.result import (
    BoundKind,
    DiffResult,
    Divergence,
    RecordsRead,
    RecordStats,
)
from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.store.depth import read_depth
from disttrace.store.documents import DepthRecord
from disttrace.store.rundir import Run

DEPTHS = ("module", "op")
_DIRECTION = {"forward": 0, "backward": 1}


@dataclass
class AtDepth(JsonDoc):
    """The first deep record that differs: where (micro-batch and rank: None for a logical tensor of the whole
    step) and both sides' values."""

    kind: str  # module | op
    call: int
    output: int
    micro_batch: int | None
    rank: int | None
    a: RecordStats | None
    b: RecordStats | None
    rel_err: float | None
    bound: float | None
    bound_kind: BoundKind
    missing_in: str | None = None
    note: str | None = None


@dataclass
class ZoomDivergence(Divergence):
    """diff's first divergence, and where inside its step the two runs first differ."""

    module: str | None = None  # the module path (None: every module agrees)
    direction: str | None = None  # forward | backward
    op: str | None = omit_none()  # op depth: the aten op (e.g. aten.mm)
    op_index: int | None = omit_none()  # its index among that module call's ops
    at_depth: AtDepth | None = omit_none()


@dataclass
class DeepRuns(JsonDoc):
    """The runs that hold the two sides' depth records, and what was compared."""

    a: str
    b: str
    produced_by: (
        str  # rerun: the frozen manifest re-run from its start with record.depth set; replay: an attached
        # script replayed with its own command; "rerun/replay": A's and B's when they differ
    )
    records: RecordsRead
    compared: int  # comparison units (records, or logical tensors across topologies)
    logical: bool  # compared as logical tensors (two topologies)


@dataclass
class ZoomResult(JsonDoc):
    """The `zoom --json` document: diff's verdict, the step zoomed into and what was found inside it."""

    equal: bool
    depth: str
    step: int | None  # the step recorded at depth (None: nothing to zoom into)
    mode: str
    first_divergence: ZoomDivergence | None
    inside: str  # one line: what the zoom found inside the step, or why it looked at nothing
    deep: DeepRuns | None
    diff: DiffResult
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- comparing


def _stats(values: dict) -> RecordStats:
    return RecordStats.of(values)


def _values(rec: DepthRecord) -> dict:
    """A record's statistics as diff's comparator reads them (its line as the file held it)."""
    return rec.as_read()


def _weighted(rec: DepthRecord) -> dict:
    """This rank's statistics as the logical tensor's (`weight`: an output gradient of a local mean loss)."""
    out = dict(_values(rec))
    w = float(rec.weight or 1.0)
    if w == 1.0:
        return out
    for k, scale in (("sum", w), ("norm", abs(w))):
        if out.get(k) is not None:
            out[k] = scale * out[k]
    if isinstance(out.get("sketch"), list):
        out["sketch"] = [w * x for x in out["sketch"]]
    return out


def _logical(recs: list[DepthRecord]) -> tuple[dict, bool]:
    """One logical tensor from its pieces (distinct offsets; the lowest rank's copy of a replicated piece):
    (its statistics as a record's, whether the pieces cover the logical shape)."""
    pieces: dict[tuple, tuple[DepthRecord, dict]] = {}
    for r in sorted(recs, key=lambda r: (r.rank, r.micro_batch, r.seq)):
        offset = r.shard.offset if r.shard is not None else [0] * len(r.shape)
        pieces.setdefault(tuple(offset), (r, _weighted(r)))
    ordered = [pieces[k] for k in sorted(pieces)]
    first = ordered[0][0]
    lshape = (first.shard.logical_shape if first.shard is not None else None) or first.shape
    numel = math.prod(lshape) if lshape else int(first.numel or 0)
    covered = sum(int(r.numel or 0) for r, _ in ordered)
    vals = [v for _, v in ordered]
    finite = all(v.get("sum") is not None and v.get("norm") is not None for v in vals)
    v = {
        "digest": "shards:" + ",".join(str(r.digest) for r, _ in ordered),
        "sum": math.fsum(x["sum"] for x in vals) if finite else None,
        "norm": math.sqrt(math.fsum(x["norm"] ** 2 for x in vals)) if finite else None,
        "sketch": tolerance.combine_sketches([x.get("sketch") for x in vals]) if finite else None,
        "nonfinite": sum(int(r.nonfinite or 0) for r, _ in ordered),
        "dtype": first.dtype,
        "shape": list(lshape),
        "numel": numel,
    }
    return v, covered == numel


def _same_bits(a: dict, b: dict) -> bool:
    return a["digest"] == b["digest"] and a["shape"] == b["shape"] and a["dtype"] == b["dtype"]


@dataclass
class _Unit:
    order: tuple
    rec: DepthRecord  # the reference record (A's, else B's): module, direction, kind, op...
    a: dict | None  # each side's statistics, as diff's comparator reads them
    b: dict | None
    micro_batch: int | None
    rank: int | None
    rel_err: float | None = None
    bound: float | None = None
    note: str | None = None


def _record_key(r: DepthRecord) -> tuple:
    return (r.rank, r.micro_batch, r.direction, r.kind, r.module, r.call, r.op_index, r.output)


def _order(r: DepthRecord) -> tuple:
    return (_DIRECTION[r.direction], r.micro_batch, r.seq, r.rank)


def _units_same_topology(ra: list[DepthRecord], rb: list[DepthRecord]) -> list[_Unit]:
    ka = {_record_key(r): r for r in ra}
    kb = {_record_key(r): r for r in rb}
    out = []
    for k in ka.keys() | kb.keys():
        x, y = ka.get(k), kb.get(k)
        ref = x if x is not None else y
        va = _values(x) if x is not None else None
        vb = _values(y) if y is not None else None
        out.append(_Unit(_order(ref), ref, va, vb, ref.micro_batch, ref.rank))
    return out


def _units_logical(ra: list[DepthRecord], rb: list[DepthRecord]) -> tuple[list[_Unit], list[str]]:
    def group(recs):
        g: dict[tuple, list[DepthRecord]] = {}
        for r in recs:
            g.setdefault((r.direction, r.module, r.call, r.output), []).append(r)
        return g

    ga, gb = group(ra), group(rb)
    out, warnings = [], []
    for k in ga.keys() | gb.keys():
        xs, ys = ga.get(k), gb.get(k)
        ref = min(xs or ys, key=_order)
        va = _logical(xs) if xs else None
        vb = _logical(ys) if ys else None
        u = _Unit(
            (_DIRECTION[ref.direction], ref.micro_batch, ref.seq, 0),
            ref,
            va[0] if va else None,
            vb[0] if vb else None,
            None,
            None,
        )
        incomplete = [s for s, v in (("a", va), ("b", vb)) if v is not None and not v[1]]
        if incomplete:
            u.note = f"pieces do not cover the logical shape in {incomplete[0]}"
        out.append(u)
    return out, warnings


def compare(
    deep_a: Run,
    deep_b: Run,
    step: int,
    depth: str,
    *,
    logical: bool,
    tol: _Tol,
) -> tuple[_Unit | None, int, tuple[int, int], list[str]]:
    """(the first unit that differs, units compared, records read on each side, warnings)."""
    read_a, read_b = read_depth(deep_a), read_depth(deep_b)
    warnings = [f"run A's depth records: {w}" for w in read_a.warnings] + [
        f"run B's depth records: {w}" for w in read_b.warnings
    ]
    for side, run, read in (("A", deep_a, read_a), ("B", deep_b, read_b)):
        if not read.count:
            raise BadInput(run.path / "depth", f"run {side} holds no depth records of step {step}")

    def of(read, kind):
        return [
            r for recs in read.by_rank.values() for r in recs if r.step == step and r.kind == kind
        ]

    kinds = ["op", "module"] if depth == "op" else ["module"]
    compared = 0
    for kind in kinds:  # op depth: the first op that differs; else (no op does) the first module
        ra, rb = of(read_a, kind), of(read_b, kind)
        if logical:
            units, more = _units_logical(ra, rb)
            warnings += more
        else:
            units = _units_same_topology(ra, rb)
        compared += len(units)
        units.sort(key=lambda u: u.order)
        for u in units:
            if u.a is None or u.b is None:
                u.bound = tol.derived(step, u.rec.direction)
                return u, compared, (read_a.count, read_b.count), warnings
            if u.note is None and _same_bits(u.a, u.b):
                continue
            rel, bnd, diverged, note = tol.compare(step, u.rec.direction, u.a, u.b)
            u.rel_err, u.bound, u.note = rel, bnd, u.note or note
            if diverged or u.note is not None:
                return u, compared, (read_a.count, read_b.count), warnings
    return None, compared, (read_a.count, read_b.count), warnings


def zoom_result(
    diff: DiffResult,
    step: int | None,
    depth: str,
    deep: tuple[Run, Run, str] | None,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    warnings: list[str] | None = None,
) -> ZoomResult:
    """The zoom of `diff` into `step` with the two runs `deep` = (A's, B's, how they were produced) that hold
    its depth records (None: nothing to zoom into)."""
    warnings = list(warnings or [])
    first = _from_diff(diff.first_divergence)

    def result(**fields) -> ZoomResult:
        return ZoomResult(depth=depth, mode=diff.mode, diff=diff, warnings=warnings, **fields)

    if deep is None or step is None:
        return result(
            equal=diff.equal,
            step=None,
            first_divergence=first,
            inside="diff found no divergence: no step to zoom into",
            deep=None,
        )
    deep_a, deep_b, produced_by = deep
    logical = not diff.topology.same
    refuse_op_across(diff, depth)
    if logical:
        refuse_attached_split(deep_a, deep_b)
    since = diff.tolerance.since_step or 0
    tol = _Tol(diff.mode, deep_a.manifest_doc, deep_b.manifest_doc, rtol, atol, since)
    unit, compared, (na, nb), more = compare(deep_a, deep_b, step, depth, logical=logical, tol=tol)
    warnings += more
    runs = DeepRuns(
        a=str(deep_a.path),
        b=str(deep_b.path),
        produced_by=produced_by,
        records=RecordsRead(na, nb),
        compared=compared,
        logical=logical,
    )
    if unit is None:
        where = _agree_inside(step, depth, first)
        return result(equal=diff.equal, step=step, first_divergence=first, inside=where, deep=runs)
    first = _deep_divergence(first, unit, step, tol.kind(step, unit.rec.direction))
    r = unit.rec
    name = r.module or "(outside every module)"
    what = f"{r.op} #{r.op_index} in {name}" if r.kind == "op" else name
    side = "output gradient" if r.direction == "backward" else "output"
    inside = f"step {step}: first differs at {what}, {r.direction} ({side})"
    return result(equal=False, step=step, first_divergence=first, inside=inside, deep=runs)


def _agree_inside(step: int, depth: str, first: ZoomDivergence | None) -> str:
    """What a zoom that found every deep record equal says, in one line."""
    return (
        f"step {step}: every module's output and output gradient agree"
        + (" and every op's output" if depth == "op" else "")
        + (
            f"; the divergence is outside forward and backward ({first.phase})"
            if first is not None
            else ""
        )
    )


def _deep_divergence(
    first: ZoomDivergence | None, unit: _Unit, step: int, kind: BoundKind
) -> ZoomDivergence:
    """diff's first divergence (or, where diff called the runs equal, one at the unit) with the module, op
    and deep record where the two runs first differ inside the step."""
    r = unit.rec
    at = AtDepth(
        kind=r.kind,
        call=r.call,
        output=r.output,
        micro_batch=unit.micro_batch,
        rank=unit.rank,
        a=_stats(unit.a) if unit.a is not None else None,
        b=_stats(unit.b) if unit.b is not None else None,
        rel_err=unit.rel_err,
        bound=unit.bound,
        bound_kind=kind,
        missing_in="a" if unit.a is None else ("b" if unit.b is None else None),
        note=unit.note,
    )
    if first is None:  # diff called the runs equal; the step was zoomed into on request
        first = ZoomDivergence(
            step=step,
            micro_batch=unit.micro_batch or 0,
            phase=r.direction,
            rank=unit.rank or 0,
            tensor=r.module,
            index=0,
            a=at.a,
            b=at.b,
            rel_err=unit.rel_err,
            bound=unit.bound,
            missing_in=at.missing_in,
            note=unit.note,
            bound_kind=kind,
        )
    first.module, first.direction, first.at_depth = r.module, r.direction, at
    if r.kind == "op":
        first.op, first.op_index = r.op, r.op_index
    return first


def refuse_op_across(diff: DiffResult, depth: str) -> None:
    if depth == "op" and not diff.topology.same:
        raise BadInput(
            "--depth",
            "op depth compares runs of one topology (an op's outputs are laid out as the engine splits "
            f"them; these differ in {', '.join(diff.topology.differs)}): use --depth module",
        )


def refuse_attached_split(*deep: Run) -> None:
    """Across layouts a record is placed in the step's logical batch by micro-batch and data-parallel rank
    as the harness splits it (data/windows.py). How an attached script's data-parallel ranks split a batch
    is the script's own (a DistributedSampler interleaves the samples), so its rows cannot be placed: an
    attached side must be dp = 1 there."""
    for r in deep:
        dp = (r.manifest_doc.get("parallelism") or {}).get("dp")
        if r.attached and isinstance(dp, int) and dp > 1:
            raise BadInput(
                r.path / "manifest.lock.json",
                f"an attached script's run at dp={dp}: across layouts zoom places each record in the "
                "step's batch, and how the script's data-parallel ranks split it is its own (compare "
                "runs of one topology, or a dp=1 layout)",
                field="manifest.parallelism.dp",
            )


def _from_diff(d: Divergence | None) -> ZoomDivergence | None:
    if d is None:
        return None
    return ZoomDivergence(**{k: getattr(d, k) for k in Divergence.__dataclass_fields__})
