"""What `diff_runs` returns: `DiffResult` and its parts (docs/design.md, "Order", "Equality").

Each part's fields are its `diff --json` keys, in the document's order; `DiffResult.to_json()` is the
document (`disttrace/jsondoc.py`). Views, the gate and the lab read attributes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from disttrace.jsondoc import JsonDoc, omit_none


class BoundKind(enum.StrEnum):
    """Where the bound a value is held to comes from."""

    BITWISE = "bitwise"  # no bound: digests must match
    USER = "user"  # explicit rtol / atol given by the caller
    CALIBRATED = "calibrated"  # measured run-to-run noise (`disttrace calibrate`)
    DERIVED = "derived"  # from the unit roundoff, reduction size and steps since agreement
    NONE = "none"  # no sound bound exists (a parameter under Adam): the error is reported, never judged

    @property
    def label(self) -> str:
        """How views name it next to a bound."""
        return {"bitwise": "bitwise", "user": "explicit"}.get(self.value, self.value)


@dataclass
class RecordStats(JsonDoc):
    """One side's record (or logical tensor) at a divergence: what its digest and statistics were."""

    digest: str | None = None
    sum: float | None = None
    norm: float | None = None
    sketch: list[float] | None = None
    nonfinite: int | None = None
    dtype: str | None = None
    shape: list[int] | None = None
    numel: int | None = None

    @classmethod
    def of(cls, rec: dict) -> RecordStats:
        return cls(
            digest=rec.get("digest"),
            sum=rec.get("sum"),
            norm=rec.get("norm"),
            sketch=rec.get("sketch"),
            nonfinite=rec.get("nonfinite"),
            dtype=rec.get("dtype"),
            shape=rec.get("shape"),
            numel=rec.get("numel"),
        )


@dataclass(slots=True)
class Unit:
    """diff's comparison unit: one record (or logical tensor) of both runs at a step, compared. `a` and `b`
    are each side's statistics (`RecordStats`), None where that side lacks it; `rel_err` None where no relative error exists (missing, non-finite)."""

    step: int
    micro_batch: int
    phase: str
    rank: int
    tensor: str | None
    index: int
    a: RecordStats | None
    b: RecordStats | None
    rel_err: float | None
    bound: float | None
    diverged: bool
    missing_in: str | None  # "a" | "b"
    note: str | None


@dataclass
class Divergence(JsonDoc):
    """The first divergence: the smallest (step, micro_batch, phase, rank, index) whose records differ or
    exist on one side only."""

    step: int
    micro_batch: int
    phase: str
    rank: int
    tensor: str | None
    index: int
    a: RecordStats | None
    b: RecordStats | None
    rel_err: float | None
    bound: float | None
    missing_in: str | None  # "a" | "b" | None
    note: str | None
    bound_kind: BoundKind

    @classmethod
    def of_unit(cls, unit: Unit, kind: BoundKind) -> Divergence:
        """From diff's comparison unit."""
        return cls(
            step=unit.step,
            micro_batch=unit.micro_batch,
            phase=unit.phase,
            rank=unit.rank,
            tensor=unit.tensor,
            index=unit.index,
            a=unit.a,
            b=unit.b,
            rel_err=unit.rel_err,
            bound=unit.bound,
            missing_in=unit.missing_in,
            note=unit.note,
            bound_kind=BoundKind(kind),
        )


@dataclass
class RankEntry(JsonDoc):
    """What one rank showed at one step. The error fields exist only where some tensor was not bit-equal."""

    differing: int
    total: int
    max_rel_err_by_phase: dict[str, float] = field(default_factory=dict)
    inexact: int = 0  # not bit-equal (within or beyond the bound)
    max_rel_err: float | None = None
    max_ratio: float | None = None  # largest error / bound
    hard: int = 0  # divergent without a relative error: missing, non-finite, shape

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "differing": self.differing,
            "total": self.total,
            "max_rel_err_by_phase": dict(self.max_rel_err_by_phase),
        }
        if self.inexact:
            d.update(
                inexact=self.inexact,
                max_rel_err=self.max_rel_err,
                max_ratio=self.max_ratio,
                hard=self.hard,
            )
        return d


@dataclass
class StepEntry(JsonDoc):
    """One compared step: per rank what differed; in numeric mode the bound each phase was held to."""

    step: int
    equal: bool
    differing: int
    ranks: dict[int, RankEntry]
    bound_by_phase: dict[str, float | None] | None = omit_none()
    bound_kind_by_phase: dict[str, BoundKind] | None = omit_none()

    def rank(self, r: int) -> RankEntry | None:
        return self.ranks.get(r)


@dataclass
class SideSummary(JsonDoc):
    """One run as diff read it."""

    path: str
    kind: str | None  # reference | fault | recovered (None: run.json does not say)
    complete: bool
    manifest_id: str | None
    resume_step: int | None
    ranks: list[int]
    steps: list[int] | None  # [first, last] of the steps every rank holds


@dataclass
class TopologyComparison(JsonDoc):
    same: bool
    differs: list[str]  # the topology fields that differ


@dataclass
class ComparedSteps(JsonDoc):
    first: int
    last: int
    count: int
    why: str  # why these steps (every gap and cut explained)
    full: bool  # every step of the manifest's training


@dataclass
class Tolerance(JsonDoc):
    """What the comparison was held to. `derivation` holds the bound's ingredients (analysis/tolerance.py's
    `explain`: formula, u, c, T, d, per_step) for derived and calibrated bounds."""

    kind: BoundKind
    bound: float | None = None  # bitwise: 0
    rtol: float | None = None  # user
    atol: float | None = None  # user
    file: str | None = None  # calibrated: the calibration file
    safety: Any = None  # calibrated: its safety factor
    manifest_id: str | None = None  # calibrated: the manifest it calibrates
    elsewhere: str | None = None  # calibrated: what holds where it measured nothing ("derived")
    since_step: int | None = None  # derived, calibrated: the step the runs last agreed at
    derivation: dict[str, Any] = field(default_factory=dict)
    # derived, calibrated: what a relative error is relative to: "magnitudes" (the ||X|| ||dY|| behind each
    # gradient, when both runs recorded them) or "norm" (each record's own norm)
    scale: str | None = None
    found: bool | None = None  # calibrated: the calibration was found beside the run (not named)

    @property
    def per_step(self) -> float | None:
        return self.derivation.get("per_step")

    def to_dict(self) -> dict[str, Any]:
        k = self.kind
        if k is BoundKind.BITWISE:
            return {"kind": k.value, "bound": self.bound}
        if k is BoundKind.USER:
            return {"kind": k.value, "rtol": self.rtol, "atol": self.atol}
        d: dict[str, Any] = {"kind": k.value}
        if k is BoundKind.CALIBRATED:
            d.update(
                file=self.file,
                safety=self.safety,
                manifest_id=self.manifest_id,
                elsewhere=self.elsewhere,
            )
            if self.found is not None:
                d["found"] = self.found
        d["since_step"] = self.since_step
        if self.scale is not None:
            d["scale"] = self.scale
        d.update(self.derivation)
        return d


@dataclass
class WorstRatio(JsonDoc):
    step: int
    rank: int
    rel_err: float
    bound: float


@dataclass
class PhaseWorst(JsonDoc):
    """Numeric mode, one phase: the largest relative error seen (and its bound), and the largest error to
    bound ratio (where it was)."""

    max_rel_err: float = -1.0
    bound: float | None = None
    ratio: float | None = None
    step: int = 0
    rank: int = 0
    bound_kind: BoundKind = BoundKind.DERIVED
    max_ratio: float | None = omit_none()
    max_ratio_at: WorstRatio | None = omit_none()


@dataclass
class NumericSummary(JsonDoc):
    by_phase: dict[str, PhaseWorst]
    by_step: list[StepEntry]  # steps before the first divergence with some inexact tensor


@dataclass
class DiffStats(JsonDoc):
    tensors_compared: int
    bit_equal: int
    steps_read: int  # (step, rank) pairs read; the others were skipped by their index digest
    index: bool
    steps_hash_checked: int


@dataclass
class RecordsRead(JsonDoc):
    a: int
    b: int


@dataclass
class DiffResult(JsonDoc):
    """The comparison of run B against run A (the `diff --json` document)."""

    equal: bool
    mode: str  # bitwise | numeric
    a: SideSummary
    b: SideSummary
    topology: TopologyComparison
    compared_steps: ComparedSteps
    ranks: list[int]  # the grid's rows: across topologies values are attributed to B's ranks
    first_divergence: Divergence | None
    propagation: list[StepEntry]  # from the first divergent step on
    recovered_steps: list[int]  # steps after the first divergence where everything is equal again
    tolerance: Tolerance
    stats: DiffStats
    records_read: RecordsRead  # records parsed, each side
    warnings: list[str]
    compared_phases: list[str] | None = omit_none()  # across topologies
    numeric: NumericSummary | None = omit_none()

    @property
    def divergent_steps(self) -> int:
        return len(self.propagation) - len(self.recovered_steps)

    def step_entries(self) -> dict[int, StepEntry]:
        """Every step the result holds an entry for (numeric steps before the divergence, then propagation)."""
        out = {e.step: e for e in (self.numeric.by_step if self.numeric else [])}
        out.update((e.step, e) for e in self.propagation)
        return out
