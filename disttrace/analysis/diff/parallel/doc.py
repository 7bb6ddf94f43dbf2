"""A partial document's run-level parts as pydantic models: each side's facts (`_SideFacts`), the
tolerance, the comparison's settings, what it is bound to and covers, and the `partial` object itself
(`_Payload`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
)

from disttrace.analysis.diff.parallel.steps import (
    _M,
    _S,
    _BoundKind,
    _Count,
    _Num,
    _Spans,
    _spans,
    _Step,
    _unspan,
)
from disttrace.analysis.diff.side import Side
from disttrace.analysis.result import BoundKind, SideSummary, Tolerance
from disttrace.config.identity import get_field
from disttrace.store.rundir import MAX_WORLD


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
    def of(cls, side: Side) -> _SideFacts:
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
    sensitivity_classes: dict[_S, dict[_S, _Num | _S]] | None = Field(default=None, max_length=64)

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
