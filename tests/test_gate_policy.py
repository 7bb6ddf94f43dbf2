"""The gate's policy belongs to the reference: a candidate cannot loosen the tolerance it is judged by, a
policy file can state one, and --require-all turns every n/a into a failure."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from conftest import cli

# a fault that moves the final eval loss by several percent, but by far less than 90% (measured: see
# test_the_planted_fault_moves_the_eval_loss_by_several_percent)
FAULT = ("lr-skew", 3, 0, "--param", "k=20")
LOOSE = ("--set", "eval.loss_rtol=0.9")


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


@pytest.fixture(scope="module")
def loose(runs) -> Path:
    """The candidate: the planted fault, frozen with a tolerance of its own that would let it through."""
    return runs.fault(*FAULT, *LOOSE)


def gate(*args):
    proc = cli("gate", *args, "--json", timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    return proc.returncode, orjson.loads(proc.stdout)


def by_name(verdict) -> dict:
    return {c["name"]: c for c in verdict["checks"]}


def eval_loss(run_dir: Path) -> float:
    """Written by the evaluation's own fresh process, not by the gate's judgement."""
    return orjson.loads((run_dir / "eval.json").read_bytes())["eval_loss"]


@pytest.fixture(scope="module")
def judged(ref, loose):
    return gate(loose, "--reference", ref)


def test_the_planted_fault_moves_the_eval_loss_by_several_percent(judged, ref, loose):
    rel = abs(eval_loss(loose) - eval_loss(ref)) / eval_loss(ref)
    assert 0.02 < rel < 0.9, rel  # beyond the reference's tolerance, within the candidate's own


def test_a_candidate_cannot_loosen_its_own_eval_tolerance(judged, ref, loose):
    code, verdict = judged
    assert code == 1 and not verdict["pass"]
    c = by_name(verdict)
    assert c["eval_metric"]["passed"] is False and "> 0.02" in c["eval_metric"]["reason"], c[
        "eval_metric"
    ]
    pol = verdict["policy"]
    assert pol["eval"]["loss_rtol"] == 0.02
    assert pol["source"] == f"reference manifest {ref / 'manifest.lock.json'}"
    assert pol["candidate_ignored"] == {"eval.loss_rtol": 0.9}
    assert any("eval.loss_rtol = 0.9; ignored" in f for f in verdict["flags"]), verdict["flags"]
    on_disk = orjson.loads((loose / "verdict.json").read_bytes())
    assert on_disk["policy"] == pol


def test_a_policy_file_decides_and_is_recorded(judged, ref, loose, tmp_path):
    """A policy that tolerates this eval loss and requires only integrity and the eval metric: the same
    candidate passes, the failing equivalence checks are reported as advisory."""
    policy = tmp_path / "policy.toml"
    policy.write_text(
        '[eval]\nloss_rtol = 0.5\n\n[checks]\nrequired = ["checkpoint_integrity", "eval_metric", '
        '"complete"]\n'
    )
    code, verdict = gate(loose, "--reference", ref, "--policy", policy)
    c = by_name(verdict)
    assert code == 0 and verdict["pass"], verdict["checks"]
    assert c["eval_metric"]["passed"] is True and c["eval_metric"]["required"] is True
    assert (
        c["gradient_equivalence"]["passed"] is False
        and c["gradient_equivalence"]["required"] is False
    )
    pol = orjson.loads((loose / "verdict.json").read_bytes())["policy"]
    assert pol["source"] == f"policy file {policy}"
    assert pol["eval"]["loss_rtol"] == 0.5
    assert pol["checks"] == {
        "required": ["checkpoint_integrity", "eval_metric", "complete"],
        "require_all": False,
    }
    assert pol["candidate_ignored"] == {"eval.loss_rtol": 0.9}


def test_require_all_fails_a_check_that_cannot_apply(ref):
    code, verdict = gate(ref)  # no reference: gradient equivalence is n/a, and the gate passes
    assert code == 0 and by_name(verdict)["gradient_equivalence"]["passed"] is None
    assert verdict["policy"]["source"] == "default"
    code, verdict = gate(ref, "--require-all")
    c = by_name(verdict)["gradient_equivalence"]
    assert code == 1 and c["passed"] is False and c["reason"].startswith("n/a"), c
    assert verdict["policy"]["checks"]["require_all"] is True


def test_the_human_verdict_names_the_policy_and_what_was_ignored(judged, ref, loose):
    proc = cli("gate", loose, "--reference", ref, timeout=300)
    assert proc.returncode == 1
    text = " ".join(proc.stderr.split())
    assert "from the reference manifest" in text and "eval.loss_rtol = 0.9; ignored" in text, (
        proc.stderr
    )


BAD = [
    ("[eval]\nloss_rtol = -1\n", "eval.loss_rtol"),
    ("[eval]\nloss_rtol = nan\n", "eval.loss_rtol"),
    ('[eval]\nloss_rtol = "0.1"\n', "eval.loss_rtol"),
    ("[eval]\nloss_rtl = 0.1\n", "eval.loss_rtl"),
    ("[eval]\nrtol = -0.1\n", "eval.rtol"),
    ('[eval]\ncommand = ["python", "eval.py"]\n', "eval"),
    ('[checks]\nrequired = ["no_such_check"]\n', "checks.required"),
    ("[checks]\nrequire_all = 1\n", "checks.require_all"),
    ("[other]\n", "other"),
    ("[eval\n", "invalid TOML"),
]


@pytest.mark.parametrize("text,field", BAD, ids=[b[1] for b in BAD])
def test_a_bad_policy_file_is_one_line_naming_file_and_field(ref, tmp_path, text, field):
    policy = tmp_path / "policy.toml"
    policy.write_text(text)
    proc = cli("gate", ref, "--policy", policy)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(policy) in lines[0] and field in lines[0], lines[0]


def test_a_missing_policy_file_is_bad_input(ref, tmp_path):
    proc = cli("gate", ref, "--policy", tmp_path / "nope.toml")
    assert proc.returncode == 2 and "nope.toml" in proc.stderr and "not found" in proc.stderr
