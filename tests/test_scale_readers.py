"""What the readers do per rank and step stays linear at scale (bench/scale.py measures the curves): each
rewrite here is held against the quadratic formulation it replaced, kept in the test as the oracle."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest
import test_diff_synthetic as syn

from disttrace.analysis import consistency
from disttrace.analysis.consistency import check_run
from disttrace.analysis.sync import Straggler, stragglers
from disttrace.store.rundir import Run


def _stragglers_by_sorting_the_others(per_step, min_seconds=0.1, factor=2.0) -> list[dict]:
    out = []
    for step, times in sorted(per_step.items()):
        if len(times) < 2:
            continue
        for rank, t in times.items():
            others = sorted(v for r, v in times.items() if r != rank)
            median = others[len(others) // 2]
            if t - median > min_seconds and t > factor * median:
                out.append(Straggler(step, rank, round(t, 4), round(median, 4)))
    return out


def test_stragglers_are_the_ones_sorting_the_others_finds():
    rng = random.Random(11)
    found = 0
    for trial in range(300):
        ranks = rng.choice([2, 3, 4, 5, 8, 17, 64])
        per_step = {}
        for step in range(1, 4):
            base = rng.choice([0.05, 0.2, 1.0])
            times = {r: round(base * rng.uniform(0.5, 1.5), 2) for r in range(ranks)}
            for r in rng.sample(range(ranks), rng.randint(0, ranks)):  # stragglers, ties
                times[r] = rng.choice([times[r], base * 3, base * 5, times[0]])
            per_step[step] = times
        want = _stragglers_by_sorting_the_others(per_step)
        assert stragglers(per_step) == want, (trial, per_step)
        found += len(want)
    assert found > 100  # the cases do find stragglers, not only none


# ---------------------------------------------------------------- check on columns against check on records


def _check_store(root: Path, seed: int) -> Path:
    """A run store whose replica rules break here and there: copies that must agree differ on one rank or on
    half of them (a tie), data shards that must differ shared by two ranks, device digests beside xxh3
    ones, tensors the rules' patterns take and leave, steps some ranks lack, a rank in no group."""
    rng = random.Random(seed)
    faulty = 0.0 if seed % 3 == 0 else 1.0  # every third store consistent
    ranks = rng.choice([2, 3, 4, 6, 8])
    steps = rng.randint(1, 5)
    pool = [f"{i:032x}" for i in range(1, 4)]
    m = syn.manifest(**{"parallelism.dp": ranks, "training.steps": steps})
    recs: dict[int, list[dict]] = {r: [] for r in range(ranks)}
    names = ["w.weight", "w.bias", "norm.weight", "param_groups.0.lr", "lr"]
    for step in range(1, steps + 1):
        for r in range(ranks):
            if step > 1 and rng.random() < 0.1:
                continue  # this rank lacks the step
            out = recs[r]
            for mb in range(rng.choice([1, 2])):
                d = (
                    rng.choice(pool)
                    if rng.random() < 0.3 * faulty
                    else f"{rng.getrandbits(128):032x}"
                )
                out.append(syn.rec(step, mb, "data", r, 0, "inputs", [4], ("d", step, mb, r)))
                out[-1]["digest"] = d
            for phase in ("reduce", "optimizer"):
                for i, name in enumerate(names):
                    x = syn.rec(step, 0, phase, r, i, name, [8], ("x", step, phase, i))
                    if rng.random() < 0.08 * faulty:
                        x["digest"] = rng.choice(pool)
                    if rng.random() < 0.05 * faulty:
                        x["digest"] = "dev:" + x["digest"]
                    out.append(x)
    run = syn.write_run(root / f"run{seed}", m, recs)
    everyone = list(range(ranks))
    halves = [everyone[: ranks // 2], everyone[ranks // 2 :]]
    groups = {"dp": [rng.sample(everyone, ranks)], "half": halves, "few": [everyone[:-1]]}
    rules = [
        {"phase": "data", "dim": "dp", "relation": "differ"},
        {"phase": "reduce", "dim": "half", "relation": "agree", "tensors": ["w.*", "lr"]},
        {"phase": "optimizer", "dim": "dp", "relation": "agree", "exclude": "*.bias"},
        {"phase": "optimizer", "dim": "few", "relation": "agree", "tensors": "param_groups.*"},
        {"phase": "data", "dim": "half", "relation": "differ", "tensors": "inp*"},
    ]
    (run / "replicas.json").write_bytes(orjson.dumps({"groups": groups, "rules": rules}))
    return run


@pytest.mark.parametrize("seed", range(40))
def test_check_on_columns_finds_what_check_on_records_does(tmp_path, seed, monkeypatch):
    run = _check_store(tmp_path, seed)
    on_columns = check_run(Run(run)).to_json()
    with (
        monkeypatch.context() as mp
    ):  # the record path: every step as dicts (the code before the columns)
        mp.setattr(consistency, "Columns", None)
        mp.setattr(consistency, "_arrow", lambda run, rank: False)
        on_records = check_run(Run(run)).to_json()
    assert on_columns == on_records


def test_check_on_columns_holds_bad_and_good_runs_apart(tmp_path):
    """Both directions over the seeds: some runs consistent, some not, so the comparison above is not
    between two empty results."""
    verdicts = {check_run(Run(_check_store(tmp_path, s))).consistent for s in range(40)}
    assert verdicts == {True, False}
