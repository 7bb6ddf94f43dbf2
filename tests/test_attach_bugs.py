"""User training scripts as first-class runs: a hand-written DDP loop with gradient accumulation
(tests/scripts/accum_train.py, 2 ranks on gloo) in a fix and a bug variant of four public silent-bug
families. The oracle is the planted bug itself: where its evidence must first differ, and whether ranks
stop agreeing. The runs are made once and shared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli, run_snippet

from disttrace.analysis.diff import diff_runs
from disttrace.store.jsonlines import iter_jsonl, read_json
from disttrace.store.rundir import Run

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

SCRIPT = ROOT / "tests" / "scripts" / "accum_train.py"

VARIANTS = {
    "fix": [],
    "fix-again": [],
    "token-norm": ["--bug", "token-norm"],
    "unwrapped": ["--bug", "unwrapped"],
    "zero-grad": ["--bug", "zero-grad"],
    "manual-fix": ["--engine", "manual"],
    "manual-fix-again": ["--engine", "manual"],
    "late-reduce": ["--engine", "manual", "--bug", "late-reduce"],
}


def run_script(out: Path, *args) -> Path:
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", out, *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("attached")
    return {name: run_script(out, *args) for name, args in VARIANTS.items()}


def first(a: Path, b: Path) -> tuple:
    d = diff_runs(a, b)
    assert not d.equal
    f = d.first_divergence
    return f.step, f.micro_batch, f.phase


@pytest.mark.parametrize("fix", ["fix", "manual-fix"])
def test_the_fix_twice_is_bit_identical_and_check_finds_nothing(runs, fix):
    d = diff_runs(runs[fix], runs[f"{fix}-again"])
    assert d.mode == "bitwise" and d.equal and d.compared_steps.count == 3
    proc = cli("check", runs[fix], "--json")
    assert proc.returncode == 0 and orjson.loads(proc.stdout)["consistent"] is True, proc.stdout


@pytest.mark.parametrize(
    "fix,bug,origin",
    [
        ("fix", "token-norm", (1, 0, "loss")),  # the first micro-batch's loss is scaled differently
        (
            "fix",
            "unwrapped",
            (1, 1, "reduce"),
        ),  # local gradients are right; the all-reduce never happens
        (
            "fix",
            "zero-grad",
            (1, 1, "backward"),
        ),  # the second micro-batch's backward has lost the first's
        (
            "manual-fix",
            "late-reduce",
            (1, 1, "backward"),
        ),  # the last backward adds to already-reduced gradients
    ],
)
def test_diff_names_the_bugs_origin(runs, fix, bug, origin):
    assert first(runs[fix], runs[bug]) == origin


@pytest.mark.parametrize("bug,phase", [("unwrapped", "reduce"), ("late-reduce", "reduce")])
def test_check_flags_the_step_where_ranks_stop_agreeing(runs, bug, phase):
    """No reference: DDP says reduced gradients agree over its group; without DDP, parameters identical at
    attach must have one reduced gradient (the last micro-batch's stayed local: the reduce shows it, before
    the optimizer moves the parameters apart) and stay identical after each optimizer step."""
    proc = cli("check", runs[bug], "--json")
    assert proc.returncode == 1, proc.stdout
    f = orjson.loads(proc.stdout)["first"]
    assert (f["step"], f["phase"]) == (1, phase) and sorted(f["group"]) == [0, 1], f


def test_attached_run_records_every_phase_in_the_harness_order(runs):
    run = Run(runs["fix"])
    recs = [r for r in run.records(0) if r["step"] == 2]
    seen = [(r["micro_batch"], r["phase"]) for r in recs]
    order = ["data", "loss", "backward"]
    # two forwards between optimizer steps: micro-batches 0 and 1; reduce/clip/optimizer after the last
    assert sorted(set(seen), key=seen.index) == [(0, p) for p in order] + [
        (1, p) for p in order
    ] + [(1, "reduce"), (1, "clip"), (1, "optimizer")]
    by = {(r["phase"], r["tensor"]): r for r in recs}
    # the clip scalars hold what torch computed: the total norm of the reduced gradients, coef = min(1, 1/norm)
    reduced = [r["norm"] for r in recs if r["phase"] == "reduce"]
    total = sum(n * n for n in reduced) ** 0.5
    assert by[("clip", "grad_norm")]["sum"] == pytest.approx(total, rel=1e-5)
    assert by[("clip", "clip_coef")]["sum"] == pytest.approx(
        min(1.0, 1.0 / (total + 1e-6)), rel=1e-5
    )
    # the lr once, where the harness records it in a step that clips: clip's, not the optimizer's
    assert by[("clip", "lr")]["sum"] == 1e-2 and ("optimizer", "param_groups.0.lr") not in by
    assert run.losses()[2] > 0


def test_attached_run_store_is_complete(runs):
    run = Run(runs["fix"])
    assert run.complete and run.ranks() == [0, 1]
    topo = run.topology()
    assert topo.groups["dp"] == [[0, 1]] and any(g["ranks"] == [0, 1] for g in topo.process_groups)
    assert read_json(run.path / "env.json")["backend"] == "gloo"
    assert [e["event"] for e in run.events().records][0] == "attached"
    mem = list(iter_jsonl(run.rank_path("memory", 0)))
    n_params = read_json(run.path / "manifest.lock.json")["manifest"]["model"]["parameters"]
    assert [m["step"] for m in mem] == [1, 2, 3] and mem[-1][
        "params"
    ] == 4 * n_params  # float32 weights
    m = run.manifest_doc
    assert (
        m["config"]["lr"] == 1e-2
        and m["parallelism"]["engine"] == "DDP"
        and m["experiment"]["seed"] == 0
    )
    assert m["optimizer"]["type"].endswith("AdamW") and m["model"]["tensors"]["head.weight"][
        "shape"
    ] == [32, 16]
    assert any("allreduce" in (x.op or "") for x in run.collectives(1))


def test_check_with_nothing_to_check_exits_2(tmp_path):
    """One process: no copy of anything on another rank, so no replica rule applies (never a vacuous pass)."""
    code = (
        "import torch, disttrace.api as d\n"
        "m = torch.nn.Linear(4, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        f"r = d.attach(m, o, out={str(tmp_path)!r})\n"
        "for _ in range(2):\n"
        "    o.zero_grad(); r.loss(m(torch.ones(3, 4)).sum()).backward(); o.step()\n"
        "r.close(); print(r.run_dir)\n"
    )
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr
    run_dir = proc.stdout.strip().splitlines()[-1]
    res = cli("check", run_dir)
    assert res.returncode == 2 and "nothing to check" in res.stderr, res.stderr
