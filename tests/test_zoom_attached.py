"""Zoom of attached scripts (docs/zoom.md, "Attached scripts"): an attached run's step is recorded at depth by
a replay of it with its own command (`disttrace replay RUN --step S --depth LEVEL -- CMD`, or the command
given to `zoom A B -- CMD`), and `zoom` compares those records with diff's rules.

tests/scripts/tp_zoom.py is the script: torch's own parallelize_module (ColwiseParallel, RowwiseParallel) over
tp=2 ranks on gloo, or plain on one rank. The oracle is the planted bug's coordinates: from step 2 on,
layers.1.down's row-parallel output is relabelled Replicate without its all-reduce; the control is the same
script without the bug, which must zoom equal against the dp=1 reference at every module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli

from disttrace.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK, BadInput

SCRIPT = str(ROOT / "tests" / "scripts" / "tp_zoom.py")
BUGGY = "layers.1.down"


def command(out: Path, *args) -> list[str]:
    return [sys.executable, SCRIPT, "--out", str(out), *map(str, args)]


def train(out: Path, *args) -> Path:
    """One run of the script, attached on its own (no `disttrace run`): its run directory."""
    proc = subprocess.run(
        command(out, *args), capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:06d}"


def replays(run: Path) -> list[Path]:
    return sorted(run.parent.glob("replay-*"))


def _json(proc) -> dict:
    return orjson.loads(proc.stdout)


def test_a_depth_request_in_run_json_is_checked_naming_the_field():
    from disttrace.run.record.depth import attached_spec

    assert attached_spec({}, "run.json") is None
    ok = attached_spec({"depth": {"step": 2, "level": "op"}}, "run.json")
    assert ok == {"step": 2, "level": "op", "global_batch": None}
    for bad, field in (
        ({"depth": 3}, "depth"),
        ({"depth": {"step": 0, "level": "module"}}, "depth.step"),
        ({"depth": {"step": True, "level": "module"}}, "depth.step"),
        ({"depth": {"step": 2, "level": "kernel"}}, "depth.level"),
        ({"depth": {"step": 2, "level": "module", "global_batch": -1}}, "depth.global_batch"),
    ):
        with pytest.raises(BadInput) as e:
            attached_spec(bad, "run.json")
        assert e.value.field == field


def _called_modules() -> list[str]:
    """The modules torch runs in one forward of the script's model (torch's own hooks, not disttrace's)."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    try:
        import tp_zoom
    finally:
        sys.path.pop(0)

    model, seen = tp_zoom.Model(), []
    for path, m in model.named_modules():
        if path:
            m.register_forward_hook(lambda *_a, p=path: seen.append(p))
    model(tp_zoom.batch(1)[0])
    return seen


def test_an_attached_step_recorded_at_depth_by_its_replay(tmp_path):
    """One rank, plain: zoom refuses an attached run it holds no depth replay of (one line, nothing
    written); `replay --depth module -- CMD` records every module torch ran, forward and backward, and its
    trajectory reproduces the stored run bit for bit (depth recording changes nothing computed); zoom then
    reads it on both sides, equal at every module."""
    run = train(tmp_path / "a", "--tp", "1", "--steps", "1")
    proc = cli("zoom", run, run, "--step", 1, "--json")
    assert proc.returncode == EXIT_BAD_INPUT and not proc.stdout
    assert "replay" in proc.stderr and "--depth module" in proc.stderr and not replays(run)
    proc = cli(
        "replay", run, "--step", 1, "--depth", "module", "--json", "--",
        *command(tmp_path / "x", "--tp", "1", "--steps", "1"), timeout=300, check=0,
    )  # fmt: skip
    doc = _json(proc)
    assert doc["attribution"] == "none" and doc["reproduces"] is True, doc["reason"]
    deep = Path(doc["replay"])
    recs = [orjson.loads(x) for x in (deep / "depth" / "rank-00000.jsonl").read_text().splitlines()]
    called = _called_modules()
    forward = [r["module"] for r in recs if r["direction"] == "forward"]
    backward = [r["module"] for r in recs if r["direction"] == "backward"]
    assert forward == called  # execution order: a module after the modules inside it
    assert sorted(backward) == sorted(called) and {r["step"] for r in recs} == {1}
    z = _json(cli("zoom", run, run, "--step", 1, "--json", check=EXIT_OK))
    assert z["first_divergence"] is None and z["deep"]["produced_by"] == "replay"
    assert z["deep"]["compared"] == len(recs) and replays(run) == [deep]


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tp-zoom")
    return {
        "ref": train(out / "ref", "--tp", 1),
        "bug": train(out / "bug", "--tp", 2, "--bug-from", 2),
        "fix": train(out / "fix", "--tp", 2),
        "out": out,
    }


@pytest.mark.slow
def test_zoom_names_the_unsummed_row_parallel_module_of_an_attached_tp_script(tp_runs):
    """The dp=1 reference's step 2 is recorded at depth by its replay from its checkpoint of step 1; zoom's
    command replays the tp=2 script from its own; the first module whose output differs is the planted one,
    forward, compared as logical tensors within the derived bound. A second zoom reuses both replays."""
    ref, bug, out = tp_runs["ref"], tp_runs["bug"], tp_runs["out"]
    doc = _json(
        cli(
            "replay", ref, "--step", 2, "--depth", "module", "--json", "--",
            *command(out / "x", "--tp", 1, "--resume", ckpt(ref, 1)), timeout=300, check=0,
        )
    )  # fmt: skip
    assert doc["reproduces"] is True and doc["from_checkpoint"] == 1
    proc = cli(
        "zoom", ref, bug, "--json", "--",
        *command(out / "x", "--tp", 2, "--bug-from", 2, "--resume", ckpt(bug, 1)),
        timeout=600, check=EXIT_DIVERGED,
    )  # fmt: skip
    z = _json(proc)
    f = z["first_divergence"]
    assert f["step"] == 2 and (f["module"], f["direction"]) == (BUGGY, "forward"), z["inside"]
    assert z["deep"]["logical"] and z["deep"]["produced_by"] == "replay"
    assert f["at_depth"]["rel_err"] > f["at_depth"]["bound"] > 0
    # the tp=2 replay resumed the run's checkpoint and reproduced it; the next zoom runs nothing new
    (deep_b,) = replays(bug)
    info = orjson.loads((deep_b / "run.json").read_bytes())
    assert info["resume"]["step"] == 1 and info["depth"]["level"] == "module"
    again = _json(cli("zoom", ref, bug, "--json", timeout=300, check=EXIT_DIVERGED))
    assert again["first_divergence"]["module"] == BUGGY and replays(bug) == [deep_b]
    # op depth compares runs of one topology: refused across these
    proc = cli("zoom", ref, bug, "--depth", "op", "--json")
    assert proc.returncode == EXIT_BAD_INPUT and "--depth" in proc.stderr


@pytest.mark.slow
def test_the_same_attached_tp_script_without_the_bug_zooms_equal(tp_runs):
    """No false alarm: the fixed tp=2 script against the dp=1 reference is equal, and zoomed into step 2 on
    request every module's output and output gradient agree within the bound."""
    ref, fix, out = tp_runs["ref"], tp_runs["fix"], tp_runs["out"]
    assert _json(cli("zoom", ref, fix, "--json", check=EXIT_OK))["step"] is None
    cmd_ref = command(out / "x", "--tp", 1, "--resume", ckpt(ref, 1))
    if not replays(ref):  # run alone (the other test replays the reference already)
        cli("replay", ref, "--step", 2, "--depth", "module", "--", *cmd_ref, timeout=300, check=0)
    proc = cli(
        "zoom", ref, fix, "--step", 2, "--json", "--",
        *command(out / "x", "--tp", 2, "--resume", ckpt(fix, 1)), timeout=600, check=EXIT_OK,
    )  # fmt: skip
    z = _json(proc)
    assert z["equal"] and z["first_divergence"] is None and z["deep"]["logical"]
    assert z["deep"]["compared"] == 2 * len(_called_modules())  # every module, both directions
    assert "agree" in z["inside"]


def test_a_command_after_dashes_is_for_zoom_only(tmp_path):
    """`diff A B -- CMD` without --zoom would run nothing: refused in one line before any run is read."""
    proc = cli("diff", tmp_path / "a", tmp_path / "b", "--", "python", "train.py")
    assert proc.returncode == EXIT_BAD_INPUT and "--zoom" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
