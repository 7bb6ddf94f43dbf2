"""Zero-code recording: a training command with no disttrace line in it, pointed at as it is
(`disttrace run -- torchrun ... train.py`), gets the same evidence, checks and paths as an attached script.

The oracles are outside the code under test: the fault's requested (step, rank) and its catalog hook point;
a planted bug's first wrong value (the loss not divided by the accumulation is wrong from step 1's first
loss); the launchers' own equivalence (mp.spawn and torchrun start the same ranks); the script's own
printed loss."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli, last_line, raw_records

from disttrace.analysis.diff import diff_runs

PLAIN = str(ROOT / "tests" / "scripts" / "plain_ddp.py")
ACCELERATE = str(ROOT / "tests" / "scripts" / "accelerate_plain.py")
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
DDP2 = [TORCHRUN, "--nproc-per-node", "2", PLAIN, "--steps", "5", "--checkpoint-every", "2"]


def _run(out: Path, *command, inject: tuple = (), verb: str = "run") -> Path:
    verb_args = ["inject", *inject] if inject else [verb]
    return last_line(cli(*verb_args, "--quiet", "--out", out, "--", *command, check=0))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("zero-code")
    ck = lambda name: ["--checkpoint-dir", str(out / "script-checkpoints" / name)]  # noqa: E731
    fault = ("--fault", "skip-allreduce", "--step", "3", "--rank", "1")
    spawn = [sys.executable, PLAIN, "--steps", "5", "--checkpoint-every", "2", "--spawn"]
    runs = {
        "a": _run(out, *DDP2, *ck("a")),
        "b": _run(out, *DDP2, *ck("b")),
        "spawn": _run(out, *spawn, *ck("spawn")),
        "fault": _run(out, *DDP2, *ck("fault"), inject=fault),
        "bug": _run(out, *DDP2, *ck("bug"), "--bug", "no-accum-divide"),
    }
    resume = ["--resume", str(out / "script-checkpoints" / "a" / "step-2")]
    runs["recovered"] = _run(out, *DDP2, *ck("recovered"), *resume)
    runs["out"] = out
    return runs


def _lock(run: Path) -> dict:
    return orjson.loads((run / "manifest.lock.json").read_bytes())


def test_an_unmodified_ddp_script_is_recorded_and_says_how(ddp):
    lock = _lock(ddp["a"])
    assert lock["source"] == "zero-code" and lock["manifest"]["record"]["source"] == "zero-code"
    assert lock["manifest"]["parallelism"]["engine"] == "DDP"
    assert lock["manifest"]["optimizer"]["type"] == "torch.optim.adamw.AdamW"
    # the global batch the job ran, counted from what it fed the model: 2 ranks x 2 micro-batches x 4
    assert lock["observed"]["global_batch"] == 16
    assert lock["observed"]["micro_batches"] == {"0": 2, "1": 2}
    assert (ddp["a"] / "COMPLETE").exists()
    show = cli("show", ddp["a"], "--json", check=0)
    assert orjson.loads(show.stdout)["recorded"] == "zero-code"
    for kind in ("checkpoints", "memory", "collectives", "topology"):
        cli("show", ddp["a"], kind, check=0)
    cli("verify", ddp["a"], check=0)


def test_two_runs_of_the_command_are_bit_identical(ddp):
    result = diff_runs(ddp["a"], ddp["b"])
    assert result.equal and result.first_divergence is None
    assert orjson.loads(cli("show", ddp["a"], "--json", check=0).stdout)["ranks"]["0"]["steps"] == 5


def test_the_tutorials_mp_spawn_launch_records_the_same_run(ddp):
    assert diff_runs(ddp["a"], ddp["spawn"]).equal


def test_the_scripts_own_checkpoint_resumes_as_the_recovered_path(ddp):
    # the script saved with DCP: the run store holds its own verified copy of each step saved
    facts = orjson.loads(cli("show", ddp["a"], "checkpoints", "--json", check=0).stdout)
    assert [c["step"] for c in facts["checkpoints"]] == [2, 4]
    assert all(c["verified"] for c in facts["checkpoints"])
    info = orjson.loads((ddp["recovered"] / "run.json").read_bytes())
    assert info["path"] == "recovered" and info["resume"]["step"] == 2
    assert info["resume"]["from_run"] == str(ddp["a"])
    result = diff_runs(ddp["a"], ddp["recovered"])
    assert result.equal and result.compared_steps.first == 3


def test_a_replay_of_the_faulted_step_from_the_scripts_checkpoint_is_persistent(ddp):
    saved = ddp["out"] / "script-checkpoints"
    proc = cli(
        "replay",
        ddp["fault"],
        "--step",
        "3",
        "--reference",
        ddp["a"],
        "--json",
        "--",
        *DDP2,
        "--checkpoint-dir",
        saved / "replay",
        "--resume",
        saved / "fault" / "step-2",
        check=0,
    )
    assert orjson.loads(proc.stdout)["attribution"] == "persistent"


def test_an_injected_fault_is_found_at_its_step_and_rank(ddp):
    first = diff_runs(ddp["a"], ddp["fault"]).first_divergence
    assert (first.step, first.rank, first.phase) == (3, 1, "reduce")
    cli("diff", ddp["a"], ddp["fault"], check=1)


def test_check_passes_the_clean_run_and_fails_the_faulted_one(ddp):
    cli("check", ddp["a"], check=0)
    proc = cli("check", ddp["fault"], check=1)
    assert "step 3" in proc.stdout + proc.stderr


def test_a_loss_not_divided_by_the_accumulation_is_found_at_step_one(ddp):
    first = diff_runs(ddp["a"], ddp["bug"]).first_divergence
    assert (first.step, first.micro_batch, first.phase) == (1, 0, "loss")


def test_a_script_that_attaches_keeps_its_own_run(tmp_path):
    script = str(ROOT / "tests" / "scripts" / "accum_train.py")
    run = _run(tmp_path, TORCHRUN, "--nproc-per-node", "2", script, "--steps", "2")
    manifest = _lock(run)["manifest"]
    assert manifest["experiment"]["name"] == "accum-train"  # its attach call's name, not ours
    assert "source" not in manifest["record"]
    # the same script run outside disttrace (its attach call alone): the same records, none twice
    alone = subprocess.run(
        [sys.executable, script, "--steps", "2", "--out", tmp_path / "alone"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    direct = Path(alone.stdout.strip().splitlines()[-1])
    counts = [
        orjson.loads(cli("show", r, "--json", check=0).stdout)["ranks"] for r in (run, direct)
    ]
    assert counts[0] == counts[1]
    assert diff_runs(direct, run).equal


def test_a_command_that_trains_nothing_is_refused_in_one_line(tmp_path):
    proc = cli("run", "--out", tmp_path, "--", sys.executable, "-c", "print('hello')", check=2)
    assert "trained nothing disttrace could record" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_interpreters_own_sitecustomize_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "marker"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    cli(
        "run",
        "--out",
        tmp_path / "runs",
        "--",
        sys.executable,
        "-c",
        "pass",
        env={"PYTHONPATH": str(site)},
        check=2,
    )
    assert marker.read_text() == "ran"


def test_an_accelerate_loop_is_recorded_with_its_clip_and_faults(tmp_path):
    pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")
    cmd = [TORCHRUN, "--nproc-per-node", "2", ACCELERATE, "--steps", "4"]
    ref = _run(tmp_path, *cmd)
    lock = _lock(ref)
    assert lock["manifest"]["record"]["source"] == "zero-code"
    assert lock["observed"]["micro_batches"] == {"0": 2, "1": 2}  # accelerate's accumulation
    cli("check", ref, check=0)
    fault = _run(
        tmp_path,
        *cmd,
        inject=(
            "--fault",
            "bitflip-grad",
            "--step",
            "3",
            "--rank",
            "1",
            "--param",
            "micro_batch=1",
            "--param",
            "tensor=0.weight",
        ),
    )
    first = diff_runs(ref, fault).first_divergence
    assert (first.step, first.micro_batch, first.phase, first.rank) == (3, 1, "backward", 1)
    assert first.tensor == "0.weight"


def test_a_container_optimizer_steps_once_and_a_clip_in_halves_is_the_clip_phase(ddp, tmp_path):
    """ZeroRedundancyOptimizer holds the AdamW it steps (as torchtitan's OptimizersContainer does): the
    outer one is recorded, once a step; the script clips with get_total_norm + clip_grads_with_norm_,
    bound by name before any run existed. The oracle: ZeRO-1 over AdamW computes AdamW's update, so the
    losses are the plain AdamW run's."""
    cmd = [
        *DDP2[:-2],
        "--optimizer",
        "zero",
        "--clip",
        "split",
    ]  # no checkpoints: ZeRO consolidates them
    run = _run(tmp_path, *cmd)
    lock = _lock(run)
    assert lock["manifest"]["optimizer"]["type"].endswith("ZeroRedundancyOptimizer")
    facts = orjson.loads(cli("show", run, "--json", check=0).stdout)
    plain = orjson.loads(cli("show", ddp["a"], "--json", check=0).stdout)
    assert facts["ranks"]["0"]["steps"] == 5
    assert facts["loss"] == plain["loss"]
    phases = {r["phase"] for r in raw_records(run, 0) if r["step"] == 2}
    assert {"reduce", "clip", "optimizer"} <= phases


def test_the_loss_is_the_backward_computed_from_the_models_output(tmp_path):
    """torchtitan's chunked loss: each chunk backpropagates into a detached copy of the hidden states (a
    backward of its own) before the whole loss carries their gradient into the model. The recorded loss is
    the whole one, which the script prints: not the first chunk's."""
    script = str(ROOT / "tests" / "scripts" / "chunked_loss.py")
    proc = cli("run", "--out", tmp_path, "--", sys.executable, script, "--steps", "3", check=0)
    printed = {
        line.split()[1]: float(line.split()[3])
        for line in proc.stderr.splitlines()
        if line.startswith("step ") and " loss " in line
    }
    shown = orjson.loads(cli("show", last_line(proc), "--json", check=0).stdout)["loss"]
    assert set(printed) == set(shown) == {"1", "2", "3"}
    for step, loss in printed.items():
        assert shown[step] == pytest.approx(loss, rel=1e-7)
