"""A partial document's limits and encodings, and its per-step parts as pydantic models: each compared step's
outcome (`_Step`), each rank's result in it (`_Rank`), its first divergent unit (`_Unit`, `_Stats`), and
where its bounds came from (`_Look`), each with `of` (from diff's comparison) and its way back."""

from __future__ import annotations

import math
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
)

from disttrace.analysis.diff.compare import RankStep
from disttrace.analysis.diff.fold import StepOutcome
from disttrace.analysis.result import BoundKind, RecordStats, Unit
from disttrace.errors import BadInput
from disttrace.store.rundir import MAX_WORLD

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
    """One side's record of a compared unit (`RecordStats`)."""

    digest: _S | None
    sum: _Num | None
    norm: _Num | None
    sketch: Annotated[list[_Num | None], Field(max_length=4096)] | None
    nonfinite: StrictInt | None
    dtype: _S | None
    shape: Annotated[list[StrictInt], Field(max_length=64)] | None
    numel: StrictInt | None

    @classmethod
    def of(cls, st: RecordStats | None) -> _Stats | None:
        if st is None:
            return None
        sk, shape = st.sketch, st.shape
        return cls(
            digest=st.digest,
            sum=_floats_only(st.sum),
            norm=_floats_only(st.norm),
            sketch=[_float(v) for v in sk] if sk is not None else None,
            nonfinite=_i(st.nonfinite),
            dtype=st.dtype,
            shape=[_i(v) for v in shape] if shape is not None else None,
            numel=_i(st.numel),
        )

    def stats(self) -> RecordStats:
        """As diff's comparison holds it."""
        out = {k: getattr(self, k) for k in type(self).model_fields}
        if self.sketch is not None:
            out["sketch"] = list(self.sketch)
        if self.shape is not None:
            out["shape"] = list(self.shape)
        return RecordStats(**out)


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
    """A rank's result at one step where something was not bit-equal (analysis/diff/compare.py's `RankStep`): every field
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
    def of(cls, rs: RankStep) -> _Rank:
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

    def rank_step(self) -> RankStep:
        rs = RankStep(self.t)
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
    # per (phase, tensor class), the bound where a calibration has classes (the sensitivity's figures)
    class_bounds: Annotated[list[tuple[_S, _S, _Num]], Field(max_length=4096)] = []
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
            class_bounds=[
                (p, c, _float(v))
                for p in phases
                for c, v in (look.class_bounds(o.step, p) or {}).items()
            ],
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
            self.class_bounds,
        )
        io = ((self.io[0], self.io[1]), (self.io[2], self.io[3]))
        per_rank = {r: v.rank_step() for r, v in self.ranks}
        for (
            lo,
            hi,
            total,
        ) in self.equal:  # (where nothing differed, the order of ranks does not matter)
            for r in range(lo, hi + 1):
                per_rank[r] = RankStep(total)
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
                "class_bounds": [x for e in parts for x in e.class_bounds],
                "events": [x for e in parts for x in e.events],
                "both": sorted({x for e in parts for x in e.both}),
            }
        )


def _span_ranks(spans) -> list[int]:
    return [r for lo, hi, _ in spans for r in range(lo, hi + 1)]


class _Look:
    """The answers a compared step's `_Tol` gave, as the fold asks for them."""

    def __init__(self, user: bool, kinds: dict, bounds: dict, class_bounds=()):
        self.user, self.kinds, self.bounds = user, kinds, bounds
        self.by_class: dict[str, dict[str, float]] = {}
        for p, c, v in class_bounds:
            self.by_class.setdefault(p, {})[c] = v

    def kind(self, step: int, phase: str, name: str | None = None) -> BoundKind:
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

    def class_bounds(self, step: int, phase: str) -> dict[str, float] | None:
        return self.by_class.get(phase)

    def derived(self, step: int, phase: str):
        return None  # only a default the fold never takes: every phase's error carries its bound
