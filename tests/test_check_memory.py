"""`check` reads one rank at a time and holds a summary of each comparison, not a step of every rank: the
verdict and the document are the record path's (the reference the columns were always held to), on stores
with broken rules and on consistent ones, whatever the block; what it holds does not grow with the ranks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import test_scale_readers as readers

from disttrace.analysis import consistency, consistency_columns
from disttrace.analysis.consistency import check_run
from disttrace.store.rundir import Run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import synthetic  # noqa: E402


def _on_records(run: Path, monkeypatch) -> str:
    with monkeypatch.context() as mp:  # every step as dicts, every rank of it at once
        mp.setattr(consistency, "Columns", None)
        mp.setattr(consistency, "_arrow", lambda run, rank: False)
        return check_run(Run(run)).to_json()


def _on_columns(run: Path, monkeypatch) -> tuple[str, int]:
    """The document, and how many steps the columns handed back to the record path."""
    handed = [0]
    real = consistency._check_step

    def counted(*a):
        handed[0] += 1
        return real(*a)

    with monkeypatch.context() as mp:
        mp.setattr(consistency, "_check_step", counted)
        return check_run(Run(run)).to_json(), handed[0]


@pytest.mark.parametrize("block", [1, 9, 1 << 14], ids=["step", "few", "default"])
@pytest.mark.parametrize("seed", range(0, 40, 3))
def test_rank_by_rank_finds_what_the_records_do(tmp_path, monkeypatch, seed, block):
    """The random stores of test_scale_readers (copies that differ on one rank or in a tie, shared data
    shards, device digests, patterns, steps some ranks lack, a rank in no group), each block size: one step
    a window, a few, all."""
    run = readers._check_store(tmp_path, seed)
    want = _on_records(run, monkeypatch)
    monkeypatch.setattr(consistency_columns, "BLOCK_ROWS", block)
    got, handed = _on_columns(run, monkeypatch)
    assert got == want
    assert handed == 0  # every step judged by the summaries, none by the records


def _synthetic(root: Path, ranks: int, steps: int, n: int, flips=()) -> Path:
    """bench/synthetic.py's store (the recorder's writer): data must differ, reduced gradients and
    optimizer state agree over every rank; `flips` (step, rank, position) change one digest bit each."""
    synthetic.write_shared(root, synthetic.manifest(ranks, steps))
    flipped = {(s, r): p for s, r, p in flips}
    plain = [r for r in range(ranks) if not any(rr == r for _, rr in flipped)]
    variants = [synthetic.Variant(str(root), ranks=tuple(plain))] if plain else []
    for (s, r), p in flipped.items():
        variants.append(synthetic.Variant(str(root), flip=(s, p), flip_rank=r, ranks=(r,)))
    synthetic.write_ranks(variants, ranks, steps, n, jobs=1)
    return root


def _reduce_position(n: int, k: int = 0) -> int:
    return [j for j, (phase, _, _) in enumerate(synthetic.templates(n)) if phase == "reduce"][k]


@pytest.mark.parametrize("block", [1, 1 << 14])
@pytest.mark.parametrize("paged", [False, True])
def test_a_flip_is_found_where_it_was_planted(tmp_path, monkeypatch, block, paged):
    """A reduced gradient's digest changed on one rank: the first finding is that record, that rank the one
    suspect (the majority of 6 copies trusted), at the step it was planted; on rank 0 too (the first copy
    the summary keeps is the odd one out); and the document is the record path's. Also with each rank's
    index written out in pages of 3 steps (analysis/paged.py)."""
    monkeypatch.setattr(consistency_columns, "BLOCK_ROWS", block)
    if paged:
        monkeypatch.setattr(consistency._Spans, "SPILL_STEPS", 2)
        monkeypatch.setattr(consistency._Spans, "PAGE", 3)
    ranks, steps, n = 6, 4, 150
    plants = [(2, 0, _reduce_position(n, 3)), (3, 4, _reduce_position(n, 1))]
    run = _synthetic(tmp_path / "bad", ranks, steps, n, plants)
    spans = consistency._spans(Run(run), 5)
    assert spans._cols.held is not paged
    assert [tuple(spans[s]) for s in spans] == [
        (e.step, e.offset, e.length, e.records) for e in Run(run).step_index(5).records
    ]
    r = check_run(Run(run))
    assert r.consistent is False
    for (step, rank, _), entry in zip(plants, r.spread, strict=True):
        assert entry.step == step and entry.inconsistent == 1 and entry.minority_ranks == [rank]
    f = r.first
    assert [f.step, f.minority[0], f.phase, f.index] == synthetic.planted(n, *plants[0])
    assert f.majority == [x for x in range(ranks) if x != 0] and not f.tie
    got, handed = _on_columns(run, monkeypatch)
    assert handed == 0 and got == _on_records(run, monkeypatch)
    # the control: the same store without the flips is consistent, every step checked
    ok = check_run(Run(_synthetic(tmp_path / "ok", ranks, steps, n)))
    assert ok.consistent is True and ok.steps_checked == steps and not ok.spread


# What one check allocates (tracemalloc's peak), measured in a fresh interpreter: in the test process the
# peak also depended on what earlier tests had left (it read 2.7 MiB after the whole file, 0.7 MiB alone).
# The manifest and the rules are read first, they are not what check holds; a first check of the same store
# takes the one-off allocations (caches, lazy imports).
_PEAK = """
import sys, tracemalloc
from disttrace.analysis import consistency
from disttrace.analysis.consistency import check_run
from disttrace.store.rundir import Run
run = Run(sys.argv[1])
run.ranks()
rules = consistency.load_rules(run)
consistency.load_rules = lambda _run: rules
check_run(Run(sys.argv[1]))
tracemalloc.start()
result = check_run(run)
peak = tracemalloc.get_traced_memory()[1]
tracemalloc.stop()
ranks = sorted({r for gs in rules.groups.values() for g in gs for r in g})
print(peak, result.consistent, result.steps_checked, ranks == list(run.ranks()))
"""


def _peak(path: Path, monkeypatch=None) -> int:
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak, consistent, steps, own_rules = proc.stdout.split()
    assert consistent == "True" and steps == "2"
    assert own_rules == "True"  # the store's own rules, over all its ranks
    return int(peak)


def test_what_check_holds_does_not_grow_with_the_ranks(tmp_path, monkeypatch):
    """8 and 64 ranks of 1,000 records a step: the peak of what check allocates (tracemalloc) is about the
    same. Holding one step of every rank (the code before) took ~50 bytes a record of the step in numpy
    alone: 3.1 MiB at 64 ranks, 0.7 MiB at 8."""
    n = 1000
    small = _synthetic(tmp_path / "r8", 8, 2, n)
    large = _synthetic(tmp_path / "r64", 64, 2, n)
    p8, p64 = _peak(small, monkeypatch), _peak(large, monkeypatch)
    assert p64 < 1.25 * p8 + (64 << 10), (p8, p64)
    assert p64 < 1.5 * 2**20, p64  # a rank's block a few times over, not 64 ranks' step


def _pairs(root: Path, ranks: int, n: int) -> Path:
    """The synthetic store with the rules of a tensor-parallel layout of pairs: reduced gradients and
    optimizer state agree within each pair of ranks (ranks / 2 groups, each closed once its second rank
    is read)."""
    run = _synthetic(root, ranks, 2, n)
    pairs = [[r, r + 1] for r in range(0, ranks, 2)]
    rules = [
        {"phase": "reduce", "dim": "tp", "relation": "agree"},
        {"phase": "optimizer", "dim": "tp", "relation": "agree"},
        {"phase": "data", "dim": "tp", "relation": "differ"},
    ]
    (run / "replicas.json").write_bytes(orjson.dumps({"groups": {"tp": pairs}, "rules": rules}))
    return run


def test_many_small_groups_are_let_go_as_they_close(tmp_path, monkeypatch):
    """Pairs of ranks: 4 groups at 8 ranks, 32 at 64, each with its keys. A group's summary is let go once
    its last rank has been read, so the peak is about the same (held open, 32 groups' keys of both steps
    were ~0.7 MiB more); and the pairs' verdict is the record path's, a flip in one pair found there."""
    n = 1000
    small, large = _pairs(tmp_path / "p8", 8, n), _pairs(tmp_path / "p64", 64, n)
    check_run(Run(small))
    p8, p64 = _peak(small, monkeypatch), _peak(large, monkeypatch)
    assert p64 < 1.25 * p8 + (64 << 10), (p8, p64)
    pos = _reduce_position(n, 7)
    bad = _synthetic(tmp_path / "bad", 8, 2, n, [(2, 5, pos)])
    (bad / "replicas.json").write_bytes((small / "replicas.json").read_bytes())
    r = check_run(Run(bad))
    f = r.first  # two copies: no majority, both suspects
    assert r.consistent is False and f.group == [4, 5] and f.tie and f.minority == [4, 5]
    step, _, phase, index = synthetic.planted(n, 2, 5, pos)
    assert [f.step, f.phase, f.index] == [step, phase, index] and len(r.spread) == 1
    got, handed = _on_columns(bad, monkeypatch)
    assert handed == 0 and got == _on_records(bad, monkeypatch)


def test_a_window_holds_at_most_its_rank_steps(tmp_path, monkeypatch):
    """At small steps of many ranks a window of steps is held to WINDOW_RANK_STEPS rank-steps (its summaries
    are kept a step and rank): with a bound of 8, 4 ranks are checked 2 steps a window, and a flip planted at
    step 7 on rank 2 is found there, the document the record path's."""
    ranks, steps, n = 4, 12, 150
    run = _synthetic(tmp_path / "bad", ranks, steps, n, [(7, 2, _reduce_position(n, 2))])
    want = _on_records(run, monkeypatch)
    monkeypatch.setattr(consistency_columns, "WINDOW_RANK_STEPS", 8)
    sizes = []
    real = consistency_columns.Columns._window

    def counted(self, steps_, n_, indexes):
        out = real(self, steps_, n_, indexes)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(consistency_columns.Columns, "_window", counted)
    got, handed = _on_columns(run, monkeypatch)
    assert handed == 0 and got == want
    assert sizes and max(sizes) == 2 and sum(sizes) == steps, sizes
    r = orjson.loads(got)
    assert r["consistent"] is False and r["first"]["step"] == 7 and r["first"]["minority"] == [2]
