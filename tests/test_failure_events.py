"""`show` and `report` list every kind of failure the store's events can hold (records.FAILURE_EVENTS), each
with what it says: the live check's stop names its step, phase and group."""

from __future__ import annotations

import html
import shutil

import orjson
from conftest import cli

from disttrace.report import build_report
from disttrace.store.events import EVENT_LINES
from disttrace.store.records import FAILURE_EVENTS, Event
from disttrace.store.writers import event

# as the writers log them (run/record/livecheck.py, run/job/worker.py, run/job/launch.py)
WRITTEN = {
    Event.LIVE_CHECK_FAILED: (
        {"step": 3, "phase": "reduce", "group": [0, 1], "digests": {"0": "aa", "1": "bb"}},
        "step 3: reduce copies over group [0, 1] differ",
    ),
    Event.RANK_FAILED: ({"rank": 1, "error": "RuntimeError: boom"}, "RuntimeError: boom"),
    Event.JOB_FAILED: ({"reason": "rank 1 exited with 1"}, "rank 1 exited with 1"),
}


def test_show_and_report_list_every_failure_event(runs, tmp_path):
    assert set(WRITTEN) == set(FAILURE_EVENTS)  # a new failure kind needs its line here
    run = tmp_path / "run"
    shutil.copytree(runs.reference(), run)
    for kind, (fields, _) in WRITTEN.items():
        event(run, EVENT_LINES[kind](**fields))
    shown = orjson.loads(cli("show", run, "--json", check=0).stdout)
    assert [f["event"] for f in shown["failures"]] == list(WRITTEN)
    text = cli("show", run, check=0).stderr  # the human view goes to stderr
    page = build_report([run], tmp_path / "report.html").read_text(encoding="utf-8")
    for kind, (_, says) in WRITTEN.items():
        assert f"{kind}: {says}" in text, text
        assert f"{kind}: {html.escape(says)}" in page


def test_a_job_started_again_in_its_run_directory_is_refused(runs, tmp_path):
    """A run directory holds one attempt: a job restarted into it (torchrun --max-restarts, or the worker run
    again) appended a second step chain to the first's records, and `verify` then called the run edited."""
    import os
    import subprocess
    import sys

    run = tmp_path / "run"
    shutil.copytree(runs.reference(), run)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            "29677",
            "-m",
            "disttrace.worker",
            "--run-dir",
            str(run),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    assert (
        "already holds an attempt's steps" in proc.stderr and "disttrace recover" in proc.stderr
    ), proc.stderr[-2000:]
    assert cli("verify", run).returncode == 0  # the first attempt's records, untouched
