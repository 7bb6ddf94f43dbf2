"""check's columnar path: a window of steps of every rank decoded as Arrow columns, each copy's key packed
into 63 bits and the copies of a group compared as arrays; a step the columns cannot hold exactly is handed
back to the record path (analysis/consistency.py), the reference it is held to."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis.replica_rules import Finding, judge, name_applies
from disttrace.store import safeio
from disttrace.store.documents import Replicas
from disttrace.store.rundir import Run

BLOCK_ROWS = 1 << 14  # records of one rank decoded together (a block of steps), at least one step
WINDOW_STEPS = 1 << 10  # steps whose summaries are held at once, whatever their size
# and at most this many rank-steps: a window's summaries and lookups are held per step and rank, so at small
# steps of many ranks a window of 1,024 steps held ~0.4 MB a step (512 ranks x 6 records)
WINDOW_RANK_STEPS = 1 << 13


# a copy's key, packed in 63 bits: its group's position, micro-batch, tensor index and tensor name (a code
# into the run's names); a step whose values do not fit is judged on the records
_G_BITS, _MB_BITS, _IX_BITS, _CODE_BITS = 20, 11, 16, 16
_CHECKED = ("tensor", "phase", "micro_batch", "index", "digest", "device_digest")


class _Unpackable(Exception):
    """A step the summaries cannot hold exactly (a key twice in one rank, a value past the key's bits, a
    null name or phase, a rank in two groups of one dimension): the record path judges it."""


_SHIFT = _MB_BITS + _IX_BITS + _CODE_BITS  # a key's group: its top bits


class _Agree:
    """The copies of an `agree` rule at one step, summed up as the ranks go by: per key (sorted, so a
    group's keys are one range), the first copy's digest, how many copies there were and whether one
    differed from it. A group whose last rank has gone by is closed: its count of compared keys and its
    broken keys kept, its keys let go; what is held is the keys of the groups still open."""

    def __init__(self):
        self.key = np.zeros(0, dtype=np.int64)
        self.hi = np.zeros(0, dtype=np.uint64)
        self.lo = np.zeros(0, dtype=np.uint64)
        self.dev = np.zeros(0, dtype=bool)
        self.count = np.zeros(0, dtype=np.int64)
        self.broken = np.zeros(0, dtype=bool)
        self.compared = 0
        self.bad: list[np.ndarray] = []

    def add(self, key, hi, lo, dev) -> None:
        """One rank's copies, `key` sorted and distinct."""
        pos = np.searchsorted(self.key, key)
        hit = pos < len(self.key)
        hit[hit] = self.key[pos[hit]] == key[hit]
        p = pos[hit]
        self.count[p] += 1
        self.broken[p] |= (
            (self.hi[p] != hi[hit]) | (self.lo[p] != lo[hit]) | (self.dev[p] != dev[hit])
        )
        if hit.all():
            return
        new = ~hit
        o = np.argsort(np.concatenate((self.key, key[new])), kind="stable")
        self.key = np.concatenate((self.key, key[new]))[o]
        self.hi = np.concatenate((self.hi, hi[new]))[o]
        self.lo = np.concatenate((self.lo, lo[new]))[o]
        self.dev = np.concatenate((self.dev, dev[new]))[o]
        self.count = np.concatenate((self.count, np.ones(int(new.sum()), dtype=np.int64)))[o]
        self.broken = np.concatenate((self.broken, np.zeros(int(new.sum()), dtype=bool)))[o]

    def close(self, g: int) -> None:
        """Every copy of group g has gone by."""
        a, b = (int(x) for x in np.searchsorted(self.key, [g << _SHIFT, (g + 1) << _SHIFT]))
        if a == b:
            return
        self.compared += int((self.count[a:b] >= 2).sum())
        self.bad.append(self.key[a:b][self.broken[a:b]])
        for name in ("key", "hi", "lo", "dev", "count", "broken"):
            x = getattr(self, name)
            setattr(self, name, np.concatenate((x[:a], x[b:])))

    def result(self) -> tuple[int, np.ndarray]:
        """How many keys had two copies or more, and the keys whose copies differ."""
        bad = np.concatenate([*self.bad, self.key[self.broken]])
        return self.compared + int((self.count >= 2).sum()), np.sort(bad)


def _differ_result(key, hi, lo, dev) -> tuple[int, np.ndarray]:
    _, counts = np.unique(key, return_counts=True)
    o = np.lexsort((dev, lo, hi, key))
    k, h, lw, d = key[o], hi[o], lo[o], dev[o]
    dup = (k[1:] == k[:-1]) & (h[1:] == h[:-1]) & (lw[1:] == lw[:-1]) & (d[1:] == d[:-1])
    return int((counts >= 2).sum()), np.unique(k[1:][dup])


class _Differ:
    """The copies of a `differ` rule at one step: every copy's key and digest (two copies of one key with one
    digest break it, wherever they lie), 25 bytes a copy, until their group closes."""

    def __init__(self):
        self.parts: list[tuple] = []
        self.compared = 0
        self.bad: list[np.ndarray] = []

    def add(self, key, hi, lo, dev) -> None:
        self.parts.append((key, hi, lo, dev))

    def close(self, g: int) -> None:
        if not self.parts:
            return
        key, hi, lo, dev = (np.concatenate(c) for c in zip(*self.parts))
        mine = (key >> _SHIFT) == g
        self.parts = [(key, hi, lo, dev)]
        if not mine.any():
            return
        c, bad = _differ_result(key[mine], hi[mine], lo[mine], dev[mine])
        self.compared += c
        self.bad.append(bad)
        rest = ~mine
        self.parts = [(key[rest], hi[rest], lo[rest], dev[rest])] if rest.any() else []

    def result(self) -> tuple[int, np.ndarray]:
        c, bad = self.compared, list(self.bad)
        if self.parts:
            more, b = _differ_result(*(np.concatenate(x) for x in zip(*self.parts)))
            c += more
            bad.append(b)
        return c, np.sort(np.concatenate(bad)) if bad else np.zeros(0, dtype=np.int64)


@dataclass
class _RankBlock:
    """A rank's decoded block of steps as the summaries read it: per row, its name's code (the run's),
    micro-batch, index and digest, and per rule whether the row is of the rule's phase and names."""

    code: np.ndarray
    mb: np.ndarray
    index: np.ndarray
    hi: np.ndarray
    lo: np.ndarray
    dev: np.ndarray
    covered: list[np.ndarray]  # per rule
    odd: np.ndarray | None  # rows with a null name, phase, micro-batch or index (None: none)


class Columns:
    """The check on Arrow columns, one rank at a time, so that what it holds is bounded by a rank's block and
    by what each comparison needs, not by the number of ranks (one step of every rank at once was ~550 MiB
    at 1,024 ranks x 1,000 records). Steps go a window at a time: each rank's steps of the window are decoded
    together (trajectory_decode.decode_steps, at most BLOCK_ROWS records), each rule's rows selected (its tensor
    patterns matched once per distinct name), and its copies folded into the step's summary (`_Agree`: the
    first digest of each key and whether another differs; `_Differ`: the copies' digests). A step whose
    summaries find no broken key is consistent and counted without more; a step with broken keys is read
    again, keeping only the rows of those keys, and judged as one step of every rank side by side (each
    rule's copies sorted by (group, micro-batch, index, tensor), `judge` naming the odd ranks out), so the
    findings are those of that comparison. A step the summaries cannot hold exactly is handed back to the
    record path (None)."""

    def __init__(self, run: Run, rules: Replicas):
        self.run = run
        self.rules = rules.rules
        self.groups = rules.groups
        self.names: list[dict[str, bool]] = [{} for _ in self.rules]
        self.code_of: dict = {}  # the run's tensor names -> code
        self.applies: list[list[bool]] = [[] for _ in self.rules]  # per rule, by code
        self.ahead: dict[int, tuple[list, int] | None] = {}
        self.lookups: dict[tuple, np.ndarray | None] = {}

    def step(self, steps: list[int], n: int, indexes: dict) -> tuple[list, int] | None:
        step = steps[n]
        if step not in self.ahead:
            self.ahead = self._window(steps, n, indexes)
        return self.ahead.pop(step)

    def _lookup(self, k: int, present: tuple) -> tuple | None:
        """Rule k's group of each rank (an array by rank, -1 outside a group of two ranks or more holding
        the step) and each group's last rank in the order they are read; None where a rank is in two such
        groups or the groups do not fit the key."""
        dim = self.rules[k].dim
        if (dim, present) not in self.lookups:
            have = set(present)
            lookup = np.full(max(present) + 1, -1, dtype=np.int64)
            ok = len(self.groups[dim]) < 1 << _G_BITS
            for g, members in enumerate(self.groups[dim]):
                here = [r for r in members if r in have]
                if len(here) < 2 or not ok:
                    continue
                if (lookup[here] >= 0).any():
                    ok = False
                lookup[here] = g
            last = {int(lookup[r]): r for r in present if lookup[r] >= 0}
            self.lookups[(dim, present)] = (lookup, last) if ok else None
        return self.lookups[(dim, present)]

    def _codes(self, tensor: pa.Array) -> np.ndarray:
        distinct = pc.unique(tensor)
        local = np.asarray(pc.index_in(tensor, value_set=distinct).to_numpy(), dtype=np.int64)
        got = []
        for name in distinct.to_pylist():
            if name not in self.code_of:
                self.code_of[name] = len(self.code_of)
                for k, rule in enumerate(self.rules):
                    self.applies[k].append(name is not None and name_applies(rule, name))
            got.append(self.code_of[name])
        return np.array(got, dtype=np.int64)[local] if len(local) else local

    def _block(self, batch: pa.RecordBatch) -> _RankBlock:
        tensor, phase = batch.column("tensor"), batch.column("phase")
        mb_col, ix_col = batch.column("micro_batch"), batch.column("index")
        odd = None
        if tensor.null_count or phase.null_count or mb_col.null_count or ix_col.null_count:
            odd = np.zeros(batch.num_rows, dtype=bool)
            for col in (tensor, phase, mb_col, ix_col):
                odd |= np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        code = self._codes(tensor)
        digest = batch.column("digest")
        raw = np.frombuffer(digest.buffers()[1], dtype=np.uint8)[
            digest.offset * 16 : (digest.offset + len(digest)) * 16
        ]
        hi, lo = raw.reshape(-1, 16).view("<u8").T
        covered = []
        for k, rule in enumerate(self.rules):
            is_phase = np.asarray(
                pc.equal(phase, rule.phase).to_numpy(zero_copy_only=False), dtype=bool
            )
            covered.append(is_phase & np.array(self.applies[k], dtype=bool)[code])
        return _RankBlock(
            code=code,
            mb=np.asarray(mb_col.to_numpy(zero_copy_only=False), dtype=np.int64),
            index=np.asarray(ix_col.to_numpy(zero_copy_only=False), dtype=np.int64),
            hi=hi,
            lo=lo,
            dev=np.asarray(
                batch.column("device_digest").to_numpy(zero_copy_only=False), dtype=bool
            ),
            covered=covered,
            odd=odd,
        )

    def _keys(self, b: _RankBlock, a: int, z: int, k: int, g: int):
        """Rows a..z's copies under rule k, for a rank of group g: the rows and their keys, sorted by key."""
        sel = np.flatnonzero(b.covered[k][a:z]) + a
        if not sel.size:
            return sel, sel
        mb, index, code = b.mb[sel], b.index[sel], b.code[sel]
        if (
            mb.min() < 0
            or mb.max() >= 1 << _MB_BITS
            or index.min() < 0
            or index.max() >= 1 << _IX_BITS
            or code.max() >= 1 << _CODE_BITS
        ):
            raise _Unpackable
        key = (((g << _MB_BITS | mb) << _IX_BITS | index) << _CODE_BITS) | code
        o = np.argsort(key, kind="stable")
        key, sel = key[o], sel[o]
        if (key[1:] == key[:-1]).any():
            raise _Unpackable  # a key twice in one rank's step: the record path keeps the last
        return sel, key

    def _read(self, rank: int, entries: list) -> tuple[pa.RecordBatch, list[int]]:
        """The steps' records, decoded together, and where each step's rows begin (and the last ends). Steps
        that lie one after another in the file are read as one range (the file opened once a window, not
        once a step; a range no longer than a step may be)."""
        from disttrace.store import trajectory_decode, trajectory_read

        path = self.run.trajectory_path(rank)
        parts, i = [], 0
        while i < len(entries):
            first, j = entries[i], i + 1
            while (
                j < len(entries)
                and entries[j].offset == entries[j - 1].offset + entries[j - 1].length
                and entries[j].offset + entries[j].length - first.offset <= safeio.LIMITS["step"]
            ):
                j += 1
            end = entries[j - 1].offset + entries[j - 1].length
            data = trajectory_read.read_range(path, first.offset, end - first.offset, self.run.path)
            for e in entries[i:j]:
                at = e.offset - first.offset
                parts.append(
                    (
                        data[at : at + e.length],
                        f"step {e.step} (bytes {e.offset}..{e.offset + e.length})",
                    )
                )
            i = j
        batch, starts = trajectory_decode.decode_steps(path, parts)
        return batch, [*starts.tolist(), batch.num_rows]

    def _window(self, steps: list[int], n: int, indexes: dict) -> dict[int, tuple | None]:
        window: list[int] = []
        rows = dict.fromkeys(indexes, 0)
        held = max(1, min(WINDOW_STEPS, WINDOW_RANK_STEPS // max(1, len(indexes))))
        for s in steps[n : n + held]:
            for r, ix in indexes.items():
                if s in ix:
                    rows[r] += int(ix[s].records or 0)
            if window and max(rows.values()) > BLOCK_ROWS:
                break
            window.append(s)
        present = {s: tuple(r for r, ix in indexes.items() if s in ix) for s in window}
        lookups = {s: [self._lookup(k, present[s]) for k in range(len(self.rules))] for s in window}
        handed_back = {s for s in window if any(x is None for x in lookups[s])}
        sums = {
            s: [_Agree() if r.relation == "agree" else _Differ() for r in self.rules]
            for s in window
        }
        for r, ix in indexes.items():
            have = [s for s in window if s in ix and s not in handed_back]
            if not have:
                continue
            batch, bounds = self._read(r, [ix[s] for s in have])
            b = self._block(batch)
            for j, s in enumerate(have):
                a, z = bounds[j], bounds[j + 1]
                if s in handed_back:
                    continue
                if b.odd is not None and b.odd[a:z].any():
                    handed_back.add(s)
                    continue
                try:
                    for k in range(len(self.rules)):
                        lookup, last = lookups[s][k]
                        g = int(lookup[r])
                        if g < 0:
                            continue
                        sel, key = self._keys(b, a, z, k, g)
                        if sel.size:
                            sums[s][k].add(key, b.hi[sel], b.lo[sel], b.dev[sel])
                        if last[g] == r:
                            sums[s][k].close(g)
                except _Unpackable:
                    handed_back.add(s)
            del batch, b
        out: dict[int, tuple | None] = {}
        for s in window:
            if s in handed_back:
                out[s] = None
                continue
            results = [x.result() for x in sums[s]]
            compared = sum(c for c, _ in results)
            broken = [bad for _, bad in results]
            if not any(len(x) for x in broken):
                out[s] = ([], compared)
                continue
            found = self._judge_step(s, indexes, present[s], lookups[s], broken)
            out[s] = None if found is None else (found[0], compared)
        return out

    def _judge_step(self, step, indexes, present, lookups, broken):
        """The findings at a step whose summaries found broken keys: every rank of the step again, only the
        rows of those keys kept, judged side by side (ranks of groups with none keep no row)."""
        bad_groups = [set((x >> _SHIFT).tolist()) for x in broken]
        by_rank = {}
        for r in present:
            needed = [k for k in range(len(self.rules)) if int(lookups[k][0][r]) in bad_groups[k]]
            if not needed:
                by_rank[r] = None
                continue
            batch, bounds = self._read(r, [indexes[r][step]])
            b = self._block(batch)
            keep = np.zeros(batch.num_rows, dtype=bool)
            for k in needed:
                sel, key = self._keys(b, 0, batch.num_rows, k, int(lookups[k][0][r]))
                keep[sel[np.isin(key, broken[k])]] = True
            by_rank[r] = batch.select(list(_CHECKED)).filter(pa.array(keep))
        schema = next((x.schema for x in by_rank.values() if x is not None), None)
        empty = pa.RecordBatch.from_pylist([], schema=schema)
        by_rank = {r: empty if x is None else x for r, x in by_rank.items()}
        return _check_step_columns(step, by_rank, self.rules, self.groups, self.names)


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
            cache[nm] if nm in cache else cache.setdefault(nm, name_applies(rule, nm))
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
        bad = judge(rule.relation, digests)
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
