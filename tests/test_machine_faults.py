"""The machine failing under a run, with real signals to real process trees and a real full disk: a
cancelled job ends with exit 3 in bounded time and leaves no process, a killed launcher takes its ranks with
it, two launches into one runs root keep apart, and a full disk ends the run in one line, leaves nothing
half-written, touches no other run, and recovers into another runs root bit for bit.

Oracles: /proc and pgrep for processes, the file bytes (sha256 here) for "untouched", events.jsonl parsed
with json, and the trajectories read by pyarrow's own stream reader (conftest.raw_records)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import DEFAULT, ROOT, cli, raw_records

from disttrace.store.events import RankFailed
from disttrace.store.rundir import Run

pytestmark = pytest.mark.slow  # end-to-end jobs of the full tier (`make test-all`)

LONG = ["--set", "training.steps=40", "--set", "checkpoint.interval=2"]
BOUND_S = 30  # how long a cancelled job, or a killed launcher's ranks, may take to be gone


def start(*args, out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "disttrace", *map(str, args), "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a signal reaches the launcher only, as `kill PID` would
    )


def wait_for_checkpoint(proc: subprocess.Popen, out: Path) -> Path:
    """The run directory, once its first checkpoint is published (so the ranks are mid-run)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        for events in out.glob("*/*/events.jsonl"):
            if b"checkpoint_saved" in events.read_bytes():
                return events.parent
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no checkpoint was published: {proc.communicate()}")


def workers_of(run_dir: Path) -> set[int]:
    """Processes whose command line names the run directory (the ranks: `-m disttrace.worker --run-dir`)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"disttrace.worker" in argv and str(run_dir).encode() in argv:
                found.add(int(entry.name))
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited; only its parent's wait is missing
            out.add(pid)
    return out


def wait_gone(pids: set[int], bound: float) -> float:
    t0 = time.monotonic()
    while alive(pids) and time.monotonic() - t0 < bound:
        time.sleep(0.05)
    assert not alive(pids), f"still running after {bound} s: {alive(pids)}"
    return time.monotonic() - t0


def job_failed_reasons(run_dir: Path) -> list[str]:
    lines = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    return [e.get("reason") or "" for e in lines if e["event"] == "job_failed"]


def leftovers(root: Path) -> list[Path]:
    """What a writer leaves half done: an unpublished checkpoint, a temporary of an atomic write."""
    return [p for p in root.rglob("*") if p.name.endswith(".partial") or ".tmp-" in p.name]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_ends_the_job_with_exit_3_and_no_process_left(tmp_path, sig):
    proc = start("run", DEFAULT, *LONG, out=tmp_path)
    run_dir = wait_for_checkpoint(proc, tmp_path)
    ranks = workers_of(run_dir)
    assert len(ranks) == 2  # the world of the default manifest, seen before the signal
    t0 = time.monotonic()
    os.kill(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=BOUND_S)
    took = time.monotonic() - t0
    assert proc.returncode == 3, stderr[-3000:]
    assert took < BOUND_S
    wait_gone(ranks, 5)  # gone with the launcher, not after
    assert stdout.strip().splitlines()[-1] == str(run_dir)
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("job failed: ") and sig.name in last, stderr[-2000:]
    assert "Traceback" not in stderr and "[rank" not in stderr
    assert not (run_dir / "COMPLETE").exists()
    assert any(sig.name in r for r in job_failed_reasons(run_dir))
    show = json.loads(cli("show", run_dir, "--json", check=0).stdout)
    assert show["complete"] is False
    verify = cli("verify", run_dir)
    assert verify.returncode == 1 and sig.name in verify.stderr + verify.stdout
    assert leftovers(run_dir) == []


def test_killing_the_launcher_takes_its_ranks_within_a_bound(tmp_path):
    proc = start("run", DEFAULT, *LONG, out=tmp_path)
    run_dir = wait_for_checkpoint(proc, tmp_path)
    ranks = workers_of(run_dir)
    assert len(ranks) == 2
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: only the parent-death signal is left
    proc.communicate(timeout=BOUND_S)
    wait_gone(ranks, BOUND_S)
    took = time.monotonic() - t0
    print(f"ranks gone {took:.2f} s after SIGKILL to the launcher")
    assert not (run_dir / "COMPLETE").exists()


def test_two_launches_of_one_manifest_into_one_out_at_once(tmp_path):
    short = ["--set", "training.steps=3", "--set", "checkpoint.interval=2"]
    procs = [start("run", DEFAULT, *short, out=tmp_path) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    dirs = [Path(r[0].strip().splitlines()[-1]) for r in results]
    assert dirs[0] != dirs[1] and {d.parent for d in dirs} == {dirs[0].parent}
    assert sorted(p.name for p in dirs[0].parent.iterdir() if p.is_dir()) == sorted(
        d.name for d in dirs
    )
    for d in dirs:
        assert cli("verify", d).returncode == 0
    for rank in (0, 1):  # one manifest, the same bits: neither run took the other's records
        assert raw_records(dirs[0], rank) == raw_records(dirs[1], rank)


def _mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a {size} tmpfs here (needs root): {done.stderr.decode().strip()}"
        )


def _hashes(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_full_disk_ends_in_one_line_and_recovers_into_another_root(runs, tmp_path):
    small = tmp_path / "small"
    _mount_tmpfs(small, "12m")
    try:
        first = cli("run", DEFAULT, "--set", "training.steps=2", "--out", small, "--quiet", check=0)
        earlier = Path(first.stdout.strip().splitlines()[-1])
        before = _hashes(earlier)
        sets = ["--set", "training.steps=20", "--set", "checkpoint.interval=1"]
        proc = cli("run", DEFAULT, *sets, "--out", small, "--quiet", timeout=300)
        assert proc.returncode == 3, proc.stderr[-3000:]
        run_dir = Path(proc.stdout.strip().splitlines()[-1])
        full = os.strerror(errno.ENOSPC).lower()
        lines = [ln for ln in proc.stderr.splitlines() if full in ln.lower()]
        assert len(lines) == 1, proc.stderr
        line = lines[0]
        assert line == proc.stderr.strip().splitlines()[-1]
        assert "Traceback" not in proc.stderr and "[rank" not in proc.stderr
        # the file being written, inside the run, and the log that holds the traceback
        written = line.split(" was writing ", 1)[1].split(";", 1)[0]
        assert Path(written).is_relative_to(run_dir), line
        log = Path(line.rsplit("(traceback: ", 1)[1].rstrip(")"))
        assert log.parent == run_dir / "logs"
        text = log.read_text()
        assert "Traceback (most recent call last)" in text and os.strerror(errno.ENOSPC) in text
        # incomplete, with the reason, as the readers say it
        assert not (run_dir / "COMPLETE").exists()
        assert any(full in r.lower() for r in job_failed_reasons(run_dir))
        # each rank's own line that reached the disk says so as a field (live progress leaves those out)
        failed = [e for e in Run(run_dir).event_lines() if isinstance(e, RankFailed)]
        assert failed and all(e.disk_full for e in failed), failed
        show = cli("show", run_dir, "--json", check=0)
        assert json.loads(show.stdout)["complete"] is False
        verify = cli("verify", run_dir)
        assert verify.returncode == 1 and full in (verify.stdout + verify.stderr).lower()
        # nothing half-written, nothing else touched
        assert leftovers(small) == []
        assert _hashes(earlier) == before
        assert cli("verify", earlier).returncode == 0
        # the same run, resumed in another root from its last verified checkpoint
        published = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step-*"))
        assert published, "the disk filled before the first checkpoint"
        elsewhere = tmp_path / "elsewhere"
        rec = cli("recover", run_dir, "--out", elsewhere, check=0)
        rec_dir = Path(rec.stdout.strip().splitlines()[-1])
        assert rec_dir.is_relative_to(elsewhere)
        resume = json.loads((rec_dir / "run.json").read_text())["resume"]
        assert resume["from_run"] == str(run_dir.resolve()) and resume["step"] == published[-1]
        assert cli("verify", rec_dir).returncode == 0
        assert _hashes(earlier) == before
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)
    reference = runs.get("run", DEFAULT, *sets)
    for rank in (0, 1):
        want = [r for r in raw_records(reference, rank) if r["step"] > published[-1]]
        got = raw_records(rec_dir, rank)
        assert got and got == want  # bit for bit, from the step after the checkpoint on
