"""`disttrace replay`: re-execute one step of a run from its checkpoint and attribute its divergence.

Every verdict is held against what was planted, never against the code under test: the fault's own nature
(a bit flip does not recur, a skipped all-reduce does, a faulty device stays on its slot), the fault's
coordinates (step, rank, slot), and for "not replayable" the coordinates of a record edited into a store
that was resealed with disttrace's own code (verify cannot tell it from a real one). Real gloo jobs, two
ranks, the tiny default model; the replay itself is one or two steps from the checkpoint of step 2.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from conftest import cli
from test_forged_store import copy_run

from disttrace.run import faults


def replay(run: Path, step: int, *args, expect=0, timeout=240) -> dict:
    proc = cli("replay", run, "--step", step, *args, "--json", "--quiet", timeout=timeout)
    assert proc.returncode == expect, proc.stderr[-3000:]
    return orjson.loads(proc.stdout)


def run_info(run: Path) -> dict:
    return orjson.loads((Path(run) / "run.json").read_bytes())


def test_every_catalog_fault_states_how_it_recurs():
    """Each entry states its own nature (not inherited by accident from the class it extends)."""
    for name, cls in faults.REGISTRY.items():
        assert "recurrence" in vars(cls), name
        assert cls.recurrence in faults.RECURRENCES, name
    assert faults.get("bitflip-grad").recurrence == "transient"
    assert faults.get("skip-allreduce").recurrence == "persistent"
    assert faults.get("faulty-device").recurrence == "device"


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


@pytest.fixture
def root(ref, tmp_path) -> Path:
    """A runs root of the test's own holding a copy of the reference (the one `replay` finds by default):
    replays are written beside the run they replay, so the session's shared runs stay as other tests
    expect them (no replay beside them for the gate to attribute)."""
    copy_run(ref, tmp_path)
    return tmp_path


def private(run: Path, root: Path) -> Path:
    return copy_run(run, root)


def test_bitflip_is_transient_and_the_replay_is_a_store_of_its_own(runs, ref, root):
    """A bit flipped at step 3 on rank 1 does not recur: the replay from the checkpoint of step 2 matches the
    reference (found as `lab` finds it, in the runs root), not the stored step."""
    run = private(runs.fault("bitflip-grad", 3, 1), root)
    doc = replay(run, 3)
    assert doc["attribution"] == "transient", doc["reason"]
    assert doc["reproduces"] is False and doc["matches_reference"] is True
    assert doc["reference"] == str(root / ref.parent.name / ref.name)
    assert doc["from_checkpoint"] == 2 and doc["replayed_steps"] == [3]
    # the stored divergence is the planted one: step 3, rank 1, backward
    first = doc["stored"]["first"]
    assert (first["step"], first["rank"], first["phase"]) == (3, 1, "backward")
    assert "slot" not in doc
    out = Path(doc["replay"])
    assert out.parent == run.parent and out.name == "replay-3"
    info = run_info(out)
    assert info["path"] == "replay" and info["replay"]["of"] == str(run.resolve())
    assert info["fault"] is None  # a transient fault is not carried into the replay
    # read by the same readers as any run: sealed, shown, diffed
    assert cli("verify", out).returncode == 0
    assert cli("show", out, "--json").returncode == 0
    assert cli("diff", ref, out).returncode == 0  # equal to the reference on step 3


def test_skip_allreduce_is_persistent(runs, root):
    """A skipped all-reduce is a standing bug: its step re-executed from the checkpoint diverges again, bit for
    bit as stored."""
    run = private(runs.fault("skip-allreduce", 3, 1), root)
    doc = replay(run, 3)
    assert doc["attribution"] == "persistent", doc["reason"]
    assert doc["reproduces"] is True and doc["matches_reference"] is False
    first = doc["stored"]["first"]
    assert (first["step"], first["rank"], first["phase"]) == (3, 1, "reduce")
    assert run_info(Path(doc["replay"]))["fault"]["name"] == "skip-allreduce"


def test_bad_input_is_one_line_and_nothing_written(runs, root):
    run = private(runs.fault("bitflip-grad", 3, 1), root)
    before = sorted(p.name for p in run.parent.iterdir())
    for args, says in (
        (("--step", 9), "step 9 is not a recorded step"),
        (("--step", 3, "--depth", "layer"), "'layer' is not one of module, op"),
    ):
        proc = cli("replay", run, *args)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in run.parent.iterdir()) == before


@pytest.mark.slow
def test_reference_has_nothing_to_attribute(ref, root):
    doc = replay(root / ref.parent.name / ref.name, 4)
    assert doc["attribution"] == "none", doc["reason"]
    assert doc["reproduces"] is True and doc["matches_reference"] is True
    assert doc["replayed_steps"] == [3, 4]  # step 3 replayed before 4, and reproduced


@pytest.mark.slow
def test_faulty_device_stays_on_its_slot_when_ranks_move(runs, ref, root):
    """The device under rank 1 at launch (slot 1) corrupts every linear output from step 3 on. Replayed in
    place, the divergence reproduces (persistent: the replay cannot tell the hardware from the code); with
    the ranks rotated over the slots it leaves rank 1 for rank 0, which now runs on slot 1: device, slot 1."""
    run = private(runs.fault("faulty-device", 3, 1), root)
    first = cli("diff", ref, run, "--json")
    f = orjson.loads(first.stdout)["first_divergence"]
    assert (f["step"], f["rank"], f["phase"]) == (3, 1, "forward")
    events = [
        orjson.loads(x)
        for x in (run / "events.jsonl").read_bytes().splitlines()
        if b"fault_fired" in x
    ]
    assert {e["rank"] for e in events} == {1} and {e["step"] for e in events} == {3, 4}
    same = replay(run, 3)
    assert same["attribution"] == "persistent", same["reason"]
    moved = replay(run, 3, "--permute-ranks")
    assert moved["attribution"] == "device", moved["reason"]
    assert moved["slot"]["index"] == 1
    assert moved["stored"]["first"]["rank"] == 1 and moved["replayed"]["first"]["rank"] == 0
    topo = orjson.loads((Path(moved["replay"]) / "topology.json").read_bytes())
    assert {r["rank"]: r["local_rank"] for r in topo["ranks"]} == {0: 1, 1: 0}


@pytest.mark.slow
def test_a_standing_bug_moves_with_the_rank(runs, root):
    """The control for `device`: ranks rotated, a skipped all-reduce on rank 1 stays on rank 1, bit for bit."""
    doc = replay(private(runs.fault("skip-allreduce", 3, 1), root), 3, "--permute-ranks")
    assert doc["attribution"] == "persistent", doc["reason"]
    assert doc["reproduces"] is True and doc["rank_shift"] == 1


@pytest.mark.slow
def test_a_store_that_its_code_does_not_reproduce_is_not_replayable(runs, ref, tmp_path):
    """The reference's store holding the bit-flip run's trajectory, resealed with disttrace's own code (verify
    calls it intact): its checkpoints are clean, its stored step 3 holds a flipped gradient. Replaying step 4
    from the checkpoint of step 2 recomputes step 3, which differs from the store exactly where the flip
    was planted: not replayable, that record named; never persistent, transient or none."""
    from test_forged_store import copied_trajectory

    forged = copied_trajectory(ref, runs.fault("bitflip-grad", 3, 1), tmp_path)
    assert cli("verify", forged).returncode == 0  # self-consistent: the seal cannot tell
    doc = replay(forged, 4, "--reference", ref)
    assert doc["attribution"] == "not-replayable", doc["reason"]
    f = doc["first_difference"]
    planted = faults.get("bitflip-grad").defaults["tensor"]
    assert (f["step"], f["rank"], f["phase"], f["tensor"]) == (3, 1, "backward", planted)
    assert doc["replayed_steps"] == [3, 4] and doc["matches_reference"] is None


@pytest.mark.slow
def test_the_gate_records_the_attribution_of_a_replay(runs, ref, root):
    """verdict.json carries the attribution the gate recomputes from the run, its replay and the reference;
    without a replay the key is absent (the document is what it was)."""
    run = private(runs.fault("bitflip-grad", 3, 1), root)
    before = cli("gate", run, "--reference", ref, "--json")
    assert before.returncode == 1 and "attribution" not in orjson.loads(before.stdout)
    replay(run, 3)
    after = cli("gate", run, "--reference", ref, "--json")
    a = orjson.loads(after.stdout)["attribution"]
    assert (a["step"], a["attribution"], a["reproduces"]) == (3, "transient", False)
    assert "attribution" in orjson.loads((run / "verdict.json").read_bytes())


@pytest.mark.slow
def test_an_attached_script_is_replayed_with_its_own_command(tmp_path):
    """`disttrace replay RUN --step S -- CMD`: the user's script runs again attached to a replay store beside
    RUN, here resuming from RUN's own checkpoint of step 2 with run.resume(); a skipped all-reduce on rank 1
    at step 3 (kept: it recurs) reproduces bit for bit."""
    from conftest import last_line
    from test_attach_cli import CMD

    cli("run", "--out", tmp_path, "--", *CMD, check=0)
    inject = ("inject", "--out", tmp_path, "--fault", "skip-allreduce", "--step", 3, "--rank", 1)
    run = last_line(cli(*inject, "--", *CMD, check=0))
    again = [*CMD, "--resume", run / "checkpoints" / "step-000002"]
    proc = cli("replay", run, "--step", 3, "--json", "--", *again, timeout=300, check=0)
    doc = orjson.loads(proc.stdout)
    assert doc["attribution"] == "persistent", doc["reason"]
    assert doc["reproduces"] is True and doc["matches_reference"] is False
    assert doc["from_checkpoint"] == 2 and doc["replayed_steps"] == [3]
    out = Path(doc["replay"])
    assert out.parent == run.parent and run_info(out)["path"] == "replay"
    assert cli("verify", out).returncode == 0
    # an attached run replayed without its command is refused (disttrace runs no command of the store's)
    assert cli("replay", run, "--step", 3).returncode == 2


@pytest.mark.slow
def test_a_replay_at_depth_states_it_in_its_manifest_and_resumes_the_run_checkpoint(runs, root):
    """`--depth module`: the replay's lock asks for step S at depth (record.depth, what `zoom` records), its
    manifest id is its own, and it still resumes the checkpoint of the run it replays (what is recorded at
    depth is not what is computed) and lives beside it; the attribution is unchanged."""
    run = private(runs.fault("bitflip-grad", 3, 1), root)
    doc = replay(run, 3, "--depth", "module")
    assert doc["attribution"] == "transient", doc["reason"]
    out = Path(doc["replay"])
    lock = orjson.loads((out / "manifest.lock.json").read_bytes())
    assert lock["manifest"]["record"]["depth"] == {"step": 3, "level": "module"}
    assert (
        lock["manifest_id"]
        != orjson.loads((run / "manifest.lock.json").read_bytes())["manifest_id"]
    )
    assert out.parent == run.parent and doc["from_checkpoint"] == 2
