"""Issue 17: live progress on stderr while a job runs, stall naming, and `disttrace watch`.

The oracles are what the test itself planted (the fault's step and rank, the checkpoint interval, the step
count) and the trajectory files read here directly, never the progress display's own data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import DEFAULT, ROOT, cli, last_line, raw_records

from disttrace.errors import EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_OK

STEPS = 4
SHORT = ["--set", f"training.steps={STEPS}", "--set", "checkpoint.interval=2"]
ENV = {"DISTTRACE_PROGRESS_EVERY": "0"}  # a line per finished step seen: the order is then testable
STEP_LINE = re.compile(r"^(?:\w+: )?step (\d+)/(\d+)( loss (\S+))?")


def step_lines(stderr: str) -> list[tuple[int, int, int, float | None]]:
    """(line number, step, total, loss) of every plain progress line."""
    out = []
    for i, line in enumerate(stderr.splitlines()):
        m = STEP_LINE.match(line)
        if m:
            out.append(
                (i, int(m.group(1)), int(m.group(2)), float(m.group(4)) if m.group(4) else None)
            )
    return out


def losses_from_trajectory(run_dir: Path) -> dict[int, float]:
    """Mean of the loss records per step, read straight from the trajectory files."""
    acc: dict[int, list[float]] = {}
    for rank in (0, 1):
        for r in raw_records(run_dir, rank):
            if r["phase"] == "loss":
                acc.setdefault(r["step"], []).append(r["sum"])
    return {s: sum(v) / len(v) for s, v in acc.items()}


def test_inject_plain_progress_names_the_slow_rank_before_the_job_ends(tmp_path):
    # rank 1 waits before its all-reduce at step 3 until this test creates a file, which it does only once the
    # display has named the stall: the order is made here, not raced against a clock. The 60 s collective
    # timeout (the bound on rank 0's wait) caps the stall threshold at 30 s; the wait's own bound, 45 s,
    # ends a job whose stall is never named, and the assertions below then fail. Naming the last collective
    # each rank issued needs a trace written as ops are issued: the dispatch-mode tracer
    # (record.collectives=values); the default Flight Recorder copy reaches the store only at ring copies.
    go = tmp_path / "go"
    proc = run_releasing_on_stall(
        [
            "inject",
            DEFAULT,
            *SHORT,
            "--set",
            "debug.collective_timeout_s=60",
            "--set",
            "record.collectives=values",
            "--fault",
            "slow-rank",
            "--step",
            3,
            "--rank",
            1,
            "--param",
            "seconds=45",
            "--param",
            f"until={go}",
            "--out",
            tmp_path / "runs",
        ],
        go,
    )
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert go.exists()  # released by the stall line, not by the wait's bound
    run_dir = last_line(proc)
    lines = proc.stderr.splitlines()
    steps = step_lines(proc.stderr)
    assert [s for _, s, _, _ in steps] == sorted({s for _, s, _, _ in steps}), (
        proc.stderr
    )  # increasing
    assert steps[-1][1:3] == (STEPS, STEPS) and "complete" in lines[steps[-1][0]]
    truth = losses_from_trajectory(run_dir)
    for _, step, _, loss in steps:
        assert loss is not None and abs(loss - truth[step]) < 5e-5, (step, loss, truth)
    # one line per checkpoint (interval 2) and one for the fault, with its coordinates
    assert [int(m) for m in re.findall(r"checkpoint of step (\d+) published", proc.stderr)] == [
        2,
        4,
    ]
    fault = [
        i
        for i, ln in enumerate(lines)
        if re.search(r"fault slow-rank fired at step 3 rank 1\b", ln)
    ]
    assert len(fault) == 1, proc.stderr
    stall = [i for i, ln in enumerate(lines) if ln.startswith("stall:")]
    assert len(stall) == 1, proc.stderr
    assert re.search(r"behind: rank 1 \(last step 2;", lines[stall[0]]), lines[stall[0]]
    assert "waiting: rank 0 (last step 2;" in lines[stall[0]]
    # named while rank 1 still slept: before its fault line (written after the sleep) and before step 3
    first_step3 = min(i for i, s, _, _ in steps if s >= 3)
    assert stall[0] < fault[0] and stall[0] < first_step3


def run_releasing_on_stall(args: list, go: Path) -> subprocess.CompletedProcess:
    """`disttrace ARGS`, its stderr read as it is written; `go` is created when a `stall:` line arrives."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200", **ENV}
    out = go.with_name("stdout")
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [sys.executable, "-m", "disttrace", *map(str, args)],
            stdout=stdout,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )
        killer = threading.Timer(300, proc.kill)  # a bound on a hung job, not a timing assertion
        killer.start()
        lines = []
        try:
            for line in proc.stderr:
                lines.append(line)
                if line.startswith("stall:") and not go.exists():
                    go.touch()
            proc.wait()
        finally:
            killer.cancel()
    return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), "".join(lines))


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> Path:
    """The run directory another process creates (not a timing assertion: a bounded wait)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = sorted(path.glob("*/*/run.json"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"no run directory under {path}")


def _popen(*args) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "disttrace", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def test_watch_follows_a_run_another_process_writes(watched):
    """The session's watched reference run (conftest.py; test_foundation.py compares its bits), SHORT's
    four steps, watched with a line per step."""
    run_dir, writer, watched = watched.run_dir, watched.writer, watched.watch
    out, errs = writer.stdout, writer.stderr
    assert writer.returncode == EXIT_OK, errs
    assert watched.returncode == EXIT_OK, watched.stderr
    steps = step_lines(watched.stderr)
    assert steps and steps[-1][1:3] == (STEPS, STEPS), watched.stderr
    assert (run_dir / "COMPLETE").exists()
    # the writer: --quiet shows no progress, --json is still exactly one document on stdout
    assert not step_lines(errs) and "checkpoint of step" not in errs, errs
    assert json.loads(out)["run_dir"] == str(run_dir)


def test_watch_a_failing_run_exits_3_and_a_non_run_exits_2(tmp_path):
    assert cli("watch", tmp_path).returncode == EXIT_BAD_INPUT
    writer = _popen(
        "inject",
        DEFAULT,
        *SHORT,
        "--fault",
        "kill-rank",
        "--step",
        2,
        "--rank",
        1,
        "--out",
        tmp_path,
        "--quiet",
    )
    run_dir = _wait_for(tmp_path, writer)
    watched = cli("watch", run_dir, env=ENV, timeout=300)
    writer.communicate(timeout=300)
    assert writer.returncode == EXIT_JOB_FAILED
    assert watched.returncode == EXIT_JOB_FAILED, watched.stderr
    assert re.search(r"fault kill-rank fired at step 2 rank 1\b", watched.stderr), watched.stderr
    assert not (run_dir / "COMPLETE").exists()


def test_watch_ends_a_run_whose_writer_is_gone(tmp_path):
    """No job: a prepared run nobody finishes. Its launcher lock free (the launcher died) -> 3; no lock at
    all (a user's torchrun) -> 3 once nothing was written for --timeout seconds."""
    run_dir = last_line(cli("run", DEFAULT, "--prepare-only", "--out", tmp_path, check=EXIT_OK))
    proc = cli("watch", run_dir, "--timeout", 1)
    assert proc.returncode == EXIT_JOB_FAILED and "--timeout" in proc.stderr, proc.stderr
    (run_dir / ".launcher-node0.lock").write_text(
        "12345"
    )  # what a launcher leaves; nobody holds it
    proc = cli("watch", run_dir)
    assert proc.returncode == EXIT_JOB_FAILED and "launcher is gone" in proc.stderr, proc.stderr


def test_stall_names_the_rank_that_issued_fewer_collectives(tmp_path):
    """The trace tail alone (a long trace: only its end is read) tells which rank the others wait for."""
    from disttrace.store.follow import TAIL_BYTES, behind_ranks, collective_tail

    def trace(path: Path, n: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for seq in range(n):
                f.write(
                    json.dumps(
                        {"seq": seq, "group": "0,1,2", "op": "allreduce_", "step": 3, "start": 1.0}
                    )
                    + "\n"
                )
                f.write(json.dumps({"seq": seq, "group": "0,1,2", "end": 1.1}) + "\n")

    paths = {r: tmp_path / f"collectives/rank-{r:05d}.jsonl" for r in range(3)}
    for r, n in ((0, 2000), (1, 1999), (2, 2000)):  # rank 1 has not issued the 2000th all-reduce
        trace(paths[r], n)
    assert paths[0].stat().st_size > TAIL_BYTES
    tails = {r: collective_tail(p) for r, p in paths.items()}
    assert tails[1].last.seq == 1998 and tails[0].last.seq == 1999
    assert behind_ranks({0: 2, 1: 2, 2: 2}, tails) == {1}
    assert behind_ranks({0: 3, 1: 2, 2: 3}, tails) == {1}  # a rank a whole step behind
