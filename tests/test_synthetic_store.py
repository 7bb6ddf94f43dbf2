"""The synthetic stores of the benches (bench/synthetic.py) are what the recorder writes: a step handed to the
writer as columns (`TrajectoryWriter.write_batch`) gives the bytes its records give through `write_step`,
in either layout, and a store written in several processes reads back as its records and its plant."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import synthetic  # noqa: E402

from disttrace.analysis.diff import diff_runs  # noqa: E402
from disttrace.store import trajectory_decode, trajectory_read, trajectory_write  # noqa: E402
from disttrace.store.rundir import Run  # noqa: E402
from disttrace.store.verify import verify_run  # noqa: E402


@pytest.fixture(params=[2, 1], ids=["v2", "v1"])
def layout_version(request, monkeypatch):
    monkeypatch.setattr(trajectory_write, "VERSION", request.param)
    return request.param


@pytest.mark.parametrize("n", [6, 7, 150, 1000])
def test_write_batch_gives_write_steps_bytes(tmp_path, layout_version, n):
    by_records = trajectory_write.TrajectoryWriter(tmp_path / "records.arrows")
    by_batch = trajectory_write.TrajectoryWriter(tmp_path / "batch.arrows")
    assert by_records.version == by_batch.version == layout_version
    layout = synthetic.Layout(n, by_batch)
    for step in range(1, 5):
        for rank, noisy, flip in ((0, False, None), (3, True, None), (5, False, n // 2)):
            a = by_records.write_step(layout.records(step, rank, noisy, flip))
            b = by_batch.write_batch(layout.batch(step, rank, noisy, flip))
            assert a == b, (step, rank, noisy, flip)
    by_records.close()
    by_batch.close()
    assert (tmp_path / "records.arrows").read_bytes() == (tmp_path / "batch.arrows").read_bytes()


def test_write_batch_refuses_another_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(trajectory_write, "VERSION", 1)
    v1 = trajectory_write.TrajectoryWriter(tmp_path / "v1.arrows")
    batch = synthetic.Layout(10, v1).batch(1, 0)
    monkeypatch.setattr(trajectory_write, "VERSION", 2)
    v2 = trajectory_write.TrajectoryWriter(tmp_path / "v2.arrows")
    with pytest.raises(ValueError, match="layout"):
        v2.write_batch(batch)
    assert v2.offset == 0  # nothing written


def test_a_store_written_in_processes_reads_back(tmp_path):
    ranks, steps, n = 4, 3, 50
    m = synthetic.manifest(ranks, steps)
    ref, late = tmp_path / "ref", tmp_path / "late"
    synthetic.write_shared(ref, m)
    synthetic.write_shared(late, m, "fault", {"name": "bench", "step": steps, "rank": 1})
    variants = [
        synthetic.Variant(str(ref)),
        synthetic.Variant(str(late), flip=(steps, 17), flip_rank=1),
    ]
    parts = synthetic.write_ranks(variants, ranks, steps, n, jobs=2)
    assert [p.rank for p in parts[0]] == list(range(ranks))
    for run, p in zip((ref, late), parts):
        synthetic.complete(run, p)
        assert verify_run(run).status == "intact", run  # the seal and every step's chain hold
    # what the readers decode is the records the dict path builds, rank column included
    layout = synthetic.Layout(n)
    run = Run(ref)
    for rank in range(ranks):
        path = trajectory_read.trajectory_path(ref, rank)
        got = []
        for e in run.step_index(rank).records:
            data = trajectory_read.read_range(path, e.offset, e.length)
            got += trajectory_read.to_records(
                trajectory_decode.decode_step(path, data, f"step {e.step}")
            )
        want = [r for s in range(1, steps + 1) for r in layout.records(s, rank)]
        assert len(got) == len(want) == steps * n
        for g, w in zip(got, want):
            assert {k: g[k] for k in w} == {**w, "sketch": pytest.approx(w["sketch"])}
    r = diff_runs(ref, late)
    f = r.first_divergence
    assert [f.step, f.rank, f.phase, f.index] == synthetic.planted(n, steps, 1, 17)


# ---------------------------------------------------------------- what a diff holds of each rank's index


def _slim(e: dict) -> dict:
    """What diff reads of an index line (the oracle: the line itself, the other fields left out)."""
    return {
        "step": e["step"],
        "offset": e["offset"],
        "length": e["length"],
        "records": e.get("records"),
        "digest": e.get("digest"),
        "xxh3": e.get("xxh3"),
        "sha256": e.get("sha256") if e.get("xxh3") is None else None,
    }


@pytest.mark.parametrize("spilled", [False, True])
def test_step_entries_give_back_what_the_lines_said(monkeypatch, spilled):
    """Also written out to the temporary file in pages of 4 steps (each index of more than 3 steps)."""
    import random

    from disttrace.analysis.diff.stepentries import StepEntries

    if spilled:
        monkeypatch.setattr(StepEntries, "SPILL_STEPS", 3)
        monkeypatch.setattr(StepEntries, "PAGE", 4)
    rng = random.Random(5)
    odd = [None, "dev:" + "a" * 32, "A" * 32, "0" * 31, "", 7]
    outcomes: set = set()
    for trial in range(200):
        n = rng.randint(0, 30)
        first = rng.randint(0, 5)
        steps = (
            list(range(first, first + n))
            if trial % 2
            else sorted(rng.sample(range(1, 3 * n + 2), n))
        )
        lines = {}
        for s in steps:
            e = {"step": s, "offset": rng.randint(0, 1 << 40), "length": rng.randint(0, 1 << 20)}
            e["records"] = rng.choice([rng.randint(0, 10**6), None, 0])
            for key in ("digest", "xxh3"):
                clean = trial % 3 == 0 or rng.random() < 0.8  # a third of the indexes: no odd value
                e[key] = f"{rng.getrandbits(128):032x}" if clean else rng.choice(odd)
            if rng.random() < 0.3:
                e["sha256"] = f"{rng.getrandbits(256):064x}"
            e["chain"], e["time"] = "c" * 64, {"start": 0.0, "end": 1.0}
            lines[s] = e
        got = StepEntries(lines)
        assert got._cols.held is not (spilled and n > 3)
        assert list(got) == steps and len(got) == n
        for s in steps:
            assert s in got and got[s] == _slim(lines[s]), (trial, s)
        for s in (-1, first - 1, max(steps, default=0) + 1, 3 * n + 5):
            if s not in lines:
                assert s not in got and got.get(s) is None
        _typed_accessors_agree(rng, lines, got, outcomes)
    # every answer of the hash check was asked for, of indexes with and without odd values
    assert outcomes == {True, False, None, "clean", "odd"}


def _typed_accessors_agree(rng, lines: dict, got, outcomes: set) -> None:
    """What diff reads of StepEntries without a dict (span, records, same_digest, hash_match) is what it read
    of the line: the oracle is the line itself, through the comparison and the seal's own check on it."""
    import xxhash

    from disttrace.analysis.diff.stepentries import StepEntries
    from disttrace.store import seal

    # the other side: the same steps, each line's digest, record count and bytes kept or changed
    other = {}
    clean = not got._odd  # every field held in the arrays: their comparison, not the lines'
    outcomes.add("clean" if clean else "odd")
    for s, e in lines.items():
        o = dict(e)
        if rng.random() < 0.3:
            o["digest"] = rng.choice(
                [f"{rng.getrandbits(128):032x}"]
                if clean
                else [None, "A" * 32, f"{rng.getrandbits(128):032x}"]
            )
        if rng.random() < 0.2:
            o["records"] = rng.choice([None, 0, (e.get("records") or 0) + 1])
        other[s] = o
    theirs = StepEntries(other)
    for s, e in lines.items():
        line, o = _slim(e), _slim(other[s])
        assert got.span(s) == (e["offset"], e["length"])
        assert got.records(s) == line["records"]
        agree = (
            line["digest"] is not None
            and line["digest"] == o["digest"]
            and line["records"] == o["records"]
        )
        assert got.same_digest(s, theirs) == agree, (s, line, o)
        assert not got.same_digest(s, StepEntries({k: v for k, v in other.items() if k != s}))
        # the step's bytes against a line of their length (or not), hashing to them (or not)
        data = rng.randbytes(rng.randint(0, 64))
        hashed = {
            **e,
            "length": len(data) if rng.random() < 0.8 else len(data) + 1,
            "xxh3": rng.choice([xxhash.xxh3_128_hexdigest(data), e.get("xxh3"), None]),
        }
        if hashed["xxh3"] is None:
            hashed["sha256"] = rng.choice([seal.step_hash(data), "0" * 64, None])
        outcome = StepEntries({s: hashed}).hash_match(s, data)
        line = _slim(hashed)
        want = seal.step_data_match_hashes(
            data, line["length"], line.get("xxh3"), line.get("sha256")
        )
        assert outcome == want, (s, hashed)
        outcomes.add(outcome)


def test_a_sides_index_is_a_few_dozen_bytes_a_rank_step(tmp_path):
    """The index a side holds grows by ~64 bytes a rank-step (the lines as parsed took ~1 KB)."""
    import tracemalloc

    from disttrace.analysis.diff.side import Side

    ranks, steps = 2, 800
    m = synthetic.manifest(ranks, steps)
    synthetic.write_shared(tmp_path / "a", m)
    synthetic.write_ranks([synthetic.Variant(str(tmp_path / "a"))], ranks, steps, 6, jobs=1)
    synthetic.complete(tmp_path / "a", None)
    side = Side("a", tmp_path / "a", True, [])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        side.load()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert side.steps == list(range(1, steps + 1))
    assert held < 128 * ranks * steps, held / (ranks * steps)
    e = side.entry(ranks - 1, steps)
    line = orjson.loads(
        (tmp_path / f"a/trajectory/rank-{ranks - 1:05d}.steps.jsonl").read_bytes().splitlines()[-1]
    )
    assert e == _slim(line)


def test_check_keeps_a_few_dozen_bytes_of_index_a_rank_step(tmp_path):
    """check holds every rank's step index while it reads the steps: arrays of spans (32 bytes a step),
    not the validated lines (~2.6 KB) nor the spans as tuples (~210)."""
    import tracemalloc

    from disttrace.analysis import consistency

    ranks, steps = 2, 800
    synthetic.write_shared(tmp_path / "a", synthetic.manifest(ranks, steps))
    synthetic.write_ranks([synthetic.Variant(str(tmp_path / "a"))], ranks, steps, 6, jobs=1)
    run = Run(tmp_path / "a")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        held = {r: consistency._spans(run, r) for r in range(ranks)}
        grew = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grew < 64 * ranks * steps, grew / (ranks * steps)
    line = run.step_index(1).records[-1]
    assert (
        held[1][steps]
        == (line.step, line.offset, line.length, line.records)
        == (steps,)
        + (
            held[1][steps].offset,
            held[1][steps].length,
            6,
        )
    )
