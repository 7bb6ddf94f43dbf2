"""The job's lines are built with the models the readers validate (store/events.py, store/documents.py), and
what they write is the store's format as it was written by dict literals: the same keys, in the same order, a
field stated as None written as null, one left out left out. The oracle is each line as its writer spelt it
out before the models existed (the literal, copied here), compared byte for byte; and every line written is
read back by the reader's own model."""

from __future__ import annotations

import orjson
import pytest

from disttrace.store import documents as docs
from disttrace.store import events as ev
from disttrace.store import records as r
from disttrace.store.rundir import Run
from disttrace.store.writers import JsonlWriter, event, write_run_info


def _bytes(obj) -> bytes:
    return orjson.dumps(obj)


EVENTS = [
    (ev.Created(path="fault"), {"path": "fault"}),
    (ev.Created(path="reference", pid=7), {"path": "reference", "pid": 7}),
    (
        ev.Launched(nnodes=1, node_rank=0, nproc_per_node=2, endpoint="127.0.0.1:1"),
        {"nnodes": 1, "node_rank": 0, "nproc_per_node": 2, "endpoint": "127.0.0.1:1"},
    ),
    (
        ev.CheckpointSaved(step=2, path="checkpoints/step-000002"),
        {"step": 2, "path": "checkpoints/step-000002"},
    ),
    (
        ev.Resumed(step=2, checkpoint="fault/checkpoints/step-000002", with_optimizer=True),
        {"step": 2, "checkpoint": "fault/checkpoints/step-000002", "with_optimizer": True},
    ),
    (
        ev.RankFailed(
            rank=1,
            error="BadInput: x",
            where="tb",
            bad_input=ev.BadInputNote(where="f", field=None, reason="y"),
        ),
        {
            "rank": 1,
            "error": "BadInput: x",
            "where": "tb",
            "bad_input": {"where": "f", "field": None, "reason": "y"},
        },
    ),
    (ev.RankFailed(rank=0, error="E: e"), {"rank": 0, "error": "E: e"}),
    (
        ev.JobFailed(failures={"1": -9}, first_failed_rank=1, reason="killed"),
        {"failures": {"1": -9}, "first_failed_rank": 1, "reason": "killed"},
    ),
    (ev.JobFailed(reason="no COMPLETE"), {"reason": "no COMPLETE"}),
    (
        ev.LiveCheckFailed(step=3, phase="reduce", group=[0, 1], digests={"0": "a", "1": "b"}),
        {"step": 3, "phase": "reduce", "group": [0, 1], "digests": {"0": "a", "1": "b"}},
    ),
    (
        ev.EngineFacts(step=1, ddp_bucket_sizes=[656640]),
        {"step": 1, "ddp_bucket_sizes": [656640]},
    ),
    (
        ev.Attached(engine="DDP", world_size=2, manifest_id="ab", replica_rules=4),
        {"engine": "DDP", "world_size": 2, "manifest_id": "ab", "replica_rules": 4},
    ),
    (
        ev.FaultRefused(fault="skip-allreduce", where="attach", field=None, reason="no point"),
        {"fault": "skip-allreduce", "where": "attach", "field": None, "reason": "no point"},
    ),
    (ev.CollectiveTraceEmpty(reason="off"), {"reason": "off"}),
    (ev.AttachNote(note="no DDP comm hook"), {"note": "no DDP comm hook"}),
]


@pytest.mark.parametrize("line,fields", EVENTS, ids=lambda x: getattr(x, "event", ""))
def test_an_event_is_written_as_its_literal_was_and_read_back_by_its_model(tmp_path, line, fields):
    assert event(tmp_path, line)
    written = (tmp_path / "events.jsonl").read_bytes()
    stamped = orjson.loads(written)["time"]
    assert written == _bytes({"event": line.KIND, "time": stamped, **fields}) + b"\n"
    read = ev.parse_event(orjson.loads(written), tmp_path / "events.jsonl", 1)
    assert type(read) is type(line) and read.as_read() == orjson.loads(written)


def test_a_fault_event_leaves_out_details_of_none_as_it_always_did(tmp_path):
    line = ev.FaultEvent(
        fault="bitflip-grad",
        step=3,
        micro_batch=1,
        rank=1,
        point="backward",
        params={"bit": 30},
        digest_before="a",
        digest_after="b",
        changed=True,
        phase="backward",
        tensor=None,
    )
    event(tmp_path, line)
    doc = orjson.loads((tmp_path / "events.jsonl").read_bytes())
    assert list(doc) == [
        "event",
        "time",
        "fault",
        "step",
        "micro_batch",
        "rank",
        "point",
        "params",
        "digest_before",
        "digest_after",
        "changed",
        "phase",
    ]


def test_an_unknown_or_malformed_event_line():
    read = ev.parse_event({"event": "run_started", "time": 1.0, "x": 1}, "events.jsonl", 1)
    assert type(read) is ev.EventLine and read.as_read()["x"] == 1
    from disttrace.errors import BadInput

    with pytest.raises(BadInput) as e:
        ev.parse_event({"event": "checkpoint_saved", "step": "2"}, "events.jsonl", 4)
    assert e.value.field == "step" and "line 4" in e.value.reason
    # a kind that is no string (an object or a list: unhashable, once an internal error) names the field
    for kind in ({}, [1], 3):
        with pytest.raises(BadInput) as e:
            ev.parse_event({"event": kind, "time": 1.0}, "events.jsonl", 2)
        assert e.value.field == "event" and "line 2" in e.value.reason


def test_run_json_is_what_the_writer_stated(tmp_path):
    # the launcher's literal (run/job/launch.py prepare), a replay's extras, and a read back by Run.run_info
    fault = {
        "name": "bitflip-grad",
        "step": 3,
        "rank": 1,
        "params": {"bit": 30},
        "point": "backward",
    }
    literal = {
        "path": "fault",
        "fault": {**fault, "expect": "backward"},
        "resume": None,
        "origin": None,
        "created": 1.5,
        "argv": ["disttrace", "inject"],
        "stop_after": 4,
        "replay": {"of": "/x", "step": 4, "rank_shift": None, "from": "why", "depth": None},
    }
    info = docs.RunInfo(
        path="fault",
        fault={**fault, "expect": "backward"},
        resume=None,
        origin=None,
        created=1.5,
        argv=["disttrace", "inject"],
        stop_after=4,
        replay=docs.ReplaySpec(of="/x", step=4, rank_shift=None, from_="why", depth=None).doc(),
    )
    assert info.doc() == literal
    write_run_info(tmp_path, info)
    (tmp_path / "manifest.lock.json").write_bytes(_bytes({"manifest": {}, "manifest_id": "ab"}))
    run = Run(tmp_path)
    assert run.info == literal and run.run_info.replay.from_ == "why"
    assert run.run_info.fault.step == 3 and run.run_info.resume is None
    updated = run.run_info.updated(perturb={"relative": 1e-7, "seed": 1})
    assert updated.doc() == {**literal, "perturb": {"relative": 1e-7, "seed": 1}}


def test_memory_and_collective_lines_keep_their_order(tmp_path):
    w = JsonlWriter(tmp_path / "m.jsonl")
    pred = docs.ModelStateBytes(params=1, grads=1, optimizer=2, total=4)
    gaps = [
        docs.MemoryGap(what="model buffers", bytes=8),
        docs.MemoryGap(what="optimizer state vs the formula", bytes=4, why=None),
    ]
    row = docs.MemoryLine(
        step=1,
        rank=0,
        params=1,
        grads=1,
        optimizer=6,
        model_state=8,
        buffers=8,
        unregistered=0,
        engine=0,
        engine_peak=0,
        measured_total=16,
        storages=3,
        activations_saved=0,
        peak_tracked=16,
        resident=None,
        predicted=pred,
        ratio_model_state=2.0,
        ratio_total=4.0,
        gap=["model buffers: +8 B", "optimizer state vs the formula: +4 B"],
        gap_bytes=gaps,
    )
    w.write(row.line())
    w.close()
    doc = orjson.loads((tmp_path / "m.jsonl").read_bytes())
    assert list(doc)[:3] == ["step", "rank", "params"] and list(doc)[-2:] == ["gap", "gap_bytes"]
    assert doc["resident"] is None and doc["gap_bytes"] == [
        {"what": "model buffers", "bytes": 8},
        {"what": "optimizer state vs the formula", "bytes": 4, "why": None},
    ]
    ring = docs.CollectiveLine(
        seq=0,
        group="0,1",
        op="allgather_",
        step=0,
        shapes=[[1]],
        dtype="int64",
        bytes=8,
        start=1.0,
        pg="0",
        fr_seq=1,
        done=True,
    )
    literal = {
        "seq": 0,
        "group": "0,1",
        "op": "allgather_",
        "step": 0,
        "shapes": [[1]],
        "dtype": "int64",
        "bytes": 8,
        "start": 1.0,
        "pg": "0",
        "fr_seq": 1,
        "done": True,
    }
    assert _bytes(ring.line()) == _bytes(literal)
    assert _bytes(docs.CollectiveLine(seq=0, group="0,1", end=2.0).line()) == _bytes(
        {"seq": 0, "group": "0,1", "end": 2.0}
    )
    lost = docs.RingLost(lost=3, after_record=9, step=2).line()
    assert _bytes(lost) == _bytes({"lost": 3, "after_record": 9, "step": 2})
    assert docs.CollectiveLine.parse_line(lost, "c.jsonl", 1).lost == 3


@pytest.mark.parametrize("field", ["step", "offset", "length", "records"])
def test_a_step_index_count_past_int64_is_refused_naming_it(field):
    """A step index line whose count, offset or size is 2^63 or more is refused by the model, naming the field,
    and never taken by the readers' fast checks (it overflowed diff's int64 arrays: an internal error); 2^63 - 1
    is still a line as the writer writes it (the control)."""
    from disttrace.errors import BadInput
    from disttrace.store import rundir

    line = {"step": 2, "offset": 10, "length": 20, "records": 3, "digest": "ab" * 16}
    assert rundir._plain_index_line({**line, field: (1 << 63) - 1})
    big = {**line, field: 1 << 63}
    assert not rundir._plain_index_line(big) and not rundir._plain_index_lines([line, big])
    with pytest.raises(BadInput) as e:
        r.StepIndexEntry.parse_line(big, "rank-00001.steps.jsonl", 2)
    assert e.value.field == field and "line 2" in e.value.reason
