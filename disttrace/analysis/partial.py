"""diff spread over processes and machines (docs/scale.md): `--jobs N`, `--ranks SPEC`, `--steps SPEC`, `--merge`.

    result = diff_runs(a, b, jobs=4)                    # the one-process result, computed in 4 processes
    part = diff_partial(a, b, ranks=parse_spec("0-63", "--ranks"))  # what ranks 0..63 show
    result = merge_partials(["p0.json", "p1.json"])     # the one-process result, from partial documents

What can be split. Where both runs have the same topology, every rank's records are compared with the same
rank's records of the other run, and nothing else: ranks are split (each process reads only its ranks' step
index and trajectory; the magnitudes, which a numeric bound sums over all ranks, are read whole). Across
topologies a logical tensor is combined from shards of several ranks, each of B's replicas is compared with
A's lowest rank's copy, replicas of one run are checked against each other and losses are matched by the
samples of their micro-batch, across ranks: a step's records of every rank are read together, and steps
are split instead.

How results combine. A process compares its share and returns, per step, each rank's result (`_RankStep`:
counts, the largest errors and bounds per phase, the first divergent unit with its key), the warnings the
step raised and where its bounds came from; per rank, the steps its index holds and what reading it warned
of. The combination replays these in step order through the same fold one process uses (analysis/diff/fold.py's `_Fold`),
and derives what depends on every rank (the steps all ranks hold, the compared steps and why, the
incomplete-run warnings) from the ranks' steps: so the document is byte for byte the one-process document
(tests/test_diff_jobs.py compares the bytes).

A partial document is a diff document of the ranks (or steps) read, with `equal` null unless a divergence
was found there (then false: the runs differ whatever the others hold), and a `partial` object: what it
covers, what it is bound to (both runs' manifest ids and the sha256 of their COMPLETE, which seals every
rank's files, and the diff's options), and the per-step data a merge needs. Its exit code is 1 when its
share diverges and 4 (no verdict) when it does not, never 0. A merge reads documents someone else wrote:
each is size-capped, validated by pydantic models, bound to the same runs and options as the others, and
together they must cover every rank (or step) exactly once; anything else is exit 2 naming the file.

No torch: readers only.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    StrictBool,
    StrictInt,
    ValidationError,
)

from disttrace import __version__
from disttrace.analysis.diff import diff_runs
from disttrace.analysis.diff.compare import _RankStep
from disttrace.analysis.diff.fold import StepOutcome, _Fold, _result
from disttrace.analysis.diff.prepare import _compared_steps, _Setup
from disttrace.analysis.diff.side import _Side, common_steps, side_warnings
from disttrace.analysis.result import BoundKind, DiffResult, SideSummary, Tolerance, Unit
from disttrace.config.manifest import get_field
from disttrace.errors import EXIT_DIVERGED, EXIT_PARTIAL, BadInput, DisttraceError
from disttrace.fmt import ranges
from disttrace.store import safeio
from disttrace.store.rundir import COMPLETE, MAX_WORLD

FORMAT = "disttrace-diff-partial/1"
MAX_PARTIAL_BYTES = (
    1 << 30
)  # one partial document (~12 bytes a rank-step, more where tensors differ)
MAX_PARTIALS = 65_536
MAX_SPEC_ITEMS = 4096  # comma-separated items of a --ranks / --steps spec
MAX_STEP = 1 << 40
MAX_STEPS_HELD = (
    20_000_000  # rank-steps a partial's step lists may name in all (expanded in memory)
)


class WorkerFailed(DisttraceError):
    """A process of `--jobs` refused its share (bad input, an edited step): its one line, its exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------- specs


def parse_spec(spec: str, option: str, limit: int = MAX_WORLD) -> list[int]:
    """'0-63', '0,2,4-7' -> the sorted numbers; anything else is BadInput naming the option."""
    text = spec.strip()
    if not text:
        raise BadInput(option, "is empty; give numbers and ranges such as 0-63 or 0,2,4-7")
    items = text.split(",")
    if len(items) > MAX_SPEC_ITEMS:
        raise BadInput(option, f"has more than {MAX_SPEC_ITEMS} comma-separated items")
    out: set[int] = set()
    for item in items:
        lo, sep, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise BadInput(
                option, f"{item.strip()!r} is not a number or a range such as 4-7"
            ) from None
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise BadInput(option, f"{item.strip()!r} is not a number or a range such as 4-7")
        if last < first:
            raise BadInput(option, f"{item.strip()!r}: a range runs from low to high")
        if last >= limit:
            raise BadInput(option, f"{item.strip()!r}: more than the {limit} a spec may name")
        if last - first >= limit:
            raise BadInput(option, f"{item.strip()!r}: a range of more than {limit}")
        out.update(range(first, last + 1))
        if len(out) > limit:
            raise BadInput(option, f"names more than {limit} numbers")
    return sorted(out)


def _spans(xs) -> list[list[int]]:
    """[1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    out: list[list[int]] = []
    for x in sorted(xs):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def _unspan(spans) -> list[int]:
    return [x for lo, hi in spans for x in range(lo, hi + 1)]


# ---------------------------------------------------------------- the document's parts, as data
#
# A partial document is these models dumped; a merge validates what someone else wrote into the same
# models, and the fold reads them. Numbers survive losslessly: a non-finite float is written as "inf",
# "-inf" or "nan" (JSON has none) and read back as the float.

_S = Annotated[str, Field(strict=True, max_length=1 << 20)]
_StrictFloat = Annotated[float, Field(strict=True)]
_NONFINITE = {"inf", "-inf", "nan"}


def _num_in(x):
    return float(x) if isinstance(x, str) and x in _NONFINITE else x


def _num_out(x) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if x != x else ("inf" if x > 0 else "-inf")
    return x


_Num = Annotated[
    StrictInt | _StrictFloat, BeforeValidator(_num_in), PlainSerializer(_num_out, return_type=Any)
]
_Count = Annotated[int, Field(strict=True, ge=0)]
_RankNo = Annotated[int, Field(strict=True, ge=0, lt=MAX_WORLD)]
_Spans = Annotated[
    list[
        Annotated[
            list[Annotated[int, Field(strict=True, ge=0, le=MAX_STEP)]],
            Field(min_length=2, max_length=2),
        ]
    ],
    Field(max_length=1 << 24),
]


def _float(x):
    """A number as the document holds it: numpy's as Python's, an int as a float."""
    return None if x is None else float(x)


def _floats_only(x):
    """A float as Python's (numpy's included); an int or None as it is."""
    return float(x) if isinstance(x, (float, np.floating)) else x


def _i(x):
    return int(x) if isinstance(x, (int, np.integer)) and not isinstance(x, bool) else x


class _M(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Stats(_M):
    """One side's record of a compared unit (analysis/diff/compare.py's `_stats`)."""

    digest: _S | None
    sum: _Num | None
    norm: _Num | None
    sketch: Annotated[list[_Num | None], Field(max_length=4096)] | None
    nonfinite: StrictInt | None
    dtype: _S | None
    shape: Annotated[list[StrictInt], Field(max_length=64)] | None
    numel: StrictInt | None

    @classmethod
    def of(cls, st: dict | None) -> _Stats | None:
        if st is None:
            return None
        sk, shape = st.get("sketch"), st.get("shape")
        return cls(
            digest=st.get("digest"),
            sum=_floats_only(st.get("sum")),
            norm=_floats_only(st.get("norm")),
            sketch=[_float(v) for v in sk] if sk is not None else None,
            nonfinite=_i(st.get("nonfinite")),
            dtype=st.get("dtype"),
            shape=[_i(v) for v in shape] if shape is not None else None,
            numel=_i(st.get("numel")),
        )

    def stats(self) -> dict:
        """As diff's comparison holds it."""
        out = {k: getattr(self, k) for k in type(self).model_fields}
        if self.sketch is not None:
            out["sketch"] = list(self.sketch)
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return out


class _Unit(_M):
    """A compared unit (analysis/diff/compare.py's `_unit`): the first divergent one of a rank at a step."""

    step: StrictInt
    micro_batch: StrictInt | None
    phase: _S
    rank: StrictInt
    tensor: _S | None
    index: StrictInt | None
    a: _Stats | None
    b: _Stats | None
    rel_err: _Num | None
    bound: _Num | None
    diverged: StrictBool
    missing_in: Literal["a", "b"] | None
    note: _S | None

    @classmethod
    def of(cls, u: Unit) -> _Unit:
        fields = {k: _i(getattr(u, k)) for k in cls.model_fields}
        fields.update(
            rel_err=_float(u.rel_err),
            bound=_float(u.bound),
            a=_Stats.of(u.a),
            b=_Stats.of(u.b),
        )
        return cls(**fields)

    def unit(self) -> Unit:
        """As diff's comparison holds it."""
        fields = {k: getattr(self, k) for k in type(self).model_fields}
        fields["a"] = self.a.stats() if self.a is not None else None
        fields["b"] = self.b.stats() if self.b is not None else None
        return Unit(**fields)


_Key = Annotated[list[StrictInt | _S | None], Field(min_length=6, max_length=6)]


class _Rank(_M):
    """A rank's result at one step where something was not bit-equal (analysis/diff/compare.py's `_RankStep`): every field
    the fold reads."""

    d: StrictInt  # tensors divergent
    t: StrictInt  # tensors compared
    i: StrictInt  # not bit-equal
    h: StrictInt  # divergent without a relative error
    mx: _Num  # the largest error / bound
    mr: Annotated[
        list[tuple[_S, _Num, _Num | None]], Field(max_length=64)
    ]  # phase, error, its bound
    rp: Annotated[
        list[tuple[_S, _Num, _Num, _Num]], Field(max_length=64)
    ]  # phase, ratio, error, bound
    f: tuple[_Key, _Unit] | None  # the first divergent unit, with its key

    @classmethod
    def of(cls, rs: _RankStep) -> _Rank:
        return cls(
            d=int(rs.differing),
            t=int(rs.total),
            i=int(rs.inexact),
            h=int(rs.hard),
            mx=_float(rs.max_ratio),
            mr=[(p, _float(v), _float(rs.max_rel_bound.get(p))) for p, v in rs.max_rel.items()],
            rp=[(p, _float(x), _float(y), _float(z)) for p, (x, y, z) in rs.ratio_by_phase.items()],
            f=([_i(k) for k in rs.first[0]], _Unit.of(rs.first[1]))
            if rs.first is not None
            else None,
        )

    def rank_step(self) -> _RankStep:
        rs = _RankStep(self.t)
        rs.differing, rs.inexact, rs.hard, rs.max_ratio = self.d, self.i, self.h, self.mx
        for p, rel, bnd in self.mr:
            rs.max_rel[p] = rel
            rs.max_rel_bound[p] = bnd
        for p, x, y, z in self.rp:
            rs.ratio_by_phase[p] = (x, y, z)
        if self.f is not None:
            rs.first = (tuple(self.f[0]), self.f[1].unit())
        return rs


def _trivial(rs) -> bool:
    return not (
        rs.differing
        or rs.inexact
        or rs.hard
        or rs.max_rel
        or rs.ratio_by_phase
        or rs.max_ratio
        or rs.first is not None
    )


def _equal_spans(pairs) -> list[tuple[int, int, int]]:
    """(rank, total) pairs -> [(first rank, last rank, total), ...] of consecutive ranks with one total."""
    out: list[list[int]] = []
    for r, t in sorted(pairs):
        if out and out[-1][1] + 1 == r and out[-1][2] == t:
            out[-1][1] = r
        else:
            out.append([r, r, t])
    return [(lo, hi, t) for lo, hi, t in out]


_BoundKind = Literal[tuple(k.value for k in BoundKind)]


class _Step(_M):
    """One compared step's outcome (analysis/diff/fold.py's `StepOutcome`), with where its bounds came from, so that a
    merge needs no store and no bound code."""

    step: Annotated[int, Field(strict=True, ge=0, le=MAX_STEP)]
    read: _Count
    io: Annotated[list[_Count], Field(min_length=4, max_length=4)]  # A's parsed, hashed; B's
    # ranks where nothing differed as spans of (first, last, records each): a bitwise run's equal steps
    # cost a few numbers however many ranks; the others in the order the comparison gave them
    equal: Annotated[list[tuple[_RankNo, _RankNo, _Count]], Field(max_length=MAX_WORLD)]
    ranks: Annotated[list[tuple[_RankNo, _Rank]], Field(max_length=MAX_WORLD)]
    kinds: Annotated[list[tuple[_S, _S | None, _BoundKind]], Field(max_length=1 << 20)]
    bounds: Annotated[list[tuple[_S, _Num | None]], Field(max_length=64)]
    events: Annotated[list[tuple[_S, _S]], Field(max_length=1024)]
    both: Annotated[list[_S], Field(max_length=64)]

    @classmethod
    def of(cls, o: StepOutcome) -> _Step:
        look = o.look
        phases: dict[str, None] = {}
        kinds: dict[tuple, str] = {}
        for rs in o.per_rank.values():
            phases.update(dict.fromkeys(rs.max_rel))
            if rs.first is not None:
                u = rs.first[1]
                kinds[(u.phase, u.tensor)] = str(look.kind(o.step, u.phase, u.tensor))
        for p in phases:
            kinds[(p, None)] = str(look.kind(o.step, p))
        (ra, ha), (rb, hb) = o.io
        return cls(
            step=int(o.step),
            read=int(o.read),
            io=[int(ra), int(ha), int(rb), int(hb)],
            equal=_equal_spans(
                (int(r), int(rs.total)) for r, rs in o.per_rank.items() if _trivial(rs)
            ),
            ranks=[(int(r), _Rank.of(rs)) for r, rs in o.per_rank.items() if not _trivial(rs)],
            kinds=[(p, n, k) for (p, n), k in kinds.items()],
            bounds=[(p, _float(look.compare_bound(o.step, p))) for p in phases],
            events=[(k, t) for k, t in o.events],
            both=sorted(o.both),
        )

    def held_ranks(self) -> list[int]:
        return sorted([r for r, _ in self.ranks] + _span_ranks(self.equal))

    def outcome(self, user: bool) -> StepOutcome:
        """The step as the fold reads it; its bounds from the table the comparison wrote."""
        look = _Look(
            user,
            {(p, n): BoundKind(k) for p, n, k in self.kinds},
            {p: v for p, v in self.bounds},
        )
        io = ((self.io[0], self.io[1]), (self.io[2], self.io[3]))
        per_rank = {r: v.rank_step() for r, v in self.ranks}
        for (
            lo,
            hi,
            total,
        ) in self.equal:  # (where nothing differed, the order of ranks does not matter)
            for r in range(lo, hi + 1):
                per_rank[r] = _RankStep(total)
        return StepOutcome(
            self.step, per_rank, self.read, io, [tuple(x) for x in self.events], self.both, look
        )

    @classmethod
    def joined(cls, parts: list[_Step], by_rank: bool) -> _Step:
        """One step from the shares that compared it (their ranks, or all of them)."""
        first = parts[0]
        ranks = [rv for e in parts for rv in e.ranks]
        equal = [x for e in parts for x in e.equal]
        if by_rank:  # one process compares a step's ranks in rank order
            ranks.sort(key=lambda rv: rv[0])
            equal = _equal_spans((r, t) for lo, hi, t in equal for r in range(lo, hi + 1))
        if len(parts) == 1:
            return first.model_copy(update={"ranks": ranks, "equal": equal})
        return first.model_copy(
            update={
                "read": sum(e.read for e in parts),
                "io": [sum(x) for x in zip(*(e.io for e in parts))],
                "ranks": ranks,
                "equal": equal,
                "kinds": [x for e in parts for x in e.kinds],
                "bounds": [x for e in parts for x in e.bounds],
                "events": [x for e in parts for x in e.events],
                "both": sorted({x for e in parts for x in e.both}),
            }
        )


def _span_ranks(spans) -> list[int]:
    return [r for lo, hi, _ in spans for r in range(lo, hi + 1)]


class _Look:
    """The answers a compared step's `_Tol` gave, as the fold asks for them."""

    def __init__(self, user: bool, kinds: dict, bounds: dict):
        self.user, self.kinds, self.bounds = user, kinds, bounds

    def kind(self, step: int, phase: str, name: str | None = None) -> str:
        k = self.kinds.get((phase, name))
        if k is None:
            raise BadInput(
                "--merge", f"step {step}: no bound kind for {phase} {name or ''}", field="kinds"
            )
        return k

    def compare_bound(self, step: int, phase: str):
        if phase not in self.bounds:
            raise BadInput("--merge", f"step {step}: no bound for {phase}", field="bounds")
        return self.bounds[phase]

    def derived(self, step: int, phase: str):
        return None  # only a default the fold never takes: every phase's error carries its bound


class _SideFacts(_M):
    """What the fold needs of a run: its facts, and per rank the steps its index holds and the warnings
    reading it raised."""

    label: Literal["A", "B"]
    path: _S
    kind: _S | None
    complete: StrictBool
    manifest_id: _S
    resume_step: StrictInt
    all_ranks: _Spans
    world: Annotated[int, Field(strict=True, ge=1, le=MAX_WORLD)]
    n_total: StrictInt
    every: Annotated[int, Field(strict=True, ge=1)]
    rank_steps: Annotated[list[tuple[_Count, _Spans]], Field(max_length=MAX_WORLD)]
    rank_warnings: Annotated[
        list[tuple[StrictInt, Annotated[list[_S], Field(max_length=64)]]],
        Field(max_length=MAX_WORLD),
    ]

    @classmethod
    def of(cls, side: _Side) -> _SideFacts:
        return cls(
            label=side.label,
            path=str(side.path),
            kind=side.kind,
            complete=side.complete,
            manifest_id=side.run.manifest_id,
            resume_step=int(side.resume_step),
            all_ranks=_spans(side.all_ranks),
            world=side.run.world_size,
            n_total=int(get_field(side.manifest, "training.steps") or 0),
            every=max(1, int(get_field(side.manifest, "record.every") or 1)),
            rank_steps=[(r, _spans(side.index[r])) for r in side.ranks],
            rank_warnings=[(r, w) for r, w in side.rank_warnings.items() if w],
        )

    def held(self) -> dict[int, list[int]]:
        """Rank -> the steps its index holds."""
        return {r: _unspan(s) for r, s in self.rank_steps}

    def summary(self, steps: list[int]) -> SideSummary:
        return SideSummary(
            path=self.path,
            kind=self.kind,
            complete=self.complete,
            manifest_id=self.manifest_id,
            resume_step=self.resume_step or None,
            ranks=_unspan(self.all_ranks),
            steps=[steps[0], steps[-1]] if steps else None,
        )


class _Sides(_M):
    a: _SideFacts
    b: _SideFacts
    # (iterating a model gives its (name, value) pairs: ("a", A's facts), ("b", B's))


class _Tolerance(_M):
    """The result's `Tolerance`, every field (its document leaves some out by kind)."""

    kind: _BoundKind
    bound: _Num | None
    rtol: _Num | None
    atol: _Num | None
    file: _S | None
    safety: Any
    manifest_id: _S | None
    elsewhere: _S | None
    since_step: StrictInt | None
    derivation: dict[_S, Any]
    scale: _S | None
    found: StrictBool | None

    @classmethod
    def of(cls, t: Tolerance) -> _Tolerance:
        fields = {k: getattr(t, k) for k in cls.model_fields}
        return cls(**{**fields, "kind": t.kind.value})

    def tolerance(self) -> Tolerance:
        fields = {k: getattr(self, k) for k in type(self).model_fields}
        return Tolerance(**{**fields, "kind": BoundKind(self.kind)})


class _Run(_M):
    """The comparison's facts that every share computes alike."""

    mode: Literal["bitwise", "numeric"]
    topology_differs: Annotated[list[_S], Field(max_length=256)]
    logical: StrictBool
    user: StrictBool
    use_index: StrictBool
    grid_ranks: _Spans
    tolerance: _Tolerance
    pre: Annotated[list[_S], Field(max_length=256)]  # the warnings before the comparison
    post: Annotated[list[_S], Field(max_length=256)]  # and those after the runs' steps were read


class _SideBinding(_M):
    manifest_id: _S
    seal: _S | None


class _Options(_M):
    """The diff's options as the partials are bound to them."""

    mode: Literal["bitwise", "numeric"] | None
    rtol: _Num | None
    atol: _Num | None
    allow_edition_mismatch: StrictBool
    use_index: StrictBool
    calibration: _S | None
    find_calibration: StrictBool

    @classmethod
    def of(cls, opts: dict) -> _Options:
        cal = opts.get("calibration")
        return cls(
            mode=opts.get("mode"),
            rtol=opts.get("rtol"),
            atol=opts.get("atol"),
            allow_edition_mismatch=bool(opts.get("allow_edition_mismatch")),
            use_index=bool(opts.get("use_index", True)),
            calibration=str(cal) if cal is not None else None,
            find_calibration=bool(opts.get("find_calibration", True)),
        )


class _Binding(_M):
    """What a share is bound to: both runs (manifest ids, the sha256 of their COMPLETE), the options and
    the version that compared."""

    a: _SideBinding
    b: _SideBinding
    options: _Options
    version: _S


class _Covers(_M):
    ranks: _Spans
    steps: _Spans | None  # None: a share of ranks, every step
    of_ranks: _Spans  # every rank of either run


class _Payload(_M):
    """The `partial` object of a partial document."""

    format: Literal["disttrace-diff-partial/1"]
    note: _S
    covers: _Covers
    binding: _Binding
    run: _Run
    sides: _Sides
    steps: Annotated[list[_Step], Field(max_length=1 << 24)]

    @property
    def by_rank(self) -> bool:
        """A share of ranks (every step); else a share of steps (every rank)."""
        return self.covers.steps is None


_NOTE = (
    "a partial result: no verdict on the ranks or steps it does not cover; "
    "`disttrace diff --merge` combines the partials into the whole result"
)


# ---------------------------------------------------------------- one process's share


def _seal(side: _Side) -> str | None:
    """sha256 of the side's COMPLETE (it seals the lock, run.json and every rank's files); None if incomplete."""
    if not side.complete:
        return None
    return hashlib.sha256(safeio.read_bytes(side.path / COMPLETE, side.path, "json")).hexdigest()


def _setup(a, b, opts: dict, only=None, compare: bool = True) -> _Setup:
    return _Setup(
        a,
        b,
        opts.get("mode"),
        opts.get("rtol"),
        opts.get("atol"),
        bool(opts.get("allow_edition_mismatch")),
        bool(opts.get("use_index", True)),
        opts.get("calibration"),
        bool(opts.get("find_calibration", True)),
        only=only,
        compare=compare,
    )


def _payload(st: _Setup, outcomes, ranks: list[int], steps: list[int] | None, opts) -> _Payload:
    a, b = st.side_a, st.side_b
    return _Payload(
        format=FORMAT,
        note=_NOTE,
        covers=_Covers(
            ranks=_spans(ranks),
            steps=_spans(steps) if steps is not None else None,
            of_ranks=_spans(sorted(set(a.all_ranks) | set(b.all_ranks))),
        ),
        binding=_Binding(
            a=_SideBinding(manifest_id=a.run.manifest_id, seal=_seal(a)),
            b=_SideBinding(manifest_id=b.run.manifest_id, seal=_seal(b)),
            options=_Options.of(opts),
            version=__version__,
        ),
        run=_Run(
            mode=st.mode,
            topology_differs=[k for k, _, _ in st.topo],
            logical=st.logical,
            user=bool(st.tol.user),
            use_index=st.use_index,
            grid_ranks=_spans(st.grid_ranks),
            tolerance=_Tolerance.of(st.tolerance),
            pre=st.warnings[: st.n_pre],
            post=st.warnings[st.n_loaded : st.n_setup],
        ),
        sides=_Sides(a=_SideFacts.of(a), b=_SideFacts.of(b)),
        steps=[_Step.of(o) for o in outcomes],
    )


@dataclass(frozen=True)
class _Task:
    """One process's share: the runs, the options, and which ranks or steps it compares."""

    a: str
    b: str
    opts: dict
    ranks: list[int] | None  # these ranks (same topology); None: every rank
    steps: list[int] | None  # these steps (--steps); None: every compared step
    share: tuple[int, int] | None = None  # the k-th of n machines' share of the steps
    part: tuple[int, int] | None = None  # the k-th of n processes' share of the steps

    def payload(self) -> _Payload:
        only = set(self.ranks) if self.ranks is not None else None
        st = _setup(self.a, self.b, self.opts, only=only)
        steps = st.steps
        if self.steps is not None:
            want = set(self.steps)
            steps = [s for s in steps if s in want]
        for k, n in (x for x in (self.share, self.part) if x is not None):
            steps = steps[k * len(steps) // n : (k + 1) * len(steps) // n]  # contiguous blocks
        ranks = sorted(only & set(st.ranks)) if only is not None else st.ranks
        split = self.steps is not None or self.part is not None or bool(self.share)
        return _payload(st, st.outcomes(steps), ranks, steps if split else None, self.opts)


def _work(task: _Task):
    """The process pool's entry: ("ok", payload) or ("error", one line, exit code), never a traceback."""
    try:
        return ("ok", task.payload())
    except DisttraceError as e:
        return ("error", str(e), e.exit_code)


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["disttrace.analysis.partial"])
        return ctx
    return multiprocessing.get_context("spawn")


def _run_shares(tasks: list[_Task], jobs: int) -> list[_Payload]:
    """Every task's payload, in order: this process computes the first share while the pool (started
    meanwhile) computes the others."""
    if len(tasks) == 1:
        results = [_work(tasks[0])]
    else:
        workers = max(1, min(jobs - 1, len(tasks) - 1))
        with ProcessPoolExecutor(max_workers=workers, mp_context=_context()) as ex:
            pending = [ex.submit(_work, t) for t in tasks[1:]]
            results = [_work(tasks[0])] + [f.result() for f in pending]
    for r in results:
        if r[0] == "error":
            raise WorkerFailed(r[1], r[2])
    return [r[1] for r in results]


def _plan(
    a,
    b,
    opts: dict,
    jobs: int,
    ranks: list[int] | None,
    steps: list[int] | None,
    share: tuple[int, int] | None = None,
) -> list[_Task]:
    """The processes' shares: ranks split where the topologies are the same (each process reads only its
    ranks), steps across topologies (a step's ranks are read together). `share` (k, n): the k-th of n equal
    shares of the ranks (or, across topologies, of the steps), for the k-th of n machines."""
    st = _setup(a, b, opts, only=set(), compare=False)
    everyone = sorted(set(st.side_a.all_ranks) | set(st.side_b.all_ranks))
    step_share = None
    if share is not None:
        k, n = share
        if st.logical:
            step_share = share
        else:
            ranks = everyone[k * len(everyone) // n : (k + 1) * len(everyone) // n]
            if not ranks:
                raise BadInput(
                    "--share",
                    f"share {k}/{n} holds no rank: the runs have {len(everyone)} rank(s); "
                    "give at most that many shares",
                )
    if ranks is not None:
        if st.logical:
            raise BadInput(
                "--ranks",
                "a diff across topologies reads every rank of a step together (a logical tensor is "
                "combined from several ranks' shards, replicas are checked against each other); "
                "split it by steps with --steps",
            )
        chosen = [r for r in ranks if r in set(everyone)]
        if not chosen:
            raise BadInput(
                "--ranks",
                f"names none of the runs' ranks ({ranges(everyone) or 'none'})",
            )
    else:
        chosen = everyone
    if not st.logical and steps is None:
        n = max(1, min(jobs, len(chosen)))
        parts = [chosen[k * len(chosen) // n : (k + 1) * len(chosen) // n] for k in range(n)]
        return [_Task(str(a), str(b), opts, p, None) for p in parts]
    n = max(1, jobs)
    return [_Task(str(a), str(b), opts, None, steps, step_share, (k, n)) for k in range(n)]


# ---------------------------------------------------------------- combining payloads


def _combine(payloads: list[_Payload]) -> _Payload:
    """One payload from shares of one comparison (already checked to belong together)."""
    first = payloads[0]
    if len(payloads) == 1:
        return first
    by_rank = first.by_rank
    ranks = sorted({r for p in payloads for r in _unspan(p.covers.ranks)})
    steps = None if by_rank else sorted({s for p in payloads for s in _unspan(p.covers.steps)})
    covers = _Covers(
        ranks=_spans(ranks),
        steps=_spans(steps) if steps is not None else None,
        of_ranks=first.covers.of_ranks,
    )
    sides = first.sides
    if by_rank:

        def joined(label: str) -> _SideFacts:
            rs = {r: v for p in payloads for r, v in getattr(p.sides, label).rank_steps}
            rw = {r: v for p in payloads for r, v in getattr(p.sides, label).rank_warnings}
            return getattr(first.sides, label).model_copy(
                update={"rank_steps": sorted(rs.items()), "rank_warnings": sorted(rw.items())}
            )

        sides = _Sides(a=joined("a"), b=joined("b"))
    parts: dict[int, list[_Step]] = {}
    for p in payloads:
        for e in p.steps:
            parts.setdefault(e.step, []).append(e)
    steps_out = [_Step.joined(parts[s], by_rank) for s in sorted(parts)]
    return first.model_copy(update={"covers": covers, "sides": sides, "steps": steps_out})


class _SideView:
    """A side as `_compared_steps` reads it, rebuilt from a payload."""

    def __init__(self, f: _SideFacts, steps: list[int]):
        self.label, self.path, self.kind = f.label, Path(f.path), f.kind
        self.complete, self.resume_step, self.steps = f.complete, f.resume_step, steps
        self.manifest = {"training": {"steps": f.n_total}, "record": {"every": f.every}}


def _fold(payload: _Payload, whole: bool) -> DiffResult:
    """The result of a payload: the one-process result when it covers every rank and step (`whole`), else
    the result of what it covers."""
    run = payload.run
    warnings = list(run.pre)
    views, summaries = {}, {}
    held = {label: f.held() for label, f in payload.sides}
    for label, f in payload.sides:
        rank_steps = held[label]
        all_ranks = _unspan(f.all_ranks)
        steps = common_steps(rank_steps[r] for r in sorted(rank_steps))
        if not rank_steps and all_ranks and not whole:  # a share of ranks this side lacks
            other = held["b" if label == "a" else "a"]
            steps = common_steps(other[r] for r in sorted(other))
        rw = dict(f.rank_warnings)
        for r in sorted(rank_steps):
            warnings.extend(rw.get(r, ()))
        warnings.extend(side_warnings(f.label, Path(f.path), all_ranks, f.world, f.complete, steps))
        views[label] = _SideView(f, steps)
        summaries[label] = f.summary(steps)
    warnings.extend(run.post)
    steps, compared = _compared_steps(views["a"], views["b"])
    have = {e.step: e for e in payload.steps}
    if whole:
        _check_whole(payload, steps, have)
    fold = _Fold(run.mode, warnings)
    for s in steps:
        if s in have:
            fold.add(have[s].outcome(run.user))
    grid = _unspan(run.grid_ranks)
    if not whole and payload.by_rank:  # a share of ranks draws only its own rows
        mine = set(_unspan(payload.covers.ranks))
        grid = [r for r in grid if r in mine]
    return _result(
        fold,
        mode=run.mode,
        a=summaries["a"],
        b=summaries["b"],
        topo_differs=run.topology_differs,
        compared=compared,
        ranks=grid,
        tolerance=run.tolerance.tolerance(),
        use_index=run.use_index,
        warnings=warnings,
        logical=run.logical,
    )


def _check_whole(payload: _Payload, steps: list[int], have: dict[int, _Step]) -> None:
    """A merge holds every step every rank holds, and (same topology) every rank at each exactly once."""
    lacking = [s for s in steps if s not in have]
    if lacking:
        raise BadInput(
            "--merge",
            f"no partial holds step(s) {ranges(lacking)} of the steps every rank holds",
            field="steps",
        )
    if payload.run.logical:
        return
    of = _unspan(payload.covers.of_ranks)
    for s in steps:  # one process compares every rank at every step
        got = have[s].held_ranks()
        if got != of:
            raise BadInput(
                "--merge",
                f"step {s}: results of rank(s) {ranges(set(of) ^ set(got))} missing or twice",
                field="steps",
            )


# ---------------------------------------------------------------- the entry points


def diff_jobs(a, b, jobs: int, **opts) -> DiffResult:
    """diff_runs(a, b, **opts) computed in `jobs` processes: the same result."""
    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})", field="jobs")
    tasks = _plan(a, b, opts, jobs, None, None)
    if len(tasks) <= 1 and tasks and tasks[0].part is None:
        return diff_runs(a, b, **opts)
    return _fold(_combine(_run_shares(tasks, jobs)), whole=True)


class PartialDiff:
    """A partial diff: `result` is what its ranks (or steps) show, `payload` what a merge needs."""

    def __init__(self, payload: _Payload):
        self.payload = payload
        self.result = _fold(payload, whole=False)

    @property
    def covered(self) -> str:
        """What it read, in words: 'ranks 0..63' or 'steps 1..500'."""
        cov = self.payload.covers
        if cov.steps is None:
            return f"ranks {ranges(_unspan(cov.ranks))}"
        return f"steps {ranges(_unspan(cov.steps))}"

    @property
    def diverged(self) -> bool:
        return self.result.first_divergence is not None

    @property
    def exit_code(self) -> int:
        """1 when its share diverges (the runs differ, whatever the rest holds), else 4: no verdict."""
        return EXIT_DIVERGED if self.diverged else EXIT_PARTIAL

    def to_dict(self) -> dict:
        doc = self.result.to_dict()
        doc["equal"] = False if self.diverged else None
        return {"partial": self.payload.model_dump(), **doc}

    def to_json(self) -> str:
        from disttrace.jsondoc import dumps

        return dumps(self.to_dict())


def parse_share(text: str) -> tuple[int, int]:
    """'3/16' -> (3, 16): the 3rd (from 0) of 16 shares; anything else is BadInput naming --share."""
    k, sep, n = text.strip().partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit()):
        raise BadInput("--share", f"{text!r} is not K/N (this machine's index from 0, of N)")
    k_, n_ = int(k), int(n)
    if not 0 <= k_ < n_ or n_ > MAX_WORLD:
        raise BadInput("--share", f"{text!r}: K/N needs 0 <= K < N <= {MAX_WORLD}")
    return k_, n_


def diff_partial(
    a,
    b,
    *,
    ranks: list[int] | None = None,
    steps: list[int] | None = None,
    share: tuple[int, int] | None = None,
    jobs: int = 1,
    **opts,
) -> PartialDiff:
    """What `ranks` (same topology), `steps`, or the k-th of n `share`s of the comparison show, for a later
    merge_partials."""
    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})", field="jobs")
    if sum(x is not None for x in (ranks, steps, share)) > 1:
        raise BadInput("--ranks", "give one of --ranks, --steps and --share")
    tasks = _plan(a, b, opts, jobs, ranks, steps, share)
    return PartialDiff(_combine(_run_shares(tasks, jobs)))


# ---------------------------------------------------------------- reading partials someone else wrote


def _read_partial(path: Path) -> _Payload:
    import orjson

    with safeio.open_file(path, None, MAX_PARTIAL_BYTES) as f:  # a regular file, size-capped
        data = f.read(MAX_PARTIAL_BYTES + 1)
    if len(data) > MAX_PARTIAL_BYTES:
        raise BadInput(path, f"more than the {MAX_PARTIAL_BYTES} bytes a partial document may hold")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise BadInput(
            path, "not a JSON document (a `disttrace diff --ranks ... --json` partial)"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("partial"), dict):
        raise BadInput(
            path,
            "not a partial diff document (no 'partial' object: write one with "
            "`disttrace diff A B --ranks SPEC --json`)",
            field="partial",
        )
    try:
        payload = _Payload.model_validate(doc["partial"])
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in ("partial", *err["loc"]))
        raise BadInput(path, err["msg"].lower(), field=loc) from None
    _check_sizes(payload, path)
    return payload


def _span_count(spans, path, field: str, limit: int) -> int:
    """How many numbers `spans` name: each span low to high, all of them at most `limit` (they are
    expanded in memory)."""
    n = 0
    for lo, hi, *_ in spans:
        if hi < lo:
            raise BadInput(path, f"a span runs from {lo} down to {hi}", field=field)
        n += hi - lo + 1
        if n > limit:
            raise BadInput(path, f"names more than {limit}", field=field)
    return n


def _check_sizes(p: _Payload, path) -> None:
    _span_count(p.covers.ranks, path, "partial.covers.ranks", MAX_WORLD)
    _span_count(p.covers.of_ranks, path, "partial.covers.of_ranks", MAX_WORLD)
    if p.covers.steps is not None:
        _span_count(p.covers.steps, path, "partial.covers.steps", MAX_STEPS_HELD)
    _span_count(p.run.grid_ranks, path, "partial.run.grid_ranks", MAX_WORLD)
    held = 0
    for label, side in p.sides:
        _span_count(side.all_ranks, path, f"partial.sides.{label}.all_ranks", MAX_WORLD)
        for _, spans in side.rank_steps:
            held += _span_count(
                spans, path, f"partial.sides.{label}.rank_steps", MAX_STEPS_HELD - held
            )
    for n, e in enumerate(p.steps):
        _span_count(e.equal, path, f"partial.steps.{n}.equal", MAX_WORLD)


def _differing_field(x: BaseModel, y: BaseModel, skip=()) -> str | None:
    return next(
        (k for k in type(x).model_fields if k not in skip and getattr(x, k) != getattr(y, k)),
        None,
    )


def _belongs(first: _Payload, p: _Payload, where: Path, first_where: Path) -> None:
    """`p` is a share of the same comparison as `first`: the same runs (manifest ids, seals), options and
    version, the same facts of the runs."""
    for key in ("binding", "run"):
        sub = _differing_field(getattr(p, key), getattr(first, key))
        if sub is not None:
            raise BadInput(
                where,
                f"is not a share of the same comparison as {first_where}: its {key}.{sub} differs "
                "(other runs, other seals or other options)",
                field=f"partial.{key}.{sub}",
            )
    if p.covers.of_ranks != first.covers.of_ranks:
        raise BadInput(
            where, f"the runs' ranks differ from {first_where}'s", field="partial.covers.of_ranks"
        )
    for (label, x), (_, y) in zip(p.sides, first.sides):
        k = _differing_field(x, y, skip=("rank_steps", "rank_warnings"))
        if k is not None:
            raise BadInput(
                where,
                f"run {label.upper()}'s {k} differs from {first_where}'s",
                field=f"partial.sides.{label}.{k}",
            )


def _check_covers(payloads: list[_Payload], paths: list[Path]) -> None:
    """Together the partials cover every rank (or step) exactly once, each only what it says it covers."""
    first, first_where = payloads[0], paths[0]
    by_rank = [p.by_rank for p in payloads]
    if len(set(by_rank)) > 1:
        raise BadInput(
            paths[by_rank.index(not by_rank[0])],
            f"splits by {'ranks' if not by_rank[0] else 'steps'} and {first_where} by the other",
            field="partial.covers",
        )
    of = _unspan(first.covers.of_ranks)
    seen: dict[int, Path] = {}
    key = "ranks" if by_rank[0] else "steps"
    for p, where in zip(payloads, paths):
        mine = _unspan(getattr(p.covers, key))
        again = [x for x in mine if x in seen]
        if again:
            raise BadInput(
                where,
                f"{key} {ranges(again)} are also covered by {seen[again[0]]}",
                field=f"partial.covers.{key}",
            )
        seen.update(dict.fromkeys(mine, where))
        if key == "steps" and _unspan(p.covers.ranks) != of:
            raise BadInput(
                where, "a share of steps must cover every rank", field="partial.covers.ranks"
            )
        if key == "ranks":  # what it says it covers is what it holds
            held = {r for _, side in p.sides for r, _ in side.rank_steps}
            if not held <= set(mine):
                raise BadInput(where, "holds ranks it does not cover", field="partial.sides")
            if any(r not in set(mine) for e in p.steps for r in e.held_ranks()):
                raise BadInput(
                    where, "holds results of ranks it does not cover", field="partial.steps"
                )
        elif any(e.step not in set(mine) for e in p.steps):
            raise BadInput(where, "holds results of steps it does not cover", field="partial.steps")
    if key == "ranks":
        lacking = [r for r in of if r not in seen]
        if lacking:
            raise BadInput(
                "--merge",
                f"no partial covers rank(s) {ranges(lacking)} of {ranges(of)}",
                field="ranks",
            )


def merge_partials(paths: list[Path | str]) -> DiffResult:
    """The whole result from partial documents that together cover every rank (or step) exactly once."""
    if not paths:
        raise BadInput("--merge", "needs the partial documents to combine", field="merge")
    if len(paths) > MAX_PARTIALS:
        raise BadInput("--merge", f"more than {MAX_PARTIALS} partial documents", field="merge")
    paths = [Path(p) for p in paths]
    payloads = [_read_partial(p) for p in paths]
    for p, where in zip(payloads[1:], paths[1:]):
        _belongs(payloads[0], p, where, paths[0])
    _check_covers(payloads, paths)
    return _fold(_combine(payloads), whole=True)
