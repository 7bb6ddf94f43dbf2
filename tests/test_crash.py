"""Kill the launcher itself (not one rank) in the middle of a run: no rank lives on, every reader says the
run is incomplete, nothing published is lost or corrupt, and `recover` resumes from the last checkpoint
that verifies and rejoins the reference bit for bit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from conftest import DEFAULT, ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.store.rundir import Run

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

SETS = ["--set", "training.steps=10", "--set", "checkpoint.interval=2"]


def test_killing_the_launcher_leaves_an_incomplete_recoverable_run(runs, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrace", "run", DEFAULT, *SETS, "--out", tmp_path],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120
    run_dir = None
    while time.time() < deadline:  # wait for the first published checkpoint, then kill the launcher
        found = list(tmp_path.glob("*/reference/events.jsonl"))
        if (
            found
            and b'"step":4' in found[0].read_bytes()
            and b"checkpoint_saved" in found[0].read_bytes()
        ):
            run_dir = found[0].parent
            break
        time.sleep(0.01)
    assert run_dir is not None, "the run never published a checkpoint"
    os.kill(proc.pid, signal.SIGKILL)  # the launcher (elastic agent) only; its ranks must follow
    proc.wait(timeout=30)
    time.sleep(1.0)
    assert subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True).stdout.strip() == b""
    if (run_dir / "COMPLETE").exists():
        import pytest

        pytest.skip("the kill came after the last step this time")
    show = orjson.loads(cli("show", run_dir, "--json", check=0).stdout)
    assert show["complete"] is False
    gate = cli("gate", run_dir, "--json")
    assert gate.returncode == 1 and any(
        c["name"] == "complete" and c["passed"] is False
        for c in orjson.loads(gate.stdout)["checks"]
    )
    ckpts = orjson.loads(cli("show", run_dir, "checkpoints", "--json", check=0).stdout)[
        "checkpoints"
    ]
    published = [c for c in ckpts if c["step"] is not None]
    assert published and all(c["verified"] for c in published)  # nothing published is corrupt
    rec = cli("recover", run_dir, check=0).stdout.strip().splitlines()[-1]
    last = max(c["step"] for c in published)
    assert Run(rec).info["resume"]["step"] == last
    ref = runs.get("run", DEFAULT, *SETS)
    d = diff_runs(ref, rec)
    assert d.equal and d.compared_steps.first == last + 1


def test_disk_full_ends_with_exit_3_and_an_intact_incomplete_run(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(small)], capture_output=True
        ).returncode
        != 0
    ):
        import pytest

        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    try:
        proc = cli("run", DEFAULT, "--set", "training.steps=4", "--out", small)
        assert proc.returncode == 3, proc.stderr[-2000:]
        assert (
            proc.stderr.strip().splitlines()[-1].startswith("job failed")
        )  # reported, not a crash
        run_dir = Path(proc.stdout.strip().splitlines()[-1])
        assert not (run_dir / "COMPLETE").exists()
        show = orjson.loads(cli("show", run_dir, "--json", check=0).stdout)
        assert show["complete"] is False  # readable, and says so
        ckpts = orjson.loads(cli("show", run_dir, "checkpoints", "--json", check=0).stdout)[
            "checkpoints"
        ]
        assert all(
            not c["verified"] for c in ckpts if c["step"] is None
        )  # a .partial is never taken as done
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_killing_the_launcher_during_a_checkpoint_write(runs, tmp_path):
    """A checkpoint being written lives in step-N.partial: a kill there leaves it unpublished, never a
    half checkpoint under the final name; recovery takes the last published one."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrace", "run", DEFAULT, *SETS, "--out", tmp_path],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline, run_dir = time.time() + 120, None
    while time.time() < deadline and proc.poll() is None:
        partial = [
            p
            for p in tmp_path.glob("*/reference/checkpoints/step-*.partial")
            if "000002" not in p.name
        ]
        if partial:  # the second checkpoint is being written: kill now
            run_dir = partial[0].parent.parent
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    if run_dir is None:
        import pytest

        pytest.skip("the checkpoint-write window was missed this time (polling every 2 ms)")
    time.sleep(1.0)
    for ckpt in (run_dir / "checkpoints").iterdir():
        if not ckpt.name.endswith(".partial"):
            assert (ckpt / "INDEX.json").exists()  # published only with its index
    listed = orjson.loads(cli("show", run_dir, "checkpoints", "--json", check=0).stdout)[
        "checkpoints"
    ]
    assert all(c["verified"] for c in listed if c["step"] is not None)
    rec = cli("recover", run_dir, check=0).stdout.strip().splitlines()[-1]
    assert diff_runs(runs.get("run", DEFAULT, *SETS), rec).equal


def test_killing_the_gate_leaves_no_half_verdict(runs):
    ref = runs.get("run", DEFAULT, *SETS)
    for name in ("verdict.json", "eval.json"):
        (ref / name).unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "disttrace", "gate", ref],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if subprocess.run(
            ["pgrep", "-f", "disttrace.run.evaluation.evaluate"], capture_output=True
        ).stdout.strip():
            break  # the fresh evaluation process is running
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    for name in ("verdict.json", "eval.json"):
        if (ref / name).exists():
            orjson.loads((ref / name).read_bytes())  # whole, or absent: written by rename
    assert (ref / "COMPLETE").exists() and Run(ref).complete
    again = cli("gate", ref, "--json")
    assert again.returncode == 0 and orjson.loads(again.stdout)["pass"]
