"""The [record] manifest section (how much evidence a run keeps) and the timings and counts in the JSON
contracts: `show --json` step_seconds and records, `diff --json` records_read."""

from __future__ import annotations

import orjson
import pytest
from conftest import DEFAULT, cli, raw_records

from disttrace.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK
from disttrace.store.jsonlines import iter_jsonl
from disttrace.store.rundir import Run

EVERY2 = ("--set", "record.every=2")


@pytest.mark.parametrize(
    "setting, field",
    [
        ("record.every=0", "record.every"),
        ("record.collectives=full", "record.collectives"),
        ("record.enabled=maybe", "record.enabled"),
        ("record.forwards=true", "record.forwards"),
    ],
)
def test_bad_record_values_are_one_line_naming_file_and_field(setting, field):
    proc = cli("freeze", DEFAULT, "--set", setting)
    assert proc.returncode == EXIT_BAD_INPUT
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "default.toml" in line and field in line, line


def test_live_check_without_recording_is_refused():
    proc = cli("freeze", DEFAULT, "--set", "record.enabled=false", "--set", "debug.live_check=true")
    assert proc.returncode == EXIT_BAD_INPUT and "record.enabled" in proc.stderr


def _show(run) -> dict:
    return orjson.loads(cli("show", run, "--json", check=EXIT_OK).stdout)


def test_unrecorded_run_keeps_step_times_and_nothing_else(runs):
    run = Run(runs.reference("--set", "record.enabled=false"))
    assert run.complete
    for kind in ("trajectory", "collectives", "memory"):
        assert not (run.path / kind).exists() or not any((run.path / kind).iterdir()), kind
    doc = _show(run.path)
    assert doc["records"] == 0 and doc["loss"] == {}
    times = list(iter_jsonl(run.rank_path("steps", 0)))
    assert [t["step"] for t in times] == [1, 2, 3, 4]
    assert len(doc["step_seconds"]) == 4 and all(s > 0 for s in doc["step_seconds"])
    launched = next(e["time"] for e in run.events().records if e["event"] == "launched")
    assert (
        sum(doc["step_seconds"])
        < orjson.loads((run.path / "COMPLETE").read_bytes())["completed"] - launched
    )


def test_show_json_carries_step_seconds_and_records(runs):
    run = Run(runs.reference())
    doc = _show(run.path)
    rows = sum(len(raw_records(run.path, r)) for r in run.ranks())
    assert doc["records"] == rows > 0  # the oracle: the trajectory's own rows, read by pyarrow
    # rank 0's step index holds the recorder's span of each step: the step clock's lies around it
    idx = {e.step: e.time for e in run.step_index(0).records}
    assert len(doc["step_seconds"]) == len(idx) == 4
    for step, seconds in zip(sorted(idx), doc["step_seconds"]):
        assert seconds >= idx[step]["end"] - idx[step]["start"] - 1e-3, step


@pytest.mark.slow
def test_record_every_2_diffs_on_the_steps_both_runs_recorded(runs):
    ref = runs.reference()
    sparse = runs.reference(*EVERY2)
    assert [e.step for e in Run(sparse).step_index(1).records] == [2, 4]
    doc = orjson.loads(cli("diff", ref, sparse, "--json", check=EXIT_OK).stdout)
    assert doc["equal"] and (doc["compared_steps"]["first"], doc["compared_steps"]["count"]) == (
        2,
        2,
    )
    assert "lacks" not in doc["compared_steps"]["why"]  # steps record.every leaves out are not gaps
    # a gradient bit flipped at step 3 (not recorded) shows at step 4, the next step both recorded
    fault = runs.fault("bitflip-grad", 3, 1, *EVERY2)
    proc = cli("diff", ref, fault, "--json")
    assert proc.returncode == EXIT_DIVERGED
    assert orjson.loads(proc.stdout)["first_divergence"]["step"] == 4


def test_diff_json_counts_the_records_it_read(runs):
    """Bitwise diff skips equal (rank, step)s by the index digests and reads the rest: records_read is the
    sum of the index's record counts over exactly the (rank, step)s whose digests differ."""
    ref, fault = runs.reference(), runs.fault("bitflip-grad", 3, 1)
    doc = orjson.loads(cli("diff", ref, fault, "--json", check=EXIT_DIVERGED).stdout)
    expect = {"a": 0, "b": 0}
    for r in (0, 1):
        ia = {e.step: e for e in Run(ref).step_index(r).records}
        ib = {e.step: e for e in Run(fault).step_index(r).records}
        for step in ia:
            if ia[step].digest != ib[step].digest:
                expect["a"] += ia[step].records
                expect["b"] += ib[step].records
    assert expect["a"] > 0 and doc["records_read"] == expect


def test_recorder_every_and_forward_in_process(tmp_path):
    """record.every=2, record.forward=false on the recorder itself: steps 1 and 3 leave no record and no
    index line; step 2 and 4 hold the loss but no forward (block output) records."""
    import torch

    from disttrace.run.job.hooks import HookBus
    from disttrace.run.record.recorder import Recorder

    bus = HookBus(0)
    rec = Recorder(tmp_path, 0, every=2, forward=False).attach(bus)
    for step in (1, 2, 3, 4):
        bus.step, bus.micro_batch = step, 0
        bus.emit("step_start")
        bus.emit("forward", name="layers.0", index=0, tensor=torch.ones(3))
        bus.emit("loss", loss=torch.tensor(float(step)), tokens=4)
        bus.emit("step_end")
    rec.close()
    lines = raw_records(tmp_path, 0)
    assert [(x["step"], x["phase"], x["sum"]) for x in lines] == [
        (2, "loss", 2.0),
        (4, "loss", 4.0),
    ]
    assert [e["step"] for e in iter_jsonl(tmp_path / "trajectory" / "rank-00000.steps.jsonl")] == [
        2,
        4,
    ]
