"""A plain torch DDP script that trains the harness's experiment and says so (config/harness.py), against the
harness's own DDP run of that lock: the two record the same tensors in the same places, so the numeric diff
pairs every record (the learning rate included, once a step, at `clip`) and finds them equal; rank 1's
optimizer at 1.001 x the lr (a bug neither the manifest nor the statement shows) is found where the learning
rate is recorded. The oracles: the harness's run (not the code under test) and the planted lr's coordinates.
"""

from __future__ import annotations

import orjson
import pytest
from conftest import ROOT, cli, last_line
from launchers import launch, torchrun_cmd

from disttrace.analysis.diff import diff_runs
from disttrace.store.rundir import Run

SCRIPT = str(ROOT / "tests" / "scripts" / "ddp_harness_train.py")
SETS = ["training.steps=3", "checkpoint.interval=0", "training.max_grad_norm=1.0"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("claim")
    lock = tmp / "lock.json"
    cli("freeze", *[x for s in SETS for x in ("--set", s)], "-o", lock, check=0)
    harness = last_line(cli("run", lock, "--out", tmp / "runs", "--quiet", timeout=600, check=0))
    return tmp, lock, harness, launch(torchrun_cmd(SCRIPT), tmp / "runs", "--lock", lock)


def _by_phase(run, step: int = 1, rank: int = 0) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in Run(run).records(rank):
        if r["step"] == step:
            out.setdefault(r["phase"], set()).add(r["tensor"])
    return out


@pytest.mark.slow
def test_an_attached_ddp_run_of_the_harness_experiment_pairs_every_record_with_the_harness(pair):
    _, _, harness, attached = pair
    assert Run(attached).manifest_doc["parallelism"]["engine"] == "DDP"
    h, a = _by_phase(harness), _by_phase(attached)
    # the learning rate once, where the harness records it
    assert "lr" in h["clip"] and "lr" in a["clip"]
    assert not any(t.startswith("param_groups.") for t in h["optimizer"] | a["optimizer"]), (h, a)
    for phase in ("reduce", "clip", "optimizer"):
        assert h[phase] == a[phase], (phase, h[phase] ^ a[phase])
    proc = cli("diff", harness, attached, "--mode", "numeric", "--json")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 0 and doc["equal"], (doc.get("first_divergence"), doc["warnings"])
    assert doc["compared_steps"]["count"] == 3 and doc["warnings"] == [], doc["warnings"]


@pytest.mark.slow
def test_rank_1_at_another_lr_is_found_at_the_recorded_lr(pair):
    tmp, lock, harness, attached = pair
    skew = launch(torchrun_cmd(SCRIPT), tmp / "runs", "--lock", lock, "--skew-lr-rank1")
    for ref in (harness, attached):
        d = diff_runs(ref, skew, mode="numeric")
        f = d.first_divergence
        assert not d.equal and (f.step, f.phase, f.rank, f.tensor) == (1, "clip", 1, "lr"), f
