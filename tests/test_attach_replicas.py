"""Every quantity a tensor-parallel, sequence-parallel or FSDP2 job replicates, checked at the phase it first
disagrees, with no reference (`check`), on attached DTensor TP, SP and FSDP2 scripts (tests/scripts/tp_bugs.py,
2 ranks on gloo, attached with attach's defaults), six bug families each planted in a fix and a bug variant.
Two oracles outside disttrace: the planted bug's coordinates (the step, phase and tensor where it acts),
and what each script measured itself in plain torch at step 1 (the tp ranks' losses, the row-parallel
output, the norm's and the head's reduced gradients, the clip norm): equal across ranks in the fix,
different in the bug; and, under sequence parallelism, the ranks' losses summed against the same model's
loss computed whole in one process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.store.jsonlines import read_json
from disttrace.store.rundir import Run

pytestmark = pytest.mark.slow  # end-to-end jobs of the full tier (`make test-all`)

SCRIPT = ROOT / "tests" / "scripts" / "tp_bugs.py"

VARIANTS = {
    "tp-fix": ["--engine", "tp"],
    "tp-fix-again": ["--engine", "tp"],
    "loss-local-stats": ["--engine", "tp", "--bug", "loss-local-stats"],
    "unsummed-row": ["--engine", "tp", "--bug", "unsummed-row"],
    "unreduced-norm": ["--engine", "tp", "--bug", "unreduced-norm"],
    "dropout-rng": ["--engine", "tp", "--bug", "dropout-rng"],
    "sp-fix": ["--engine", "sp"],
    "sp-unreduced-head": ["--engine", "sp", "--bug", "sp-unreduced-head"],
    "fsdp-fix": ["--engine", "fsdp"],
    "local-clip": ["--engine", "fsdp", "--bug", "local-clip"],
}
# what each bug changes, as the script measured it (plain torch, step 1), and the fix it is planted in
MEASURED = {
    "loss-local-stats": ("tp-fix", "loss"),
    "unsummed-row": ("tp-fix", "down_sum"),
    "unreduced-norm": ("tp-fix", "norm_grad"),
    "dropout-rng": ("tp-fix", "down_sum"),
    "sp-unreduced-head": ("sp-fix", "head_grad"),
    "local-clip": ("fsdp-fix", "clip_norm"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    out = tmp_path_factory.mktemp("tp-bugs")
    made = {}
    for name, args in VARIANTS.items():
        measure = out / f"measure-{name}"
        proc = subprocess.run(
            [sys.executable, SCRIPT, "--out", out, "--measure", measure, *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=ROOT,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        measured = [orjson.loads(Path(f"{measure}-rank{r}.json").read_bytes()) for r in (0, 1)]
        made[name] = (Path(proc.stdout.strip().splitlines()[-1]), measured)
    return made


def check(run: Path) -> tuple[int, dict]:
    proc = cli("check", run, "--json")
    return proc.returncode, orjson.loads(proc.stdout)


@pytest.mark.parametrize("bug", sorted(MEASURED))
def test_the_bug_is_real_and_the_fix_is_not(runs, bug):
    """Measured without disttrace: the bug makes the ranks' copies of that quantity differ; the fix not."""
    fix, key = MEASURED[bug]
    a, b = (m[key] for m in runs[fix][1])
    assert a == b, (fix, key, a, b)
    a, b = (m[key] for m in runs[bug][1])
    assert a != b, (bug, key, a, b)


@pytest.mark.parametrize("fix", ["tp-fix", "sp-fix", "fsdp-fix"])
def test_the_fixes_are_consistent_and_twice_bit_identical(runs, fix):
    code, doc = check(runs[fix][0])
    assert code == 0 and doc["consistent"] is True, doc
    if fix == "tp-fix":
        d = diff_runs(runs["tp-fix"][0], runs["tp-fix-again"][0])
        assert d.mode == "bitwise" and d.equal and d.compared_steps.count == 2


@pytest.mark.parametrize(
    "bug,where",
    [
        ("loss-local-stats", (1, 0, "loss", "loss")),  # the tp ranks' losses differ
        ("unsummed-row", (1, 0, "forward", "down")),  # the row-parallel output, before the loss
        (
            "dropout-rng",
            (1, 0, "forward", "down"),
        ),  # the mask on the reduced output, before the loss
        ("unreduced-norm", (1, 0, "reduce", "norm.weight")),  # before the optimizer moves it
        ("sp-unreduced-head", (1, 0, "reduce", "head.weight")),  # the per-shard losses are not it
        ("local-clip", (1, 0, "clip", "grad_norm")),  # the norm, not the first gradient
    ],
)
def test_check_names_the_earliest_phase_a_rule_breaks(runs, bug, where):
    code, doc = check(runs[bug][0])
    assert code == 1, doc
    f = doc["first"]
    assert (f["step"], f["micro_batch"], f["phase"], f["tensor"]) == where, f
    assert sorted(f["group"]) == [0, 1] and f["tie"]  # two copies: both are suspects


def test_diff_places_the_fsdp2_local_clip_at_the_clip(runs):
    f = diff_runs(runs["fsdp-fix"][0], runs["local-clip"][0]).first_divergence
    assert (f.step, f.phase) == (1, "clip"), f


def test_the_rules_come_from_the_engine_and_the_styles(runs):
    rules = read_json(runs["tp-fix"][0] / "replicas.json")["rules"]
    by_phase = {r["phase"]: r for r in rules if r["dim"] == "mesh:tp"}
    assert {"data", "loss", "forward", "reduce", "optimizer"} <= set(by_phase), rules
    assert by_phase["forward"]["tensors"] == ["down"]  # RowwiseParallel: output Replicate
    assert set(by_phase["reduce"]["tensors"]) == {"embed.weight", "norm.weight"}  # held whole


def test_attached_manifests_name_the_mesh_that_ran(runs):
    tp = Run(runs["tp-fix"][0]).manifest_doc["parallelism"]
    assert (tp["dp"], tp["tp"], tp["engine"]) == (1, 2, "DTensor")
    assert tp["mesh"] == {"dims": {"tp": 2}, "replicate": [], "shard": ["tp"]}
    fsdp = Run(runs["fsdp-fix"][0]).manifest_doc["parallelism"]
    assert (fsdp["dp"], fsdp["tp"], fsdp["zero_stage"], fsdp["engine"]) == (2, 1, 3, "FSDP2")
    assert fsdp["mesh"] == {"dims": {"dp": 2}, "replicate": [], "shard": ["dp"]}
    # a tp group reads one batch: 4 samples a step, not 8
    assert Run(runs["tp-fix"][0]).lock["observed"]["global_batch"] == 4
    assert Run(runs["fsdp-fix"][0]).lock["observed"]["global_batch"] == 8


def test_sequence_parallel_losses_are_per_shard_and_sum_to_the_whole_models(runs):
    """The SP fix is right: its ranks' losses differ (each is its own tokens' share), their sum is the loss
    of the same model computed whole in one process; so the loss rule is not made there (the last styled
    module's output is sharded on the sequence), while the TP script's vocabulary-parallel loss keeps it."""
    a, b = runs["sp-fix"][1]
    assert a["loss"] != b["loss"] and a["loss_total"] == b["loss_total"]
    assert a["loss_total"] == pytest.approx(a["loss_whole"], rel=1e-6)
    sp = read_json(runs["sp-fix"][0] / "replicas.json")
    assert "loss" not in {r["phase"] for r in sp["rules"]}, sp["rules"]
    assert any("final_norm" in n for n in sp["inferred"]["notes"]), sp["inferred"]
    assert {"data", "reduce", "optimizer"} <= {r["phase"] for r in sp["rules"]}
    tp = read_json(runs["tp-fix"][0] / "replicas.json")
    assert {"phase": "loss", "dim": "mesh:tp", "relation": "agree"} in tp["rules"]


def test_replicated_outputs_are_recorded_by_default_and_nothing_else_is(runs):
    """attach's defaults: the outputs a style declares Replicate (here `down`), nothing where none is
    declared, so an FSDP2 or SP run's record section, and its manifest id, are what they were."""
    record = Run(runs["tp-fix"][0]).manifest_doc["record"]
    assert record == {"every": 1, "forward": True, "forward_modules": ["down"]}, record
    fwd = {r["tensor"] for r in Run(runs["tp-fix"][0]).records(1) if r["phase"] == "forward"}
    assert fwd == {"down"}
    for run in ("fsdp-fix", "sp-fix"):
        record = Run(runs[run][0]).manifest_doc["record"]
        assert record == {"every": 1, "forward": False, "forward_modules": []}, (run, record)
