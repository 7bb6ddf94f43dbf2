"""The default collective trace is read from torch's Flight Recorder (run/record/flightrec.py), not by a dispatch
mode: it must still hold every collective DDP issued (counted against DDP's own buckets) when its ring is
far smaller than the run and has to be copied as it fills, and a rank that gloo aborts on a mismatched
collective must still leave the op it died in, so the desync is named."""

from __future__ import annotations

import pytest
from conftest import SMALL_RING as RING
from conftest import last_line

from disttrace.analysis.sync import check_sync
from disttrace.errors import EXIT_JOB_FAILED
from disttrace.store.rundir import Run


@pytest.fixture(scope="module")
def small_ring(runs):
    """Several DDP buckets per step (0.1 MB cap) and a 32-entry ring, which the run overfills: it is copied
    only when the next step could overwrite what was not copied yet (the session's run, conftest.py)."""
    return Run(runs.small_ring())


def test_small_ring_trace_covers_every_ddp_bucket(small_ring):
    run = small_ring
    facts = [e for e in run.events().records if e["event"] == "engine_facts"]
    buckets = facts[-1]["ddp_bucket_sizes"]  # the oracle: what DDP's reducer handed its comm hook
    assert facts[-1]["step"] == 2 and len(buckets) > 3
    for rank in (0, 1):
        lines = [x.as_read() for x in run.collectives(rank)]
        assert not [x for x in lines if "lost" in x]
        assert len(lines) > RING  # more than the ring holds: only copies made in time keep them all
        assert all(
            "fr_seq" in x for x in lines
        )  # written from the Flight Recorder, not a dispatch mode
        per_pg: dict = {}
        for x in lines:  # each process group's own sequence numbers, every one once, none skipped
            per_pg.setdefault(x["pg"], []).append(x["fr_seq"])
        for seqs in per_pg.values():
            assert seqs == list(range(1, len(seqs) + 1))
        reduces = [x for x in lines if x["op"] == "allreduce_" and x["dtype"] == "float32"]
        for step in (2, 3, 4):  # after DDP's bucket rebuild at the end of step 1
            ops = [x for x in reduces if x["step"] == step]
            assert sorted(x["bytes"] for x in ops) == sorted(buckets), (rank, step)
        assert all(x["done"] for x in lines)  # a complete run: every collective finished
    assert check_sync(run).ok


def test_mismatched_collective_is_named_from_the_dying_ranks_own_ring(runs):
    """gloo aborts (SIGABRT, from its own thread) the rank that receives a collective of another size, and
    the launcher then terminates the other: both copy their ring from the signal handler."""
    proc = runs.collective_mismatch()  # the job test_faults.py's desync test reads too
    assert proc.returncode == EXIT_JOB_FAILED, proc.stderr
    run = Run(last_line(proc))
    fired = next(e for e in run.events().records if e["event"] == "fault_fired")
    bad = fired["shape"]  # the oracle: the shape the fault itself says it issued
    last = {r: list(run.collectives(r))[-1].as_read() for r in (0, 1)}
    assert last[1]["op"] == "allreduce_" and last[1]["shapes"] == [bad] and last[1]["step"] == 2
    assert (
        last[0]["op"] == "allreduce_"
        and last[0]["shapes"] != [bad]
        and last[0]["seq"] == last[1]["seq"]
    )
    m = check_sync(run).first_mismatch
    assert m.ranks == [1] and m.seq == last[1]["seq"] and m.step == 2
    assert (
        "collective desync" in proc.stderr
        and "rank(s) [1]" in proc.stderr
        and f"[{bad[0]}]" in proc.stderr
    )


def _entry(rid, seq, name, sizes, dtypes, t_ns, pg=("0", "default_pg"), pg_id=0, **kw):
    return {
        "record_id": rid,
        "pg_id": pg_id,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "profiling_name": name,
        "input_sizes": sizes,
        "input_dtypes": dtypes,
        "output_sizes": kw.get("out", sizes),
        "output_dtypes": kw.get("out_dtypes", dtypes),
        "state": "scheduled",
        "is_p2p": False,
        "time_created_ns": t_ns,
        "time_discovered_completed_ns": None,
    }


def test_converter_steps_bytes_scatter_done_and_lost_entries():
    """The ring-to-trace conversion on hand-made dumps in the Flight Recorder's shape (as torch 2.13 pickles
    it): each entry once across dumps, its step from the step starts, bytes from sizes x dtype, a scatter's
    size from its output, `done` from the group's last completed sequence number, and a wrapped ring's lost
    record ids said as such."""
    from disttrace.run.record.flightrec import Converter

    c = Converter()
    groups = {"0": "0,1"}
    c.step_started(1, 1_000)
    first = {
        "pg_status": {"0": {"last_completed_collective": 1}},
        "entries": [
            _entry(0, 1, "gloo:broadcast", [[3, 4]], ["Float"], 500),  # before step 1: set-up
            _entry(1, 2, "gloo:all_reduce", [[10]], ["Double"], 1_500),
        ],
    }
    recs = c.records(first, groups)
    assert [(r["op"], r["step"], r["bytes"], r["dtype"], r["seq"], r["done"]) for r in recs] == [
        ("broadcast_", 0, 48, "float32", 0, True),
        ("allreduce_", 1, 80, "float64", 1, False),
    ]
    c.step_started(2, 2_000)
    again = {
        "pg_status": {"0": {"last_completed_collective": 5}},
        "entries": first["entries"]
        + [
            _entry(2, 3, "gloo:scatter", [], [], 2_500, out=[[7]], out_dtypes=["Byte"]),
        ],
    }
    recs = c.records(again, groups)  # entries already copied are not copied again
    assert [(r["op"], r["step"], r["shapes"], r["bytes"], r["seq"]) for r in recs] == [
        ("scatter_", 2, [[7]], 7, 2)
    ]
    wrapped = {
        "pg_status": {},
        "entries": [_entry(6, 7, "gloo:barrier", [], [], 3_000)],
    }  # ids 3..5 overwritten
    recs = c.records(wrapped, groups)
    assert recs[0] == {"lost": 3, "after_record": 2, "step": 2} and recs[1]["op"] == "barrier"
