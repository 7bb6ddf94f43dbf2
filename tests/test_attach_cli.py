"""The three paths on a user's own script: `disttrace run -- torchrun ... train.py`, `disttrace
inject ... -- torchrun ... train.py` and the script resuming from its own checkpoint with run.resume().
The oracle is the request: the fault's (step, rank) and its catalog hook point; the checkpoint it resumed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli, last_line

from disttrace.analysis.diff import diff_runs
from disttrace.store.rundir import Run

SCRIPT = str(ROOT / "tests" / "scripts" / "accum_train.py")
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
CMD = [TORCHRUN, "--nproc-per-node", "2", SCRIPT, "--steps", "4", "--checkpoint-every", "2"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("user-cmd")
    ref = last_line(cli("run", "--out", out, "--", *CMD, check=0))
    fault = last_line(
        cli(
            "inject",
            "--out",
            out,
            "--fault",
            "skip-allreduce",
            "--step",
            "3",
            "--rank",
            "1",
            "--",
            *CMD,
            check=0,
        )
    )
    rec = last_line(
        cli(
            "run",
            "--out",
            out,
            "--",
            *CMD,
            "--resume",
            ref / "checkpoints" / "step-000002",
            check=0,
        )
    )
    return {"out": out, "reference": ref, "fault": fault, "recovered": rec}


def test_run_passes_a_prepared_directory_to_the_command(paths):
    ref = Run(paths["reference"])
    assert ref.complete and ref.info["path"] == "reference" and ref.info["command"] == CMD
    assert ref.manifest_doc["config"]["steps"] == 4 and ref.lock["source"] == "disttrace.api"
    assert cli("verify", ref.path).returncode == 0  # sealed like a harness run
    gate = orjson.loads(cli("gate", ref.path, "--json").stdout)
    checks = {c["name"]: c["passed"] for c in gate["checks"]}
    assert (
        checks["checkpoint_integrity"]
        and checks["replica_consistency"]
        and checks["eval_metric"] is None
    )


def test_inject_fires_the_catalog_entry_once_at_its_point(paths):
    fired = [e for e in Run(paths["fault"]).events().records if e["event"] == "fault_fired"]
    assert [(e["fault"], e["step"], e["rank"], e["point"]) for e in fired] == [
        ("skip-allreduce", 3, 1, "reduce")
    ]
    f = diff_runs(paths["reference"], paths["fault"]).first_divergence
    assert (f.step, f.phase, f.rank) == (3, "reduce", 1), f
    proc = cli("check", paths["fault"], "--json")
    assert proc.returncode == 1 and orjson.loads(proc.stdout)["first"]["step"] == 3


def test_the_script_resumes_from_its_checkpoint_as_the_recovered_path(paths):
    rec = Run(paths["recovered"])
    assert rec.info["path"] == "recovered" and rec.info["resume"]["step"] == 2
    d = diff_runs(paths["reference"], paths["recovered"])
    assert d.equal and (d.compared_steps.first, d.compared_steps.last) == (3, 4), d.compared_steps


def test_a_fault_needing_a_point_the_script_lacks_is_refused(paths):
    """No DDP in the script (its own all-reduce): there is no point right before a gradient collective."""
    proc = cli(
        "inject",
        "--out",
        paths["out"],
        "--fault",
        "skip-allreduce",
        "--step",
        "1",
        "--rank",
        "0",
        "--",
        *CMD,
        "--engine",
        "manual",
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "collective_hook" in lines[-1] and "--fault" in lines[-1], (
        proc.stderr[-2000:]
    )


def test_unknown_fault_parameter_is_refused_before_anything_runs(paths):
    proc = cli(
        "inject",
        "--out",
        paths["out"],
        "--fault",
        "bitflip-grad",
        "--step",
        "1",
        "--rank",
        "0",
        "--param",
        "nope=1",
        "--",
        "false",
    )
    assert proc.returncode == 2 and "nope" in proc.stderr
