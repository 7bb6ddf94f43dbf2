"""`disttrace check RUN`: silent bugs inside one run, no reference needed.

Copies of a tensor that must be identical on several ranks (data-parallel replicas of reduced gradients,
parameters, optimizer state) stop being identical: that one signature covers a skipped all-reduce, a
flipped parameter bit, a skewed learning rate on one rank, a parameter replaced after wrapping. And shards
that must differ (each data-parallel rank reads its own data) must not be equal. The strategy writes the
map of which copies must agree (`replicas.json`); this module reads only the run store.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass, field

from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.store import safeio
from disttrace.store.records import ReplicaRule, Replicas, parse_doc
from disttrace.store.rundir import PHASE_ORDER, Run, read_json


def load_rules(run: Run) -> Replicas | None:
    p = run.path / "replicas.json"
    return parse_doc(Replicas, read_json(p, run.path), p) if safeio.present(p) else None


def rule_applies(rule: ReplicaRule, rec: dict) -> bool:
    """Does replica rule `rule` cover record `rec` (its phase, tensor patterns, exclusion)?"""
    pats = [rule.tensors] if isinstance(rule.tensors, str) else rule.tensors
    return (
        rec["phase"] == rule.phase
        and any(fnmatch.fnmatchcase(rec["tensor"], x) for x in pats)
        and not (rule.exclude is not None and fnmatch.fnmatchcase(rec["tensor"], rule.exclude))
    )


@dataclass
class Finding(JsonDoc):
    """Copies of one tensor in one replica group that break their rule (agree, or differ)."""

    step: int
    micro_batch: int
    phase: str
    index: int
    tensor: str
    group: list[int]
    relation: str  # agree | differ
    majority: list[int]
    minority: list[int]  # the suspects: the odd ranks out (every disagreeing rank on a tie)
    tie: bool
    digests: dict[str, str]  # rank -> digest
    message: str


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
    groups = rules.groups
    stored = rules.as_read()["rules"]  # the document names them as replicas.json holds them
    ranks = run.ranks()
    indexes = {r: {e.step: e for e in run.step_index(r).records} for r in ranks}
    steps = sorted(set().union(*[set(v) for v in indexes.values()])) if indexes else []
    findings, spread = [], []
    compared = 0  # (step, tensor) tables with two or more copies to hold against each other
    for step in steps:
        by_rank = {r: run.records_of_step(r, indexes[r][step]) for r in ranks if step in indexes[r]}
        step_bad: list[Finding] = []
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
                    bad = _judge(rule.relation, digests)
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


def _judge(relation: str, digests: dict[int, str]) -> dict | None:
    """Name the odd rank(s) out. With two copies (or a tie) there is no majority to trust: every
    disagreeing rank is a suspect and the finding says so."""
    if relation == "agree":
        if len(set(digests.values())) <= 1:
            return None
        counts = Counter(digests.values())
        top = max(counts.values())
        leaders = [d for d, c in counts.items() if c == top]
        if len(leaders) > 1:
            return {
                "majority": [],
                "minority": sorted(digests),
                "tie": True,
                "digests": {str(r): d for r, d in digests.items()},
                "message": f"copies that must be identical differ, with no majority among {len(digests)} copies",
            }
        majority = leaders[0]
        return {
            "majority": sorted(r for r, d in digests.items() if d == majority),
            "minority": sorted(r for r, d in digests.items() if d != majority),
            "tie": False,
            "digests": {str(r): d for r, d in digests.items()},
            "message": "copies that must be identical differ",
        }
    # "differ": each member must hold its own data; ranks that share one are the suspects
    counts = Counter(digests.values())
    shared = sorted(r for r, d in digests.items() if counts[d] > 1)
    if not shared:
        return None
    return {
        "majority": sorted(set(digests) - set(shared)),
        "minority": shared,
        "tie": False,
        "digests": {str(r): d for r, d in digests.items()},
        "message": f"ranks {shared} read identical data: data-parallel shards must differ",
    }
