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
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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
    stored = rules.as_read()["rules"]  # the document names them as replicas.json holds them
    ranks = run.ranks()
    indexes = {r: _spans(run, r) for r in ranks}
    steps = sorted(set().union(*[set(v) for v in indexes.values()])) if indexes else []
    findings, spread = [], []
    compared = 0  # (step, tensor) tables with two or more copies to hold against each other
    columns = _Columns(run, rules) if ranks and all(_arrow(run, r) for r in ranks) else None
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
    return step_bad, compared


def _arrow(run: Run, rank: int) -> bool:
    from disttrace.store import trajectory

    return trajectory.is_arrow(run.trajectory_path(rank))


class _Span(NamedTuple):
    """What check reads of a step index line: where the step lies and how many records it holds."""

    step: int
    offset: int
    length: int
    records: int | None


def _spans(run: Run, rank: int) -> dict[int, _Span]:
    """The rank's step index as check keeps it while it reads every rank (~200 bytes a step: the validated
    lines, ~2 KB a step, held for every rank, were what its memory grew by with the number of steps)."""
    return {
        e.step: _Span(e.step, e.offset, e.length, e.records) for e in run.step_index(rank).records
    }


BLOCK_ROWS = 1 << 16  # records of all ranks decoded together (a block of steps), at least one step


class _Columns:
    """The check of a step on Arrow columns: every rank's batch of the step side by side, each rule's rows
    selected once (its tensor patterns matched once per distinct name), and the copies of each tensor in
    each group compared as 16-byte digests sorted by (group, micro-batch, index, tensor); the few tensors
    whose copies break their rule are judged by `_judge`, as on the records. A step a rank holds twice
    the same key in, or without a name or phase, is handed back to the record path (None). Steps are
    decoded a block at a time per rank (trajectory.decode_steps)."""

    def __init__(self, run: Run, rules: Replicas):
        self.run = run
        self.rules = rules.rules
        self.groups = rules.groups
        self.names: list[dict[str, bool]] = [{} for _ in self.rules]
        self.ahead: dict[int, dict] = {}

    def step(self, steps: list[int], n: int, indexes: dict) -> tuple[list, int] | None:
        step = steps[n]
        if step not in self.ahead:
            self.ahead = self._read(steps, n, indexes)
        by_rank = self.ahead.pop(step)
        return _check_step_columns(step, by_rank, self.rules, self.groups, self.names)

    def _read(self, steps: list[int], n: int, indexes: dict) -> dict[int, dict]:
        from disttrace.store import trajectory

        block, rows = [], 0
        for s in steps[n:]:
            rows += sum(int(ix[s].records or 0) for ix in indexes.values() if s in ix)
            if block and rows > BLOCK_ROWS:
                break
            block.append(s)
        out: dict[int, dict] = {s: {} for s in block}
        for r, ix in indexes.items():
            have = [s for s in block if s in ix]
            if not have:
                continue
            path = self.run.trajectory_path(r)
            parts = [
                (
                    trajectory.read_range(path, ix[s].offset, ix[s].length, self.run.path),
                    f"step {s} (bytes {ix[s].offset}..{ix[s].offset + ix[s].length})",
                )
                for s in have
            ]
            batch, starts = trajectory.decode_steps(path, parts)
            ends = np.append(starts[1:], batch.num_rows)
            for s, a, b in zip(have, starts.tolist(), ends.tolist()):
                out[s][r] = batch.slice(a, b - a)
        return out


def _name_applies(rule: ReplicaRule, name: str) -> bool:
    pats = [rule.tensors] if isinstance(rule.tensors, str) else rule.tensors
    return any(fnmatch.fnmatchcase(name, x) for x in pats) and not (
        rule.exclude is not None and fnmatch.fnmatchcase(name, rule.exclude)
    )


@dataclass
class _StepColumns:
    """One step's records of every rank side by side, as the columns' check reads them: each row's rank (the
    file's), tensor (a code into `names`), micro-batch, index, phase and digest (16 raw bytes, as two
    64-bit halves, and whether it is a device checksum)."""

    rank: np.ndarray
    code: np.ndarray
    names: list
    mb: np.ndarray
    index: np.ndarray
    phase: pa.Array
    raw: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    dev: np.ndarray

    @classmethod
    def of(cls, by_rank: dict) -> _StepColumns | None:
        """None where a row lacks a name or phase (the record path judges the step)."""
        ranks = list(by_rank)
        batch = pa.concat_batches([by_rank[r] for r in ranks])
        if batch.column("tensor").null_count or batch.column("phase").null_count:
            return None
        rank = np.repeat(
            np.array(ranks, dtype=np.int64), [by_rank[r].num_rows for r in ranks]
        )  # the file's rank, as the record path keys them
        tensor = batch.column("tensor")
        distinct = pc.unique(tensor)
        code = np.asarray(pc.index_in(tensor, value_set=distinct).to_numpy(), dtype=np.int64)
        digest = batch.column("digest")
        raw = np.frombuffer(digest.buffers()[1], dtype=np.uint8)[
            digest.offset * 16 : (digest.offset + len(digest)) * 16
        ]
        hi, lo = raw.reshape(-1, 16).view("<u8").T
        return cls(
            rank=rank,
            code=code,
            names=distinct.to_pylist(),
            mb=np.asarray(
                batch.column("micro_batch").to_numpy(zero_copy_only=False), dtype=np.int64
            ),
            index=np.asarray(batch.column("index").to_numpy(zero_copy_only=False), dtype=np.int64),
            phase=batch.column("phase"),
            raw=raw,
            hi=hi,
            lo=lo,
            dev=np.asarray(
                batch.column("device_digest").to_numpy(zero_copy_only=False), dtype=bool
            ),
        )


def _check_step_columns(
    step: int, by_rank: dict, rules: list, groups: dict, names: list
) -> tuple[list, int] | None:
    if not by_rank:
        return [], 0
    c = _StepColumns.of(by_rank)
    if c is None:
        return None
    findings: list[Finding] = []
    compared = 0
    for k, rule in enumerate(rules):
        got = _check_rule(step, c, rule, groups[rule.dim], names[k], by_rank)
        if got is None:
            return None
        found, n = got
        findings += found
        compared += n
    return findings, compared


def _rule_rows(c: _StepColumns, rule, member_groups, cache: dict, by_rank: dict):
    """The rows `rule` covers in groups of two ranks or more holding the step, and each row's group; None
    where a rank is in two groups of one dimension (group by group, on the records)."""
    applies = np.array(
        [
            cache[nm] if nm in cache else cache.setdefault(nm, _name_applies(rule, nm))
            for nm in c.names
        ],
        dtype=bool,
    )
    is_phase = np.asarray(pc.equal(c.phase, rule.phase).to_numpy(zero_copy_only=False), dtype=bool)
    rows = np.nonzero(is_phase & applies[c.code])[0]
    none = np.zeros(0, dtype=np.int64)
    if not rows.size:
        return none, none
    gid = {}  # rank -> its group's position, for the groups with two ranks or more holding the step
    for g, members in enumerate(member_groups):
        present = [r for r in members if r in by_rank]
        if len(present) < 2:
            continue
        for r in present:
            if r in gid:  # a rank in two groups of one dimension: group by group, on the records
                return None
            gid[r] = g
    if not gid:
        return none, none
    lookup = np.full(max(by_rank) + 1, -1, dtype=np.int64)
    lookup[list(gid)] = list(gid.values())
    g_of = lookup[c.rank[rows]]
    return rows[g_of >= 0], g_of[g_of >= 0]


def _check_rule(
    step: int, c: _StepColumns, rule, member_groups, cache: dict, by_rank: dict
) -> tuple[list[Finding], int] | None:
    """One rule's findings at the step and how many keys had two copies or more; None hands the step to the
    record path."""
    got = _rule_rows(c, rule, member_groups, cache, by_rank)
    if got is None:
        return None
    rows, g_of = got
    if not rows.size:
        return [], 0
    rank, code, mb, index, hi, lo, dev = c.rank, c.code, c.mb, c.index, c.hi, c.lo, c.dev
    o = np.lexsort(
        (hi[rows], lo[rows], dev[rows], rank[rows], code[rows], index[rows], mb[rows], g_of)
    )
    rows, g_of = rows[o], g_of[o]
    same_key = (
        (g_of[1:] == g_of[:-1])
        & (mb[rows][1:] == mb[rows][:-1])
        & (index[rows][1:] == index[rows][:-1])
        & (code[rows][1:] == code[rows][:-1])
    )
    if (same_key & (rank[rows][1:] == rank[rows][:-1])).any():
        return None  # a key twice in one rank's step: the record path keeps the last
    head = np.concatenate(([True], ~same_key))
    key_of = np.cumsum(head) - 1
    starts = np.flatnonzero(head)
    sizes = np.diff(np.append(starts, len(rows)))
    compared = int((sizes >= 2).sum())
    found = []
    for key in _broken_keys(rule.relation, c, rows, key_of, starts).tolist():
        a, b = int(starts[key]), int(starts[key] + sizes[key])
        these = rows[a:b]
        members = member_groups[int(g_of[a])]
        holder = {int(rank[x]): int(x) for x in these.tolist()}
        digests = {
            r: _hex(c.raw, holder[r], dev[holder[r]]) for r in members if r in holder
        }  # in the group's order, as the record path fills its table
        bad = _judge(rule.relation, digests)
        if bad:
            x = int(these[0])
            found.append(
                (int(g_of[a]), (int(mb[x]), int(index[x]), c.names[code[x]]), members, bad)
            )
    found.sort(key=lambda t: (t[0], t[1]))
    findings = [
        Finding(
            step=step,
            micro_batch=m,
            phase=rule.phase,
            index=i,
            tensor=name,
            group=members,
            relation=rule.relation,
            **bad,
        )
        for _, (m, i, name), members, bad in found
    ]
    return findings, compared


def _broken_keys(relation: str, c: _StepColumns, rows, key_of, starts) -> np.ndarray:
    """The keys (of `rows`, sorted by key) whose copies break `relation`: agree, a copy unlike its key's
    first; differ, two copies of one key with the same digest."""
    rank, hi, lo, dev = c.rank, c.hi, c.lo, c.dev
    if relation == "agree":  # every copy as the first of its key
        f = starts[key_of]
        off = (hi[rows] != hi[rows][f]) | (lo[rows] != lo[rows][f]) | (dev[rows] != dev[rows][f])
        return np.unique(key_of[off])
    # sorted by digest within a key but ranks first: equal digests need not be adjacent; sort again
    o2 = np.lexsort((rank[rows], hi[rows], lo[rows], dev[rows], key_of))
    r2 = rows[o2]
    k2 = key_of[o2]
    dup = (
        (k2[1:] == k2[:-1])
        & (hi[r2][1:] == hi[r2][:-1])
        & (lo[r2][1:] == lo[r2][:-1])
        & (dev[r2][1:] == dev[r2][:-1])
    )
    return np.unique(k2[1:][dup])


def _hex(raw: np.ndarray, row: int, device: bool) -> str:
    h = raw[row * 16 : row * 16 + 16].tobytes().hex()
    return "dev:" + h if device else h


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
