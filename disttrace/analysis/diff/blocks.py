"""Same topology: a block of steps compared rank by rank, skipping a step whose digests agree and whose raw
bytes are the same on both sides, decoding the others together and comparing them in one column-wise call
where they align."""

from __future__ import annotations

import functools

import numpy as np

from disttrace.analysis import columnar, readahead
from disttrace.analysis.diff.compare import (
    RankStep,
    _compare_rank_step,
    _compare_rank_step_columns,
    _fold_columns,
)
from disttrace.analysis.diff.side import Side
from disttrace.analysis.diff.tol import _Tol
from disttrace.store import trajectory_read

# records a block of steps may hold, per side, of one rank: ranks are compared one after another (a few MB of
# columns)
BLOCK_ROWS = 1 << 14
# across topologies, records a window of steps may hold, per side, of all its ranks: a step's ranks are read
# and combined together (~200 bytes a decoded record: ~14 MB a side), and a window's pyarrow and numpy calls
# are paid once for its steps (analysis/diff/window.py)
WINDOW_ROWS = 1 << 16
# rank-steps a block may hold the results of (a `RankStep` each, and its step's entries when folded: ~2 KB a
# rank-step): small steps would otherwise make a block of thousands of steps of every rank (16,384 records of a
# rank are 2,730 steps of 6), and the results, not the records, what it holds
BLOCK_RANK_STEPS = 1 << 13
# the numeric columns columnar.compare reads of both sides (beside those aligned_block has read)
_COMPARED = ("sum", "norm", "numel", "nonfinite", "device_digest")


def _block(steps: list[int], n: int, ranks, sides: tuple[Side, Side], rows: int) -> list[int]:
    """steps[n:] as far as `rows` records of any one rank of either side reach, and no more than
    BLOCK_RANK_STEPS rank-steps; at least one step."""
    out, total, most = [], 0, _most_steps(ranks)
    for step in steps[n:]:
        total += max(  # a rank's steps are decoded and compared together, one rank after another
            max((int(side.record_count(r, step) or 0) for r in ranks), default=0) for side in sides
        )
        if out and (total > rows or len(out) >= most):
            break
        out.append(step)
    return out


class _Plan:
    """`_block` for every block of a comparison over `steps`: each step's weight (the most records any rank of
    either side states for it) summed up once, a block then found by bisection (`_block` walks the steps and
    asks each rank's index for each of them, for every block, and did so twice: for the read-ahead and for
    the comparison)."""

    def __init__(self, steps: list[int], ranks, sides: tuple[Side, Side], together: bool = False):
        if together:  # across topologies: a step's ranks are read and compared together
            weights = [
                max(sum(int(side.record_count(r, step) or 0) for r in ranks) for side in sides)
                for step in steps
            ]
        else:
            weights = [
                max(
                    (int(side.record_count(r, step) or 0) for side in sides for r in ranks),
                    default=0,
                )
                for step in steps
            ]
        self.steps = steps
        self.cum = np.cumsum(np.array(weights, dtype=np.int64))
        self.most = _most_steps(ranks)

    def mean_records(self) -> float:
        """The records of a rank-step, on average over the steps (each step's most of any rank)."""
        return float(self.cum[-1]) / len(self.steps) if self.steps else 0.0

    def block(self, n: int, rows: int) -> list[int]:
        """_block(steps, n, ranks, sides, rows)."""
        base = int(self.cum[n - 1]) if n else 0
        k = int(np.searchsorted(self.cum[n:], base + rows, side="right"))
        return self.steps[n : n + max(min(k, self.most), 1)]


def _most_steps(ranks) -> int:
    """The most steps a block of these ranks may hold (BLOCK_RANK_STEPS)."""
    return max(1, BLOCK_RANK_STEPS // max(1, len(ranks)))


def _compare_block(
    block: list[int], ranks, side_a: Side, side_b: Side, tol: _Tol, read=None
) -> dict[int, tuple[dict, int]]:
    """Same topology, steps `block`, rank by rank: ({rank: RankStep}, ranks read) per step. A rank whose index
    digests agree is skipped undecoded when its raw bytes are the same on both sides (each side's bytes also
    checked against the hash it was indexed with): a digest in the index is the writer's word, equal bytes are
    equal records whoever wrote the index. A rank's steps that are read are decoded together (one batch a
    side) and, where they align row by row, compared in one column-wise call (a step's fixed cost of numpy
    and Arrow calls is paid once per block, not once per step and rank); each step's result is what it would
    be alone. read(r): what _read_rank gives for rank r (a ReadAhead's, read in another thread), by default
    read here."""
    per = {s: {} for s in block}
    read_steps = dict.fromkeys(block, 0)
    for r in ranks:
        same, todo, pair = read(r) if read is not None else _read_rank(r, block, side_a, side_b)
        for s in block:
            if s in same:
                per[s][r] = RankStep(int(side_a.record_count(r, s) or 0))
                continue
            read_steps[s] += 1
        if not todo:
            continue
        if pair is None:  # a JSON-lines side, or a step one side lacks: step by step
            for s in todo:
                per[s][r] = _compare_step_alone(s, r, side_a, side_b, tol)
            continue
        (ba, starts_a), (bb, starts_b), ca, cb, aligned = pair
        if aligned:
            out = [RankStep(n) for n in np.diff(np.append(starts_a, ba.num_rows)).tolist()]
            _fold_columns(todo, r, ca, cb, starts_a, tol, out)
            for s, rs in zip(todo, out):
                per[s][r] = rs
            continue
        # one step, or a block in which some step does not align: one by one
        ends_a, ends_b = np.append(starts_a[1:], ba.num_rows), np.append(starts_b[1:], bb.num_rows)
        for j, s in enumerate(todo):
            sa = ba.slice(int(starts_a[j]), int(ends_a[j] - starts_a[j]))
            sb = bb.slice(int(starts_b[j]), int(ends_b[j] - starts_b[j]))
            per[s][r] = _compare_rank_step_columns(s, r, sa, sb, tol)
    return {s: (per[s], read_steps[s]) for s in block}


def _read_rank(r: int, block: list[int], side_a: Side, side_b: Side):
    """What comparing rank r's steps of `block` reads: the steps skipped as the same bytes on both sides, the
    steps to compare, and both sides' batches of those (decoded together) with their columns and whether they
    align row by row, or None where they are compared step by step (a JSON-lines side, a step one side
    lacks)."""
    # steps whose index digests agree: skipped if their bytes are the same on both sides
    agree = [s for s in block if side_a.same_digest(r, s, side_b)]
    same = set()
    if agree:  # each side's steps read together, checked step by step (a refusal names the first)
        for s, da, db in zip(agree, side_a.raw_steps(r, agree), side_b.raw_steps(r, agree)):
            if side_a.checked(r, s, da) == side_b.checked(r, s, db):
                same.add(s)
    todo = [s for s in block if s not in same]
    if not todo or not all(
        trajectory_read.is_arrow(x.traj_path(r)) and all(x.has(r, s) for s in todo)
        for x in (side_a, side_b)
    ):
        return same, todo, None
    (ba, starts_a), (bb, starts_b) = side_a.batches(r, todo), side_b.batches(r, todo)
    # the block's columns as numpy and its alignment are worked out here too: with a read-ahead, in its thread,
    # which leaves the comparison alone on the other core
    ca, cb = columnar.Columns(ba), columnar.Columns(bb)
    aligned = (
        len(todo) > 1
        and np.array_equal(starts_a, starts_b)
        and columnar.aligned_block(ca, cb, starts_a)
    )
    if aligned:
        for c in (ca, cb):
            for name in _COMPARED:
                c[name]  # noqa: B018 (turned into numpy once, kept by Columns)
    return same, todo, ((ba, starts_a), (bb, starts_b), ca, cb, aligned)


def _take(reader: readahead.ReadAhead, first: int, r: int):
    return reader.take((first, r))


def _blocks_read(plan: _Plan, ranks, side_a: Side, side_b: Side):
    """The reads of a comparison that propagates over every step, in its order: (block's first step, rank) and
    the job that reads that rank's block (for readahead.ReadAhead)."""
    n, steps = 0, plan.steps
    while n < len(steps):
        block = plan.block(n, BLOCK_ROWS)
        for r in ranks:
            yield (block[0], r), functools.partial(_read_rank, r, block, side_a, side_b)
        n += len(block)


def _compare_step_alone(s: int, r: int, side_a: Side, side_b: Side, tol: _Tol) -> RankStep:
    """One rank's step on the record path, where a side is JSON lines (a side decoded is not read again)."""
    ba, bb = side_a.batch(r, s), side_b.batch(r, s)
    if ba is not None and bb is not None:
        return _compare_rank_step_columns(s, r, ba, bb, tol)
    return _compare_rank_step(
        s,
        r,
        trajectory_read.to_records(ba) if ba is not None else side_a.records(r, s),
        trajectory_read.to_records(bb) if bb is not None else side_b.records(r, s),
        tol,
    )
