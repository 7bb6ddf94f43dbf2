"""`disttrace check RUN`: silent bugs inside one run, no reference needed.

Copies of a tensor that must be identical on several ranks (data-parallel replicas of reduced gradients,
parameters, optimizer state) stop being identical: that one signature covers a skipped all-reduce, a
flipped parameter bit, a skewed learning rate on one rank, a parameter replaced after wrapping. And shards
that must differ (each data-parallel rank reads its own data) must not be equal. The strategy writes the
map of which copies must agree (`replicas.json`); this module reads only the run store.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

from disttrace.analysis.consistency_columns import Columns
from disttrace.analysis.paged import Paged
from disttrace.analysis.replica_rules import Finding, judge, rule_applies
from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.store import safeio
from disttrace.store.documents import Replicas, parse_doc
from disttrace.store.jsonlines import read_json
from disttrace.store.records import PHASE_ORDER
from disttrace.store.rundir import Run


def load_rules(run: Run) -> Replicas | None:
    p = run.path / "replicas.json"
    return parse_doc(Replicas, read_json(p, run.path), p) if safeio.present(p) else None


@dataclass
class SpreadEntry(JsonDoc):
    step: int
    inconsistent: int
    minority_ranks: list[int]


@dataclass
class CheckResult(JsonDoc):
    """`disttrace check`: consistent True / False, or None when nothing could be checked (`reason`)."""

    consistent: bool | None
    reason: str | None = omit_none()
    first: Finding | None = None
    spread: list[SpreadEntry] = field(default_factory=list)
    rules: list[dict] | None = omit_none()  # replicas.json's rules, as stored
    steps_checked: int | None = omit_none()


def check_run(run: Run) -> CheckResult:
    rules = load_rules(run)
    if rules is None:
        return CheckResult(
            None, reason="nothing to check: no replicas.json (no replica map was written)"
        )
    stored = rules.as_read()["rules"]  # the document names them as replicas.json holds them
    ranks = run.ranks()
    indexes = {r: _spans(run, r) for r in ranks}
    held: set[int] = set()  # one set of the steps, not one a rank (~60 bytes a rank-step)
    for v in indexes.values():
        held.update(v)
    steps = sorted(held)
    del held
    findings, spread = [], []
    compared = 0  # (step, tensor) tables with two or more copies to hold against each other
    columns = Columns(run, rules) if ranks and all(_arrow(run, r) for r in ranks) else None
    for n, step in enumerate(steps):
        step_bad = columns.step(steps, n, indexes) if columns is not None else None
        if step_bad is None:  # JSON lines, or a step the columns hand back: the records
            by_rank = {
                r: run.records_of_step(r, indexes[r][step]) for r in ranks if step in indexes[r]
            }
            step_bad, n_compared = _check_step(step, by_rank, rules)
        else:
            step_bad, n_compared = step_bad
        compared += n_compared
        if step_bad:
            step_bad.sort(key=lambda f: (f.micro_batch, PHASE_ORDER[f.phase], f.index))
            findings.append(step_bad[0])
            spread.append(
                SpreadEntry(
                    step=step,
                    inconsistent=len(step_bad),
                    minority_ranks=sorted({r for f in step_bad for r in f.minority}),
                )
            )
    if (
        not compared
    ):  # no rule had two copies to compare: a pass here would claim what was never checked
        why = (
            "it states no replica rule"
            if not rules.rules
            else "no rule has two ranks' records to compare (one rank per group, or no records)"
        )
        return CheckResult(None, reason=f"nothing to check: {why}", rules=stored, steps_checked=0)
    first = findings[0] if findings else None
    return CheckResult(
        first is None, first=first, spread=spread, rules=stored, steps_checked=len(steps)
    )


def _check_step(step: int, by_rank: dict[int, list[dict]], rules: Replicas) -> tuple[list, int]:
    """One step on the records (the reference the columns are held to): the findings, and how many tensors
    had two or more copies to compare."""
    groups = rules.groups
    step_bad: list[Finding] = []
    compared = 0
    for rule in rules.rules:
        for members in groups[rule.dim]:
            present = [r for r in members if r in by_rank]
            if len(present) < 2:
                continue
            table: dict[tuple, dict[int, dict]] = {}
            for r in present:
                for rec in by_rank[r]:
                    if rule_applies(rule, rec):
                        table.setdefault((rec["micro_batch"], rec["index"], rec["tensor"]), {})[
                            r
                        ] = rec
            for (mb, index, tensor), recs in sorted(table.items()):
                compared += len(recs) >= 2
                digests = {r: rec["digest"] for r, rec in recs.items()}
                bad = judge(rule.relation, digests)
                if bad:
                    step_bad.append(
                        Finding(
                            step=step,
                            micro_batch=mb,
                            phase=rule.phase,
                            index=index,
                            tensor=tensor,
                            group=members,
                            relation=rule.relation,
                            **bad,
                        )
                    )
    return step_bad, compared


def _arrow(run: Run, rank: int) -> bool:
    from disttrace.store import trajectory_read

    return trajectory_read.is_arrow(run.trajectory_path(rank))


class _Span(NamedTuple):
    """What check reads of a step index line: where the step lies and how many records it holds."""

    step: int
    offset: int
    length: int
    records: int | None


class _Spans:
    """A rank's step index as check keeps it while it reads every rank: each step's offset, length and
    records in arrays by step (32 bytes a step; the spans as tuples in a dict took ~210, the validated
    lines ~2.6 KB, and held for every rank they were what check's memory grew by with the steps). An index
    of more than SPILL_STEPS steps is written out in pages of PAGE steps (analysis/paged.py), the last two
    read held, and of its steps only the first where they follow one another: what check holds of every
    rank's index then does not grow with the steps either."""

    SPILL_STEPS = 256
    PAGE = 64

    __slots__ = ("_first", "_step", "_cols")

    def __init__(self, lines):
        last = {
            e.step: (e.offset, e.length, e.records) for e in lines
        }  # a step twice: its last line
        steps = sorted(last)
        contiguous = bool(steps) and steps[-1] - steps[0] == len(steps) - 1
        self._first = steps[0] if contiguous else None
        self._step = None if contiguous else array("q", steps)
        self._cols = Paged(
            [
                array("q", (last[s][0] for s in steps)),
                array("q", (last[s][1] for s in steps)),
                array("q", (-1 if last[s][2] is None else last[s][2] for s in steps)),
            ],
            len(steps),
            self.SPILL_STEPS,
            self.PAGE,
        )

    def _at(self, step) -> int:
        if self._first is not None:
            i = step - self._first
            return i if 0 <= i < len(self._cols) else -1
        if self._step is None:
            return -1
        i = bisect.bisect_left(self._step, step)
        return i if i < len(self._step) and self._step[i] == step else -1

    def __contains__(self, step) -> bool:
        return self._at(step) >= 0

    def __getitem__(self, step) -> _Span:
        i = self._at(step)
        if i < 0:
            raise KeyError(step)
        (offset, length, records), j = self._cols.page(i)
        n = records[j]
        return _Span(step, offset[j], length[j], None if n < 0 else n)

    def __iter__(self):
        if self._first is not None:
            return iter(range(self._first, self._first + len(self._cols)))
        return iter(self._step if self._step is not None else ())

    def __len__(self) -> int:
        return len(self._cols)


def _spans(run: Run, rank: int) -> _Spans:
    return _Spans(run.step_index(rank).records)
