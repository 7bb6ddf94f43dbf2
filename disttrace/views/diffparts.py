"""The parts of a diff's rendering that the terminal, markdown and HTML views share: the tolerance's wording
(every bound kind), a bound with its kind, the A/B rows of the first divergence, how far it spread, the
rows of the propagation table, the steps a grid draws and the class of a rank x step grid cell. Each view
only styles them (rich, markdown, HTML); none re-derives them."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from disttrace.analysis.diff import sensitivity
from disttrace.analysis.result import (
    BoundKind,
    DiffResult,
    Divergence,
    RankEntry,
    RecordStats,
    StepEntry,
    Tolerance,
)
from disttrace.fmt import abbrev, agreeing_digits, fmt_number, ranges

DIGEST_CHARS = 16


def tolerance_text(tol: Tolerance) -> str:
    """What the comparison was held to, in words."""
    if tol.kind is BoundKind.BITWISE:
        return "bit for bit"
    if tol.kind is BoundKind.USER:
        return f"explicit rtol {fmt_number(tol.rtol, 'g')} atol {fmt_number(tol.atol, 'g')}"
    per_step = fmt_number(tol.per_step, ".2e")
    if tol.kind is BoundKind.CALIBRATED:
        found = " (found beside the run)" if tol.found else ""
        return f"calibrated bounds from {tol.file}{found} (derived {per_step} per step elsewhere)"
    scale = {
        "magnitudes": ", relative to the magnitudes behind each gradient",
        "norm": ", relative to each record's norm (no magnitudes recorded)",
    }.get(tol.scale or "", "")
    return f"derived bound {per_step} per step × steps since agreement{scale}"


def within_text(d: DiffResult) -> str:
    """What an equal verdict could not have seen (docs/tolerance.md, "Sensitivity"): "bit for bit" in bitwise
    mode; in numeric mode the largest bound any phase's records were held to, where, and the classes no
    sound bound covers."""
    if d.mode == "bitwise":
        return "bit for bit: any flipped bit would have been seen"
    by_phase = d.numeric.sensitivity if d.numeric is not None else {}
    w = sensitivity.worst(by_phase)
    if w is None:
        return "every record bit-equal: no bound was needed"
    phase, cls, v = w
    s = by_phase[phase]
    what = f"{phase}{' ' + cls if cls else ''}, step {s.step}"
    text = (
        f"equal to within {fmt_number(v, '.1e')} ({what})"
        if v is not None
        else f"equal to within the explicit rtol/atol ({what}: relative to each record's scale)"
    )
    blind = sorted(
        f"{p} {c}"
        for p, e in by_phase.items()
        for c, x in (e.classes or {}).items()
        if x == sensitivity.NONE
    )
    if blind:
        text += f"; no bound, so nothing seen there: {', '.join(blind)}"
    return text


SENSITIVITY_COLUMNS = ("phase", "largest bound", "median", "at step", "bound")


def sensitivity_rows(d: DiffResult) -> list[tuple[str, str, str, str, str]]:
    """The sensitivity table: (phase or phase class, largest bound, median, at step, bound kind) a row."""
    if d.numeric is None:
        return []
    rows = []
    for phase, s in d.numeric.sensitivity.items():
        kind = s.bound_kind.label
        rows.append(
            (phase, fmt_number(s.max, ".2e"), fmt_number(s.median, ".2e"), str(s.step), kind)
        )
        for cls, v in (s.classes or {}).items():
            if isinstance(v, str):
                rows.append((f"{phase} {cls}", "none (not seen)", "-", "-", "none"))
            else:
                rows.append((f"{phase} {cls}", fmt_number(v, ".2e"), "-", str(s.step), kind))
    return rows


def bound_text(bound: float | None, kind: BoundKind, digits: str = ".3e") -> str:
    """A bound and where it comes from: `0 (bitwise)`, `1.2e-06 (derived)`, `- (explicit)` where an
    explicit atol makes the relative bound depend on the scale."""
    if kind is BoundKind.BITWISE:
        return "0 (bitwise)"
    return f"{fmt_number(bound, digits)} ({kind.label})"


@dataclass
class Row:
    """One row of the A/B table: a label and each side's text; `alert` marks a row to emphasise."""

    label: str
    a: str
    b: str
    alert: bool = False
    code: bool = False  # a digest: monospace where the medium has it


def ab_rows(f: Divergence) -> list[Row]:
    """The first divergence side by side: presence, digest, sum, norm, non-finite count, dtype and shape."""
    a, b = f.a or RecordStats(), f.b or RecordStats()
    rows = []
    if f.missing_in:
        pair = ("missing", "present") if f.missing_in == "a" else ("present", "missing")
        rows.append(Row("record", *pair, alert=True))
    rows += [
        Row("digest", abbrev(a.digest, DIGEST_CHARS), abbrev(b.digest, DIGEST_CHARS), code=True),
        Row("sum", fmt_number(a.sum, ".10g"), fmt_number(b.sum, ".10g")),
        Row("norm", fmt_number(a.norm, ".10g"), fmt_number(b.norm, ".10g")),
        Row(
            "non-finite",
            fmt_number(a.nonfinite),
            fmt_number(b.nonfinite),
            alert=bool(a.nonfinite or b.nonfinite),
        ),
        Row(
            "dtype, shape",
            f"{a.dtype} {a.shape}" if f.a else "-",
            f"{b.dtype} {b.shape}" if f.b else "-",
        ),
    ]
    return rows


def error_text(f: Divergence, mode: str) -> str:
    """The first divergence's error against its bound, and the note (non-finite, shape differs...)."""
    return (
        f"rel err {fmt_number(f.rel_err, '.3e')} vs bound "
        + bound_text(f.bound, BoundKind.BITWISE if mode == "bitwise" else f.bound_kind)
        + (f" ({f.note})" if f.note else "")
    )


def spread_text(d: DiffResult) -> str:
    """How far the first divergence spread: its divergent steps, and the steps where the runs are equal
    again (a result that diverged)."""
    msg = f"{d.divergent_steps} divergent step(s) from step {d.first_divergence.step}"
    if d.recovered_steps:
        msg += f"; equal again at step(s) {ranges(d.recovered_steps)}"
    return msg


@dataclass
class PropagationRow:
    """One step of the propagation table."""

    step: int
    ranks: list[str]  # the ranks with a tensor beyond its bound
    differing: int  # tensors beyond their bound, over every rank
    total: int  # tensors compared, over every rank
    max_rel_err: float | None  # the largest relative error of any rank (None: none was taken)
    phases: list[str]  # the phases with a relative error
    worst_bound: tuple[float, BoundKind] | None  # the largest bound of a phase, and its kind


def propagation_row(ent: StepEntry) -> PropagationRow:
    ranks = ent.ranks.values()
    rels = [v.max_rel_err for v in ranks if v.max_rel_err is not None]
    kinds = ent.bound_kind_by_phase or {}
    bounds = [
        (b, kinds.get(p, BoundKind.DERIVED))
        for p, b in (ent.bound_by_phase or {}).items()
        if b is not None
    ]
    return PropagationRow(
        step=ent.step,
        ranks=[str(k) for k, v in ent.ranks.items() if v.differing],
        differing=ent.differing,
        total=sum(v.total for v in ranks),
        max_rel_err=max(rels) if rels else None,
        phases=sorted({p for v in ranks for p in v.max_rel_err_by_phase}),
        worst_bound=max(bounds, key=lambda bk: bk[0]) if bounds else None,
    )


def grid_steps(d: DiffResult, width: int, lead: int) -> list[int]:
    """The steps a grid `width` steps wide draws: the compared steps from the first, or, where the first
    divergence lies past the width's last `2 * lead` steps, from `lead` steps before it."""
    cs = d.compared_steps
    first, last = cs.first, cs.last
    f = d.first_divergence
    start = first
    if f and f.step - first > width - 2 * lead:
        start = max(first, f.step - lead)
    return list(range(start, min(last, start + width - 1) + 1))


class CellClass(enum.StrEnum):
    """What one rank showed at one step, as the grid draws it."""

    EQUAL = "equal"  # every tensor bit-identical
    WITHIN = "within"  # some bits differ, every value within its bound
    BEYOND = "beyond"  # some value beyond its bound (labelled by the digits that still agree)
    HARD = "hard"  # a divergence without a relative error: missing, non-finite, shape, bits only

    @property
    def legend(self) -> str:
        return {
            "equal": "bit-identical",
            "within": "inexact, within the bound",
            "beyond": "beyond the bound",
            "hard": "missing, non-finite or bits only",
        }[self.value]


@dataclass
class Cell:
    cls: CellClass
    digits: int | None  # decimal digits the worst tensor still agrees to (None: no relative error)
    entry: RankEntry | None

    @property
    def description(self) -> str:
        e = self.entry
        if e is None:
            return "bit-identical"
        if self.cls is CellClass.EQUAL:
            return f"bit-identical ({e.total} tensors)"
        by_phase = ", ".join(f"{p} {v:.1e}" for p, v in e.max_rel_err_by_phase.items())
        desc = f"{e.differing}/{e.total} tensors differ; max rel err {fmt_number(e.max_rel_err, '.2e')}"
        desc += f" ({by_phase})" if by_phase else ""
        if e.hard:
            desc += f"; {e.hard} missing, non-finite or bits-only"
        return ("within the bound: " if self.cls is CellClass.WITHIN else "") + desc


def cell(entry: RankEntry | None) -> Cell:
    """The one classification every grid uses."""
    if entry is None or not entry.inexact:
        return Cell(CellClass.EQUAL, None, entry)
    rel = entry.max_rel_err
    # equal statistics with other bits (rel err 0) agree to every digit shown
    digits = agreeing_digits(rel) if rel else (9 if rel == 0 else None)
    if not entry.differing:
        return Cell(CellClass.WITHIN, digits, entry)
    if entry.hard or not rel:
        return Cell(CellClass.HARD, None, entry)
    return Cell(CellClass.BEYOND, digits, entry)


# ---------------------------------------------------------------- zoom (docs/zoom.md)


def zoom_headline(z) -> str:
    """What the zoom found inside the step, in one line (a `ZoomResult`)."""
    return f"ZOOM ({z.depth} depth): {z.inside}"


def zoom_rows(z) -> list[tuple[str, str]]:
    """(label, text) rows of where inside the step the runs first differ, and where the records came from."""
    f, d = z.first_divergence, z.deep
    rows: list[tuple[str, str]] = []
    at = f.at_depth if f is not None else None
    if at is not None:
        rows.append(("module", f.module or "(outside every module)"))
        rows.append(
            (
                "direction",
                f"{f.direction} ({'output gradient' if f.direction == 'backward' else 'output'})",
            )
        )
        if f.op is not None:
            rows.append(("op", f"{f.op} (index {f.op_index} in its module call)"))
        rows.append(
            (
                "where",
                "logical tensor over the step's batch (both layouts' pieces combined)"
                if at.micro_batch is None
                else f"micro-batch {at.micro_batch} · rank {at.rank} · call {at.call}",
            )
        )
    if d is not None:
        rows.append(
            (
                "depth records",
                f"A {d.a} ({d.records.a}), B {d.b} ({d.records.b}); {d.compared} compared; "
                + ("re-run from the start" if d.produced_by == "rerun" else d.produced_by),
            )
        )
    return rows


def zoom_ab_rows(z) -> list[Row]:
    """Both sides' values at the first deep record that differs (the A/B rows of `ab_rows`)."""
    f = z.first_divergence
    return ab_rows(f.at_depth) if f is not None and f.at_depth is not None else []


def zoom_error_text(z) -> str | None:
    f = z.first_divergence
    if f is None or f.at_depth is None:
        return None
    return error_text(f.at_depth, z.mode)
