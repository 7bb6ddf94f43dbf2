"""The reference's own evaluation command, end to end (docs/gate.md, "Your own evaluation"): an attached DDP
script and a Hugging Face Trainer run, 2 CPU ranks each. The known-worse oracle is a candidate whose final
checkpoint holds the step-1 model (the script saves the wrong weights), scored against the same
evaluation script run directly on a step-1 checkpoint; the equivalent candidate is the same experiment in
another layout (accumulation 1 x micro-batch 8 instead of 2 x 4)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli, last_line

from disttrace.store.rundir import Run

pytestmark = pytest.mark.slow  # five 2-rank jobs and a dozen evaluation processes

SCRIPTS = ROOT / "tests" / "scripts"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"


def job(*argv, cwd) -> Path:
    proc = subprocess.run(
        [*map(str, argv)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return last_line(proc)


def gate(run, reference, *extra, expect):
    proc = cli("gate", run, "--reference", reference, "--json", *extra, timeout=600)
    assert proc.returncode == expect, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    v = orjson.loads(proc.stdout)
    return v, {c["name"]: c for c in v["checks"]}


def direct_score(script, checkpoint, data, cwd) -> float:
    """The evaluation script run by hand, outside the gate: the oracle for the scores the gate reports."""
    proc = subprocess.run(
        [sys.executable, str(script), str(checkpoint), str(data)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["eval_loss"]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    work = tmp_path_factory.mktemp("usereval")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import eval_train
    finally:
        sys.path.remove(str(SCRIPTS))
    (work / "heldout.json").write_text(json.dumps(eval_train.heldout()))
    (work / "other.json").write_text("[[1, 2, 3]]")
    script = SCRIPTS / "eval_train.py"
    train = [sys.executable, script, "--out", work / "runs", "--eval-data", "heldout.json"]
    return {
        "work": work,
        "reference": job(*train, cwd=work),
        "equivalent": job(*train, "--accum", "1", "--micro", "8", cwd=work),
        "stale": job(*train, "--stale-final", cwd=work),
        "own": job(*train, "--stale-final", "--own-eval", "other.json", cwd=work),
    }


def test_the_reference_names_its_evaluation_in_its_manifest(ddp):
    lock = orjson.loads((ddp["reference"] / "manifest.lock.json").read_bytes())
    ev = lock["manifest"]["eval"]
    assert ev["command"][0] == "python" and ev["command"][-2:] == ["{checkpoint}", "{data}"]
    data = ddp["work"] / "heldout.json"
    assert ev["data_sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert lock["resolved"] == {"eval_data": str(data), "eval_cwd": str(ddp["work"])}


def test_the_reference_and_an_equivalent_candidate_pass(ddp):
    ref = ddp["reference"]
    want = direct_score(
        SCRIPTS / "eval_tiny.py",
        ref / "checkpoints" / "step-000006",
        ddp["work"] / "heldout.json",
        ddp["work"],
    )
    for cand in (ref, ddp["equivalent"]):
        v, checks = gate(cand, ref, expect=0)
        assert checks["eval_metric"]["passed"] is True, checks["eval_metric"]
        assert v["reference_eval"]["score"] == want  # the gate's score is the script's own
        assert v["eval"]["command"] == v["reference_eval"]["command"]
        assert v["eval"]["data_sha256"] == v["policy"]["eval"]["data_sha256"]
        index = cand / "checkpoints" / "step-000006" / "INDEX.json"
        assert v["eval"]["index_sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()
        assert not [f for f in v["flags"] if "evaluation" in f], v["flags"]  # (stragglers may be)
    assert (
        gate(ddp["equivalent"], ref, expect=0)[0]["eval"]["cached"] is True
    )  # scored once per bytes


def test_a_final_checkpoint_of_the_step_1_model_fails_naming_both_scores(ddp):
    ref = ddp["reference"]
    heldout = ddp["work"] / "heldout.json"
    worse = direct_score(
        SCRIPTS / "eval_tiny.py", ref / "checkpoints" / "step-000001", heldout, ddp["work"]
    )
    best = direct_score(
        SCRIPTS / "eval_tiny.py", ref / "checkpoints" / "step-000006", heldout, ddp["work"]
    )
    assert (
        worse > best * 1.01
    )  # the oracle itself: the step-1 model is worse by more than the tolerance
    v, checks = gate(ddp["stale"], ref, expect=1)
    ev = checks["eval_metric"]
    assert ev["passed"] is False
    assert v["eval"]["score"] == worse and v["reference_eval"]["score"] == best
    assert f"{worse:.6g}" in ev["reason"] and f"{best:.6g}" in ev["reason"], ev["reason"]
    assert "fails eval_loss <= reference + 0 + 0.01*|reference|" in ev["reason"]


def test_a_candidate_naming_its_own_evaluation_is_ignored_and_flagged(ddp):
    """Its own command prints a perfect score on other data; the gate runs the reference's and fails it."""
    own = orjson.loads((ddp["own"] / "manifest.lock.json").read_bytes())["manifest"]["eval"]
    assert "print" in own["command"][-1]
    v, checks = gate(ddp["own"], ddp["reference"], expect=1)
    assert checks["eval_metric"]["passed"] is False
    assert v["eval"]["command"] == v["reference_eval"]["command"] != own["command"]
    assert v["eval"]["data"] == str(ddp["work"] / "heldout.json")
    flag = [f for f in v["flags"] if "its own evaluation" in f]
    assert flag and "ignored, never run" in flag[0] and "eval.command" in flag[0], v["flags"]
    ignored = v["policy"]["candidate_ignored"]
    assert ignored["eval.command"] == own["command"]
    assert ignored["eval.data"] == str(ddp["work"] / "other.json")


def test_the_candidates_own_evaluation_never_runs_without_a_reference(ddp):
    proc = cli("gate", ddp["own"], "--json", timeout=300)
    v = orjson.loads(proc.stdout)
    ev = {c["name"]: c for c in v["checks"]}["eval_metric"]
    assert ev["passed"] is None and "no held-out evaluation" in ev["reason"]
    assert any("its own evaluation" in f for f in v["flags"])
    proc = cli("gate", ddp["own"], "--json", "--require-all", timeout=300)
    ev = {c["name"]: c for c in orjson.loads(proc.stdout)["checks"]}["eval_metric"]
    assert proc.returncode == 1 and ev["passed"] is False  # n/a fails under --require-all


def policy(tmp_path, work, command, **extra) -> Path:
    data = work / "heldout.json"
    lines = [
        "[eval]",
        f"command = {json.dumps(command)}",
        f'data = "{data}"',
        f'data_sha256 = "{hashlib.sha256(data.read_bytes()).hexdigest()}"',
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
    ]
    p = tmp_path / "policy.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


@pytest.mark.parametrize(
    "code,timeout,reason",
    [
        ("import time; time.sleep(120)", 2, "ran past its timeout (2 s) and was killed"),
        (
            "raise SystemExit('cannot load the checkpoint')",
            60,
            "exited 1: cannot load the checkpoint",
        ),
        ("print('evaluated')", 60, "last line is not a JSON object: 'evaluated'"),
    ],
)
def test_a_command_that_hangs_crashes_or_prints_no_metric_fails_in_one_line(
    ddp, tmp_path, code, timeout, reason
):
    p = policy(tmp_path, ddp["work"], ["python", "-c", code], timeout_s=timeout)
    v, checks = gate(ddp["equivalent"], ddp["reference"], "--policy", p, expect=1)
    ev = checks["eval_metric"]
    assert ev["passed"] is False and reason in ev["reason"] and "\n" not in ev["reason"], ev
    assert ev["reason"].startswith("the candidate cannot be scored: the evaluation command")
    assert v["eval"] is None


def test_changed_held_out_data_fails_before_the_command_runs(ddp, tmp_path):
    marker = tmp_path / "ran"
    p = policy(tmp_path, ddp["work"], ["python", "-c", f"open({str(marker)!r}, 'w')"], timeout_s=30)
    text = p.read_text().replace(str(ddp["work"] / "heldout.json"), str(ddp["work"] / "other.json"))
    p.write_text(text)
    _, checks = gate(ddp["equivalent"], ddp["reference"], "--policy", p, expect=1)
    assert "other.json changed: sha256" in checks["eval_metric"]["reason"]
    assert not marker.exists()


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    pytest.importorskip("transformers", reason="transformers could not be installed here")
    work = tmp_path_factory.mktemp("hf-usereval")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import hf_eval_train
    finally:
        sys.path.remove(str(SCRIPTS))
    (work / "heldout.json").write_text(json.dumps(hf_eval_train.heldout()))
    script = SCRIPTS / "hf_eval_train.py"
    run = [TORCHRUN, "--nproc-per-node", "2", script, work / "runs", "heldout.json"]
    return {
        "work": work,
        "reference": job(*run, cwd=work),
        "stale": job(*run, "stale-final", cwd=work),
    }


def test_hf_trainer_the_callbacks_evaluation_passes_the_reference_and_fails_the_step_1_model(hf):
    ref = hf["reference"]
    lock = orjson.loads((ref / "manifest.lock.json").read_bytes())
    assert lock["manifest"]["eval"]["command"][-2:] == ["{checkpoint}", "{data}"]
    final = Run(ref).checkpoint_dirs()[-1]
    best = direct_score(
        SCRIPTS / "hf_eval_score.py", final, hf["work"] / "heldout.json", hf["work"]
    )
    v, checks = gate(ref, ref, expect=0)
    assert checks["eval_metric"]["passed"] is True and v["eval"]["score"] == best
    v, checks = gate(hf["stale"], ref, expect=1)
    ev = checks["eval_metric"]
    assert ev["passed"] is False and v["reference_eval"]["score"] == best
    worse = v["eval"]["score"]
    assert worse > best * 1.01 and f"{worse:.6g}" in ev["reason"] and f"{best:.6g}" in ev["reason"]


def test_hf_the_same_script_scores_a_trainer_output_directory(hf, tmp_path):
    """load_checkpoint reads save_pretrained's files too: the reference's final weights saved the HF way
    score what the disttrace checkpoint of them scores."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import hf_eval_train

        import disttrace.api as dt
    finally:
        sys.path.remove(str(SCRIPTS))
    final = Run(hf["reference"]).checkpoint_dirs()[-1]
    model = hf_eval_train.build_model()
    dt.load_checkpoint(final, model)
    model.save_pretrained(tmp_path / "out")
    data = hf["work"] / "heldout.json"
    a = direct_score(SCRIPTS / "hf_eval_score.py", final, data, hf["work"])
    b = direct_score(SCRIPTS / "hf_eval_score.py", tmp_path / "out", data, hf["work"])
    assert a == b


def test_lightning_the_callbacks_evaluation_scores_its_checkpoint_as_lightnings_own(tmp_path):
    """The callback's eval_command is in the manifest and the gate scores the final checkpoint it wrote;
    the same script on Lightning's own .ckpt of those weights (ModelCheckpoint) gives the same score."""
    pytest.importorskip("lightning", reason="lightning could not be installed here")
    sys.path.insert(0, str(SCRIPTS))
    try:
        import lightning_eval_train
        import torch
    finally:
        sys.path.remove(str(SCRIPTS))
    torch.save(lightning_eval_train.samples(7, 64), tmp_path / "heldout.pt")
    script = SCRIPTS / "lightning_eval_train.py"
    ref = job(
        TORCHRUN,
        "--nproc-per-node",
        "2",
        script,
        tmp_path / "runs",
        "heldout.pt",
        tmp_path / "ckpt",
        cwd=tmp_path,
    )
    assert Run(ref).manifest_doc["eval"]["command"][-2:] == ["{checkpoint}", "{data}"]
    v, checks = gate(ref, ref, expect=0)
    assert checks["eval_metric"]["passed"] is True
    own = direct_score(
        SCRIPTS / "lightning_eval_score.py",
        tmp_path / "ckpt" / "last.ckpt",
        tmp_path / "heldout.pt",
        tmp_path,
    )
    assert v["eval"]["score"] == v["reference_eval"]["score"] == own
