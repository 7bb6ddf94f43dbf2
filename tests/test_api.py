"""Other people's code: the DDP tutorial example, changed by five marked lines, writes a run store that
diff and check read like any other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.store.rundir import Run

EXAMPLE = ROOT / "examples" / "ddp_tutorial.py"


def run_example(out, *args) -> Path:
    proc = subprocess.run(
        [sys.executable, EXAMPLE, "--out", out, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def test_example_changes_at_most_ten_lines():
    marked = [
        line for line in EXAMPLE.read_text().splitlines() if line.rstrip().endswith("# disttrace")
    ]
    assert 0 < len(marked) <= 10


@pytest.mark.slow
def test_instrumented_tutorial_is_diffable(tmp_path):
    a = run_example(tmp_path)
    b = run_example(tmp_path)
    assert Run(a).complete and Run(a).ranks() == [0, 1]
    d = diff_runs(a, b)
    assert d.equal and d.compared_steps.count == 5
    assert (
        cli("check", a).returncode == 0
    )  # DDP's replica map, inferred at attach: every copy agrees
    c = run_example(
        tmp_path, "--lr", "0.01"
    )  # another learning rate: another experiment, and diff says which field
    proc = cli("diff", a, c)
    assert proc.returncode == 2 and "optimizer.param_groups.0.lr" in proc.stderr, proc.stderr
    assert any(
        "allreduce" in (x.op or "") for x in Run(a).collectives(0)
    )  # DDP's own C++ reducer, seen through the dispatch-mode tracer
