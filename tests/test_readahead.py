"""A diff that reads its next blocks in a second thread (analysis/readahead.py) gives what reading them one after
another gives: the same result, byte for byte in --json, and the same first refusal where a store is damaged in
two places. The oracle is the same diff with the second thread turned off, and the planted coordinates."""

from __future__ import annotations

import pytest
import test_diff_synthetic as syn
from test_block_decode import _forged_size

from disttrace.analysis import readahead
from disttrace.analysis.diff import blocks, diff_runs, prepare, side
from disttrace.errors import BadInput


def _diff(a, b, monkeypatch, threaded: bool, **kw):
    with monkeypatch.context() as m:
        m.setattr(readahead, "worth_it", lambda *a, **k: threaded)
        for module in (blocks, prepare):  # blocks of a few steps: many jobs, several in flight
            m.setattr(module, "BLOCK_ROWS", 60)
        return diff_runs(a, b, **kw)


def _runs(tmp_path, steps=12, rounding=False, plant=None):
    m = syn.manifest(**{"training.steps": steps})
    a = syn.write_run(tmp_path / "a", m, syn.gen_records(m, range(1, steps + 1)))
    recs = syn.gen_records(m, range(1, steps + 1))
    if rounding:  # every value rounded differently: every step of every rank read and compared
        for rank_recs in recs.values():
            for r in rank_recs:
                if r["phase"] != "data":
                    r["sum"] *= 1 + 1e-12
                    r["digest"] = syn.digest(r)
    if plant is not None:
        syn.plant(recs, *plant)
    return a, syn.write_run(tmp_path / "b", m, recs)


@pytest.mark.parametrize(
    "rounding, plant, mode",
    [
        (True, None, "numeric"),
        (True, (7, 0, "backward", 1, 3), "numeric"),
        (False, (5, 0, "optimizer", 0, 2), None),  # bitwise, propagating over every later step
    ],
    ids=["numeric-equal", "numeric-planted", "bitwise-planted"],
)
def test_the_same_result_with_and_without_the_second_thread(
    tmp_path, monkeypatch, rounding, plant, mode
):
    a, b = _runs(tmp_path, rounding=rounding, plant=plant)
    kw = {"mode": mode} if mode else {}
    one = _diff(a, b, monkeypatch, threaded=False, **kw)
    two = _diff(a, b, monkeypatch, threaded=True, **kw)
    assert two.to_json() == one.to_json()
    if plant is None:
        assert one.equal and one.to_dict()["stats"]["steps_read"] == 24  # 12 steps x 2 ranks
    else:  # the control: the planted record is what both find first
        f = one.to_dict()["first_divergence"]
        step, mb, phase, rank, index = plant
        assert (f["step"], f["rank"], f["phase"], f["index"]) == (step, rank, phase, index)


def _forge(run, rank: int, step: int) -> None:
    """A compressed buffer of the step that claims 2**40 bytes: refused by the decode, naming the step."""
    traj = run / "trajectory" / f"rank-{rank:05d}.arrows"
    e = side.Side("X", run, True, []).run.step_index_lines(rank).records[step - 1]
    data = bytearray(traj.read_bytes())
    at = slice(e["offset"], e["offset"] + e["length"])
    data[at] = _forged_size(bytes(data[at]))
    traj.write_bytes(bytes(data))


def test_the_first_refusal_is_the_one_read_first(tmp_path, monkeypatch):
    """Damage in rank 1's step 3 and in rank 0's step 9: reading in order meets rank 1's first (an earlier
    block), whichever the second thread reaches first; the control: rank 0's damage alone is refused, named."""
    a, b = _runs(tmp_path, rounding=True)
    _forge(b, 1, 3)
    _forge(b, 0, 9)
    errors = []
    for threaded in (False, True):
        with pytest.raises(BadInput) as e:
            _diff(a, b, monkeypatch, threaded=threaded, mode="numeric")
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert "rank-00001.arrows" in errors[0] and "step 3" in errors[0], errors[0]
    _runs(tmp_path / "alone", rounding=True)
    _forge(tmp_path / "alone" / "b", 0, 9)
    with pytest.raises(BadInput) as e:
        _diff(tmp_path / "alone" / "a", tmp_path / "alone" / "b", monkeypatch, True, mode="numeric")
    assert "rank-00000.arrows" in str(e.value) and "step 9" in str(e.value)


def test_reads_are_taken_in_order_only():
    jobs = iter([("x", lambda: 1), ("y", lambda: 2)])
    reader = readahead.ReadAhead(jobs)
    try:
        with pytest.raises(RuntimeError):
            reader.take("y")
    finally:
        reader.close()


def test_small_steps_decoded_in_c_are_read_in_the_comparing_thread():
    """With the C decoder a step of fewer than NATIVE_MIN_RECORDS records a rank is read where it is compared
    (a second thread would only contend for the GIL); larger steps, or the pyarrow decoder, read ahead."""
    below, at = readahead.NATIVE_MIN_RECORDS - 1, readahead.NATIVE_MIN_RECORDS
    assert readahead.worth_it() == readahead.worth_it(below, native=False)
    if not readahead.worth_it():
        pytest.skip("one core: no second thread in any case")
    assert not readahead.worth_it(below, native=True)
    assert readahead.worth_it(at, native=True) and readahead.worth_it(below, native=False)
