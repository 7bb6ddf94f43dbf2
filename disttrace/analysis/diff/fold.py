"""Folding compared steps, in step order, into the result: the first divergence, propagation, recovered
steps, the numeric summary, the counts (`Fold`), and the `DiffResult` they make (`fold_result`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disttrace.analysis.diff.compare import RankStep, _phase_order
from disttrace.analysis.diff.logical import CROSS_TOPOLOGY_PHASES, Warned
from disttrace.analysis.diff.sensitivity import Sensitivity
from disttrace.analysis.diff.tol import _Tol
from disttrace.analysis.result import (
    ComparedSteps,
    DiffResult,
    DiffStats,
    Divergence,
    NumericSummary,
    PhaseWorst,
    RecordsRead,
    SideSummary,
    StepEntry,
    StepTable,
    Tolerance,
    TopologyComparison,
    WorstRatio,
)

_MISSING = object()


def _worst_by_phase(by_phase: dict[str, PhaseWorst], step: int, per_rank: dict, tol: _Tol) -> None:
    """Numeric mode: keep, per phase, the largest relative error seen and the largest error-to-bound ratio."""
    for r, rs in per_rank.items():
        if rs.first is None and rs.inexact == 0:
            continue
        for phase, rel in rs.max_rel.items():
            cur = by_phase.get(phase)
            if cur is None:
                cur = by_phase[phase] = PhaseWorst()
            if rel > cur.max_rel_err:
                bnd = None
                if (
                    not tol.user
                ):  # the tensor's own bound, else the step's (asked only when missing)
                    bnd = rs.max_rel_bound.get(phase, _MISSING)
                    if bnd is _MISSING:
                        bnd = tol.derived(step, phase)
                cur.max_rel_err, cur.bound, cur.ratio = rel, bnd, rel / bnd if bnd else None
                cur.step, cur.rank, cur.bound_kind = step, r, tol.kind(step, phase)
        for phase, (ratio, rel, bnd) in rs.ratio_by_phase.items():
            cur = by_phase[phase]
            if cur.max_ratio is None or ratio > cur.max_ratio:
                cur.max_ratio, cur.max_ratio_at = ratio, WorstRatio(step, r, rel, bnd)


@dataclass(slots=True)
class StepOutcome:
    """One compared step as the fold reads it: each rank's result (in the order the comparison produced
    them), the (step, rank) pairs read, each side's [records parsed, ranges hash-checked], the warnings the
    step raised, the phases both runs record (across topologies), and where the bounds come from (`look`:
    `.user`, `.kind(step, phase, name)`, `.compare_bound(step, phase)`, `.class_bounds(step, phase)`,
    `.derived(step, phase)`; the comparison's `_Tol` in the process that compared it, a table of the same
    answers in a merge)."""

    step: int
    per_rank: dict[int, RankStep]
    read: int
    io: tuple  # A's (records parsed, ranges hash-checked), B's
    events: list[tuple[str, str]]  # (kind, text), StepWarnings.events
    both: set[str] | list[str]
    look: Any  # _Tol, or partial's table of its answers


class Fold:
    """The result's step-wise parts, from the compared steps in order: the first divergence, propagation,
    recovered steps, numeric summary, counts, and the comparison's warnings."""

    def __init__(self, mode: str, warnings: list[str]):
        self.mode = mode
        self.first_div: Divergence | None = None
        self.first_step: int | None = None
        self.propagation: list[StepEntry] = []
        self.recovered: list[int] = []
        # numeric: per-step errors of steps before the first divergence, as columns
        self.by_step = StepTable()
        self.by_phase: dict[str, PhaseWorst] = {}
        self.sensitivity = Sensitivity()  # numeric: the bound each phase was held to, step by step
        self.n_units = self.n_exact = 0
        self.read_steps = 0
        self.records = [0, 0]
        self.hashed = 0
        self.warned = Warned(warnings)

    def add(self, o: StepOutcome) -> bool:
        """Fold one step in; True once the first divergence has been seen."""
        step, per_rank, look = o.step, o.per_rank, o.look
        self.read_steps += o.read
        (ra, ha), (rb, hb) = o.io
        self.records[0] += ra
        self.records[1] += rb
        self.hashed += ha + hb
        self.warned.replay(o.events, o.both)
        for rs in per_rank.values():
            self.n_units += rs.total
            self.n_exact += rs.total - rs.inexact
        if self.mode == "numeric":
            _worst_by_phase(self.by_phase, step, per_rank, look)
        diverged_here = [rs for rs in per_rank.values() if rs.differing]
        if self.first_step is None and diverged_here:
            self.first_step = step
            key, unit = min((rs.first for rs in diverged_here), key=lambda fu: fu[0])
            self.first_div = Divergence.of_unit(unit, look.kind(step, unit.phase, unit.tensor))
        entry = StepEntry(
            step=step,
            equal=not diverged_here,
            differing=sum(rs.differing for rs in per_rank.values()),
            ranks={r: per_rank[r].entry() for r in sorted(per_rank)},
        )
        if self.mode == "numeric":  # the bound each phase's errors at this step are held to
            phases = sorted({p for rs in per_rank.values() for p in rs.max_rel}, key=_phase_order)
            entry.bound_by_phase = {p: look.compare_bound(step, p) for p in phases}
            entry.bound_kind_by_phase = {p: look.kind(step, p) for p in phases}
            for p in phases:
                self.sensitivity.add(
                    step,
                    p,
                    entry.bound_by_phase[p],
                    entry.bound_kind_by_phase[p],
                    look.class_bounds(step, p),
                )
        if self.first_step is not None:
            self.propagation.append(entry)
            if not diverged_here:
                self.recovered.append(step)
            return True
        if self.mode == "numeric" and any(rs.inexact for rs in per_rank.values()):
            self.by_step.append(entry)
        return False


def fold_result(
    fold: Fold,
    *,
    mode: str,
    a: SideSummary,
    b: SideSummary,
    topo_differs: list[str],
    compared: ComparedSteps,
    ranks: list[int],
    tolerance: Tolerance,
    use_index: bool,
    warnings: list[str],
    logical: bool,
) -> DiffResult:
    return DiffResult(
        equal=fold.first_div is None,
        mode=mode,
        a=a,
        b=b,
        topology=TopologyComparison(same=not topo_differs, differs=list(topo_differs)),
        compared_steps=compared,
        ranks=ranks,
        first_divergence=fold.first_div,
        propagation=fold.propagation,
        recovered_steps=fold.recovered,
        tolerance=tolerance,
        stats=DiffStats(
            tensors_compared=fold.n_units,
            bit_equal=fold.n_exact,
            steps_read=fold.read_steps,
            index=use_index,
            steps_hash_checked=fold.hashed,
        ),
        records_read=RecordsRead(a=fold.records[0], b=fold.records[1]),
        warnings=warnings,
        compared_phases=[p for p in CROSS_TOPOLOGY_PHASES if p in fold.warned.both]
        if logical
        else None,
        numeric=NumericSummary(
            by_phase=dict(sorted(fold.by_phase.items(), key=lambda kv: _phase_order(kv[0]))),
            sensitivity=dict(
                sorted(
                    fold.sensitivity.result(tolerance.sensitivity_classes).items(),
                    key=lambda kv: _phase_order(kv[0]),
                )
            ),
            by_step=fold.by_step,
        )
        if mode == "numeric"
        else None,
    )
