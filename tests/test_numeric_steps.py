"""A numeric diff's `by_step` (an entry per step with every rank's summary, the `--json` contract) is held as
columns (`StepTable`) and written one step at a time (`jsondoc.Streamed`): the document is the bytes the list
of `StepEntry`s printed (the fold with a plain list, the code before, is the oracle), and what the result holds
is tens of bytes a rank-step, where the entries took ~2.5 KB."""

from __future__ import annotations

import pickle
import random
import sys
import tracemalloc
from pathlib import Path

import orjson
import pytest
import test_diff_synthetic as syn

from disttrace import jsondoc
from disttrace.analysis.diff import diff_runs, fold
from disttrace.analysis.result import RankEntry, StepEntry, StepTable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import synthetic  # noqa: E402


def _stores(root: Path, ranks: int, steps: int, n: int) -> tuple[Path, Path]:
    """bench/synthetic.py's reference and its noisy twin (every value but the data off by ~1e-12, every
    digest different: each step inexact on every rank)."""
    m = synthetic.manifest(ranks, steps)
    a, b = root / "a", root / "b"
    synthetic.write_shared(a, m)
    synthetic.write_shared(b, m)
    synthetic.write_ranks(
        [synthetic.Variant(str(a)), synthetic.Variant(str(b), noisy=True)], ranks, steps, n, jobs=1
    )
    return a, b


def _planted(root: Path) -> tuple[Path, Path]:
    """test_diff_synthetic's records (2 ranks, 8 steps): errors within the bound at steps 2, 3 and 5 on one
    rank or both, a divergence at step 6 (by_step before it, propagation from it)."""
    m = syn.manifest(**{"training.steps": 8})
    a = syn.write_run(root / "a", m, syn.gen_records(m, range(1, 9)))
    recs = syn.gen_records(m, range(1, 9))
    for step, rank, index in ((2, 0, 1), (3, 1, 0), (3, 0, 2), (5, 1, 3)):
        syn.plant(recs, step, 0, "backward", rank, index, factor=1 + 1e-9)
    syn.plant(recs, 6, 0, "forward", 1, 0, factor=1.1)
    return a, syn.write_run(root / "b", m, recs)


def _as_before(monkeypatch, *args, **kw):
    with monkeypatch.context() as mp:
        mp.setattr(fold, "StepTable", list)
        return diff_runs(*args, **kw)


@pytest.mark.parametrize("kind", ["equal", "divergent"])
def test_the_document_is_the_lists(tmp_path, monkeypatch, kind):
    a, b = _stores(tmp_path, 4, 9, 40) if kind == "equal" else _planted(tmp_path)
    new = diff_runs(a, b, mode="numeric")
    old = _as_before(monkeypatch, a, b, mode="numeric")
    assert type(new.numeric.by_step) is StepTable and type(old.numeric.by_step) is list
    steps = [e.step for e in new.numeric.by_step]
    assert steps == ([*range(1, 10)] if kind == "equal" else [2, 3, 5])
    assert steps == [e.step for e in old.numeric.by_step]
    assert new.equal is (kind == "equal")
    assert new.to_json() == old.to_json()
    assert new.to_dict() == old.to_dict()  # the plain form too (a Streamed list outside dumps)
    # what views read: the entries, their ranks, a rank's entry
    assert new.numeric.by_step == old.numeric.by_step
    for (s, e), (s2, e2) in zip(
        new.step_entries().items(), old.step_entries().items(), strict=True
    ):
        assert s == s2 and dict(e.ranks) == e2.ranks and e.rank(1) == e2.rank(1)
        assert e.rank(99) is None and e2.rank(99) is None
    assert new.numeric.by_step[-1] == old.numeric.by_step[-1]
    assert new.numeric.by_step[1:3] == old.numeric.by_step[1:3]


def test_jobs_and_merged_partials_print_the_same(tmp_path, monkeypatch):
    """The fold a merge replays builds the table too: `--jobs 2` gives the one-process bytes."""
    a, b = _stores(tmp_path, 4, 5, 30)
    old = _as_before(monkeypatch, a, b, mode="numeric").to_json()
    assert diff_runs(a, b, mode="numeric", jobs=2).to_json() == old


def _entry(rng: random.Random, step: int) -> StepEntry:
    phases = ["data", "forward", "backward", "reduce", "optimizer", "odd phase"]
    ranks = {}
    for r in sorted(rng.sample(range(64), rng.randint(0, 6))):
        by_phase = {
            p: rng.choice([0.0, 1e-300, rng.random(), 5e-17]) for p in rng.sample(phases, 3)
        }
        inexact = rng.choice([0, 0, 3])
        ranks[r] = RankEntry(
            rng.randint(0, 2),
            rng.randint(0, 9),
            by_phase,
            inexact=inexact,
            max_rel_err=rng.choice([None, rng.random()]),
            max_ratio=rng.choice([None, rng.random() * 10]),
            hard=rng.randint(0, 1),
        )
    if rng.random() < 0.1 and ranks:  # a value that is not a plain float: the entry is kept whole
        r = next(iter(ranks))
        ranks[r].max_rel_err_by_phase["forward"] = __import__("numpy").float32(0.1)
    return StepEntry(
        step=step,
        equal=rng.random() < 0.9,
        differing=rng.randint(0, 3),
        ranks=ranks,
        bound_by_phase=rng.choice([None, {"forward": 1e-6, "reduce": None}]),
        bound_kind_by_phase=None,
    )


@pytest.mark.parametrize("spill", [None, 1, 5])
def test_the_table_gives_back_every_entry_as_it_was(monkeypatch, spill):
    """Also with the columns written out every `spill` rank rows (a chunk read back when one of its entries
    is read): the same entries, the same text."""
    if spill is not None:
        monkeypatch.setattr(StepTable, "SPILL_ROWS", spill)
    rng = random.Random(3)
    for trial in range(100):
        entries = [_entry(rng, s) for s in range(rng.randint(0, 12))]
        table = StepTable(entries)
        if spill is not None and sum(len(e.ranks) for e in entries) > 2 * spill + 6:
            assert table._chunks, trial  # it did write chunks out
        assert [table[k] for k in reversed(range(len(table)))] == entries[::-1]  # any order
        assert pickle.loads(pickle.dumps(table)) == entries
        assert list(table) == entries and len(table) == len(entries)
        doc = {"x": [1, {"by_step": table, "after": [table, 2]}], "y": table}
        want = {"x": [1, {"by_step": entries, "after": [entries, 2]}], "y": entries}
        assert jsondoc.dumps(doc) == jsondoc.dumps(want), trial
        assert orjson.loads(jsondoc.dumps(doc)) == jsondoc.plain(doc)


def test_a_forged_mark_in_a_name_is_printed_as_written():
    """A store's text that looks like a splice mark stays text (the mark holds a nonce)."""
    forged = "\x00streamed-0000000000000000-0"
    doc = {"name": forged, "steps": StepTable([_entry(random.Random(1), 1)])}
    assert orjson.loads(jsondoc.dumps(doc))["name"] == forged


def test_by_step_holds_tens_of_bytes_a_rank_step(tmp_path, monkeypatch):
    """32 ranks x 20 steps, every step inexact on every rank: what `by_step` holds, the bytes freed when
    the result drops it (tracemalloc): ~90 bytes a rank-step (5 phases) and each step's bounds, where
    the entries took ~500 bytes a rank-step."""
    ranks, steps = 32, 20
    a, b = _stores(tmp_path, ranks, steps, 6)
    kept = []
    tracemalloc.start()  # the results are made while tracing, so that what they drop was traced
    try:
        for old in (False, True):
            r = (
                _as_before(monkeypatch, a, b, mode="numeric")
                if old
                else diff_runs(a, b, mode="numeric")
            )
            assert r.equal and len(r.numeric.by_step) == steps
            before = tracemalloc.get_traced_memory()[0]
            r.numeric.by_step = (
                None  # no cycles: freed here (gc.collect would empty free lists too)
            )
            kept.append(before - tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    new, old = kept
    bound = 120 * ranks * steps + 1000 * steps
    assert new < bound, (new, bound)
    assert old > bound, (old, bound)  # the bound has teeth: the code before fails it


def test_write_gives_dumps_bytes_a_step_at_a_time():
    """What the CLI writes (`jsondoc.write`) is `dumps`' text, in pieces none of which holds two steps."""
    entries = [_entry(random.Random(s), s) for s in range(30)]
    doc = {"a": 1, "numeric": {"by_step": StepTable(entries)}, "z": [StepTable(entries[:2])]}

    class Pieces:
        def __init__(self):
            self.got = []

        def write(self, s):
            self.got.append(s)

    out = Pieces()
    jsondoc.write(doc, out)
    assert (
        "".join(out.got)
        == jsondoc.dumps(doc)
        == jsondoc.dumps({**doc, "numeric": {"by_step": entries}, "z": [entries[:2]]})
    )
    assert max(p.count('"step"') for p in out.got) == 1


def test_peak_does_not_grow_with_the_steps(tmp_path, monkeypatch):
    """The numeric diff's traced peak while it compares (both sides' indexes read), 4 ranks, 40 steps against
    240, each step inexact on every rank. With a block of 8 steps, `by_step` written out every 64 rank rows,
    a side's step index of more than 16 steps in pages of 8 and 32 bounds cached (the sizes set small so
    that both stores span many of each), the peak does not grow with the steps (15-40 bytes a
    rank-step from one run to the next: the lists of steps, and what else the first run left warm); the code before grew by ~550 bytes a rank-step here (both
    sides' indexes, `by_step`, each side's counts and the bounds by step, held whole)."""
    from disttrace.analysis.diff import blocks, prepare, tol
    from disttrace.analysis.diff.stepentries import StepEntries

    ranks, n, few, many = 4, 6, 40, 240
    for mod in (blocks, prepare):
        monkeypatch.setattr(mod, "BLOCK_ROWS", 8 * n)
    monkeypatch.setattr(StepTable, "SPILL_ROWS", 64, raising=False)
    monkeypatch.setattr(StepEntries, "SPILL_STEPS", 16, raising=False)
    monkeypatch.setattr(StepEntries, "PAGE", 8, raising=False)
    monkeypatch.setattr(tol, "_CACHED", 32, raising=False)
    real = prepare.Setup.outcomes

    def outcomes(
        self, *args, **kw
    ):  # the peak from here: both sides' indexes read, every step compared
        tracemalloc.reset_peak()
        yield from real(self, *args, **kw)

    monkeypatch.setattr(prepare.Setup, "outcomes", outcomes)
    peaks = {}
    for steps in (few, many):
        a, b = _stores(tmp_path / str(steps), ranks, steps, n)
        if steps == few:  # imports and caches warmed: the peaks below are the diff's
            diff_runs(a, b, mode="numeric")
        tracemalloc.start()
        try:
            r = diff_runs(a, b, mode="numeric")
            peaks[steps] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert r.equal and len(r.numeric.by_step) == steps
    grew = peaks[many] - peaks[few]
    rank_steps = ranks * (many - few)
    assert grew < 100 * rank_steps, (peaks, grew / rank_steps)


@pytest.mark.parametrize("step", [1, 5, 9])
def test_an_edited_step_in_a_block_is_refused_naming_it(tmp_path, step):
    """A numeric diff reads a rank's steps as one block and checks each step's bytes against the hash its
    index line holds before decoding any: a byte edited in one step (its index line left as it was) is bad
    input naming the file and that step, never decoded or compared, wherever the step lies in the block."""
    from disttrace.errors import BadInput

    a, b = _stores(tmp_path, 2, 9, 40)
    assert diff_runs(a, b, mode="numeric").equal  # the control: the same stores, unedited
    traj = b / "trajectory/rank-00001.arrows"
    line = next(
        e
        for e in map(orjson.loads, (b / "trajectory/rank-00001.steps.jsonl").read_bytes().split())
        if e["step"] == step
    )
    data = bytearray(traj.read_bytes())
    # a byte in the step's record batch, past its headers
    data[line["offset"] + line["length"] - 3] ^= 0x10
    traj.write_bytes(bytes(data))
    with pytest.raises(BadInput) as e:
        diff_runs(a, b, mode="numeric")
    assert "rank-00001.arrows" in str(e.value) and f"step {step}:" in str(e.value), e.value
