"""Copies of one tensor that must agree (or, each rank's own data, differ): which records a replica rule
covers, and the finding that names the odd rank(s) out when a group of copies breaks its rule."""

from __future__ import annotations

import fnmatch
from collections import Counter
from dataclasses import dataclass

from disttrace.jsondoc import JsonDoc
from disttrace.store.documents import ReplicaRule


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


def name_applies(rule: ReplicaRule, name: str) -> bool:
    pats = [rule.tensors] if isinstance(rule.tensors, str) else rule.tensors
    return any(fnmatch.fnmatchcase(name, x) for x in pats) and not (
        rule.exclude is not None and fnmatch.fnmatchcase(name, rule.exclude)
    )


def judge(relation: str, digests: dict[int, str]) -> dict | None:
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
