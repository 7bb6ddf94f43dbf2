"""The independent gate refuses what a loss curve would accept, and the lab runs the whole method."""

from __future__ import annotations

import orjson
import pytest
from conftest import DEFAULT, SHORT, cli

from disttrace.store.rundir import Run


def gate(run_dir, *ref):
    proc = cli("gate", run_dir, *(["--reference", ref[0]] if ref else []), "--json")
    return proc.returncode, orjson.loads(proc.stdout)


def checks(verdict):
    return {c["name"]: c["passed"] for c in verdict["checks"]}


def test_gate_passes_the_reference_with_a_fresh_process_evaluation(runs):
    ref = runs.reference()
    code, verdict = gate(ref)
    assert code == 0 and verdict["pass"], verdict
    assert checks(verdict)["gradient_equivalence"] is None  # nothing to compare with: not claimed
    ev = orjson.loads((ref / "eval.json").read_bytes())
    assert ev["process"].startswith("fresh single process")
    assert ev["split"]["eval_in_train"] == 0 and len(ev["split"]["eval_sha256"]) == 64
    assert 0 < ev["token_accuracy"] < 1 and ev["eval_loss"] > 0 and ev["tokens"] > 0
    assert (ref / "verdict.json").exists()


def test_silent_fault_with_a_plausible_loss_fails_the_gate(runs):
    """bitflip-param's default flips a mantissa bit: the loss curve is indistinguishable, the gate is not."""
    ref = runs.reference()
    fault = runs.fault("bitflip-param", 3, 0)
    lr, lf = Run(ref).losses(), Run(fault).losses()
    assert abs(lf[4] - lr[4]) / lr[4] < 0.01  # a throughput/loss dashboard would call this fine
    code, verdict = gate(fault, ref)
    assert code == 1 and not verdict["pass"]
    assert checks(verdict)["gradient_equivalence"] is False
    assert (
        checks(verdict)["checkpoint_integrity"] is True
    )  # it is not the checkpoints that are wrong


def test_straggler_passes_on_numerics_and_is_flagged(runs):
    ref = runs.reference()
    code, verdict = gate(runs.fault("slow-rank", 3, 1, "--param", "seconds=0.6"), ref)
    assert code == 0 and verdict["pass"]
    assert any("straggler: rank 1 at step 3" in f for f in verdict["flags"])


def test_gate_fails_a_corrupt_checkpoint_naming_the_file(runs):
    code, verdict = gate(runs.fault("corrupt-checkpoint", 2, 1), runs.reference())
    c = {x["name"]: x for x in verdict["checks"]}
    assert code == 1 and c["checkpoint_integrity"]["passed"] is False
    assert "__1_0.distcp" in c["checkpoint_integrity"]["reason"]


def test_gate_fails_a_checkpoint_saved_without_optimizer_state(runs):
    code, verdict = gate(runs.fault("optimizer-reset", 2, 0), runs.reference())
    c = {x["name"]: x for x in verdict["checks"]}
    assert (
        code == 1
        and c["checkpoint_integrity"]["passed"] is False
        and "optim" in c["checkpoint_integrity"]["reason"]
    )


def test_gate_bad_input(tmp_path):
    proc = cli("gate", tmp_path / "missing")
    assert proc.returncode == 2 and "missing" in proc.stderr


@pytest.mark.slow
def test_lab_runs_the_whole_method_and_judges_the_prediction(runs):
    proc = cli(
        "lab",
        DEFAULT,
        *SHORT,
        "--fault",
        "skip-allreduce",
        "--step",
        3,
        "--rank",
        1,
        "--predict",
        "reduce@3:1",
        "--json",
        "--out",
        runs.root,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = orjson.loads(proc.stdout)
    assert res["accepted"] and res["prediction"]["held"]
    assert res["paths"]["reference"]["run_dir"] == str(
        runs.reference()
    )  # the verified reference was reused
    assert res["paths"]["fault"]["gate"] is False and res["paths"]["recovered"]["gate"] is True
    assert res["paths"]["recovered"]["equal_to_reference"] is True
    f = res["paths"]["fault"]["first_divergence"]
    assert (f["step"], f["phase"], f["rank"]) == (3, "reduce", 1)
    # the same lab with a wrong prediction says which coordinate missed
    wrong = cli(
        "lab",
        DEFAULT,
        *SHORT,
        "--fault",
        "skip-allreduce",
        "--step",
        3,
        "--rank",
        1,
        "--predict",
        "backward@3:0",
        "--json",
        "--out",
        runs.root,
        timeout=400,
    )
    pred = orjson.loads(wrong.stdout)["prediction"]
    assert (
        not pred["held"]
        and any(m.startswith("phase") for m in pred["missed"])
        and any(m.startswith("rank") for m in pred["missed"])
    )


def test_lab_list_shows_every_topic():
    labs = orjson.loads(cli("lab", "--list", "--json", check=0).stdout)
    topics = {lab["topic"] for lab in labs}
    assert {"A", "B", "D", "E", "F", "G", "H", "J", "K", "L", "M", "N", "O"} <= topics
    assert all(lab["status"] == "runnable" or lab.get("reason") for lab in labs)
