"""A parameter corrupted at the optimizer step, across layouts, is named at its own step, phase and tensor by
`diff --mode numeric` through its update record (run/record/updates.py, analysis/updates.py): the parameter itself
has no sound bound under Adam, its update has. The oracle is the planted fault's coordinates; the control is
the honest pair of layouts, equal under the same bound, with clipping engaged and weight decay on."""

from __future__ import annotations

import json

import pytest
from conftest import DEFAULT, cli

from disttrace.analysis.updates import step_allowance
from disttrace.store.rundir import Run

pytestmark = pytest.mark.slow  # three short 2-rank jobs

TENSOR = "layers.2.ffn_norm.weight"
MODEL = [
    *("--set", "model.n_layers=4", "--set", "training.steps=4", "--set", "checkpoint.interval=0"),
    # clipping engaged (the default model's global norm is above 0.05 every step) and decoupled decay on
    *("--set", "training.max_grad_norm=0.05", "--set", "training.weight_decay=0.1"),
]
DP2 = ["--set", "parallelism.dp=2", "--set", "training.grad_accum_steps=2"]
DP1 = ["--set", "parallelism.dp=1", "--set", "training.grad_accum_steps=4"]


def _diff(runs, a, b) -> tuple[int, dict]:
    proc = cli("diff", a, b, "--mode", "numeric", "--json", timeout=300)
    return proc.returncode, json.loads(proc.stdout)


def test_a_parameter_moved_at_the_step_is_named_there(runs):
    reference = runs.get("run", DEFAULT, *MODEL, *DP1)
    faulty = runs.get(
        "inject",
        DEFAULT,
        *MODEL,
        *DP2,
        *("--fault", "bitflip-param", "--step", "3", "--rank", "0"),
        *("--param", f"tensor={TENSOR}", "--param", "bit=22", "--param", "element=5"),
    )
    honest = runs.get("run", DEFAULT, *MODEL, *DP2)

    # every whole parameter has its update record, at every step
    recs = [r for r in Run(honest).records(0) if r["phase"] == "optimizer"]
    names = {r["tensor"] for r in recs}
    params = {n for n in names if ":" not in n}
    assert {n + ":update" for n in params} <= names
    limit = step_allowance(Run(honest).manifest_doc)
    ups = [r for r in recs if r["tensor"].endswith(":update")]
    assert ups and all(0 <= r["norm"] <= limit for r in ups)  # each run inside its own bound

    # the control: the honest layouts compare equal, the update records judged and well inside the bound
    code, doc = _diff(runs, reference, honest)
    assert code == 0 and doc["first_divergence"] is None, doc.get("first_divergence")

    # the fault (bit 22 of an element near 1.0: it becomes ~1.5) at its own step, phase and tensor
    (event,) = Run(faulty).fault_events()  # what the fault says it changed
    moved = abs(float(event.model_extra["after"]) - float(event.model_extra["before"]))
    assert moved > 100 * limit
    code, doc = _diff(runs, reference, faulty)
    first = doc["first_divergence"]
    assert code == 1
    assert (first["step"], first["phase"], first["tensor"]) == (3, "optimizer", TENSOR + ":update")
    # err / bound is the fault's size over the Adam step's (the honest run's record is below the bound)
    ratio = first["rel_err"] / first["bound"]
    assert moved / limit - 1 <= ratio * (1 + 1e-6) and ratio <= moved / limit + 1


def test_a_run_without_some_update_records_compares_as_before(runs):
    """Tensor parallel places its parameters as pieces of logical tensors (its replicated norms too): their
    update records are not made (run/record/updates.py); the records one run lacks are not compared, and the
    honest pair stays equal, as a store written before update records does."""
    reference = runs.get("run", DEFAULT, *MODEL, *DP1)
    tp = runs.get("run", DEFAULT, *MODEL, "--set", "parallelism.tp=2")
    updated = lambda run: {  # noqa: E731
        r["tensor"] for r in Run(run).records(0) if r["tensor"].endswith(":update")
    }
    lacking = updated(reference) - updated(tp)
    assert lacking == updated(reference) and lacking
    code, doc = _diff(runs, reference, tp)
    assert code == 0 and doc["first_divergence"] is None, doc.get("first_divergence")


def test_record_updates_false_frees_the_copy_and_leaves_the_records_out(runs):
    """`record.updates = false` (memory-tight runs): no update records, and the pair against a run that has
    them diffs as a store written before them does; the fault then goes back to being found late."""
    reference = runs.get("run", DEFAULT, *MODEL, *DP1)
    off = runs.get("run", DEFAULT, *MODEL, *DP2, "--set", "record.updates=false")
    assert not [r for r in Run(off).records(0) if r["tensor"].endswith(":update")]
    code, doc = _diff(runs, reference, off)
    assert code == 0 and doc["first_divergence"] is None, doc.get("first_divergence")


def test_record_updates_at_its_default_keeps_the_manifest_id():
    """The manifest id hashes the dump: a default left out of it keeps every stored run's id."""
    ids = [
        json.loads(cli("freeze", DEFAULT, *extra, "--json").stdout)["manifest_id"]
        for extra in ([], ["--set", "record.updates=true"], ["--set", "record.updates=false"])
    ]
    assert ids[0] == ids[1] != ids[2]
