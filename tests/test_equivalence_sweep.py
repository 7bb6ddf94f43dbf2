"""bench/equivalence_sweep.py's CI sample, both directions on real multi-process runs: two layouts of the same
training compare equal against dp=1 x accumulation 4, and planted controls diverge where they were planted
(the oracle is the fault's own coordinates, not the bound), under the derived bound and under the reference's
calibration (`run --calibrate`, per step, phase and tensor class). The fast known-answer cases are in
tests/test_magnitudes.py; the sweep's full matrix is `python bench/equivalence_sweep.py --full`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.slow  # eight short jobs: `make test-all`


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("sweep")
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/equivalence_sweep.py",
            "--models",
            "default",
            "--steps",
            "3",
            "--pairs",
            "dp=2 x accum 2;micro-batch 8, no accum;ZeRO-1;ZeRO-2",
            "--controls",
            "bf16 all-reduce;loss x (1 + 1e-4), one micro-batch;lr x (1 + 1e-3), one rank",
            "--out",
            str(tmp_path / "runs"),
            "--json",
            str(out),
            "--calibrate",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=1500,
    )
    # exit 1: a row the sweep calls WRONG (the derived bound's bf16 all-reduce, below); anything else is a crash
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    return proc, {r["case"]: r for r in json.loads(out.read_text())}


def test_sweep_sample_both_directions(sweep):
    proc, rows = sweep
    # both directions under both bounds: the derived one, and the reference's calibration (run --calibrate)
    for calibrated, verdict in ((False, lambda r: r), (True, lambda r: r["calibrated"])):
        for case in ("dp=2 x accum 2", "micro-batch 8, no accum", "ZeRO-1", "ZeRO-2"):
            assert verdict(rows[case])["equal"] and verdict(rows[case])["worst_ratio"] < 1, rows[
                case
            ]
        # the faults fire at step 2 on rank 1; nothing before it may differ
        loss = verdict(rows["loss x (1 + 1e-4), one micro-batch"])["first_divergence"]
        assert (loss["step"], loss["phase"], loss["rank"]) == (2, "loss", 1)
        if calibrated:  # the derived bound's miss: the test below
            bf16 = verdict(rows["bf16 all-reduce"])["first_divergence"]
            assert bf16["step"] == 2 and bf16["phase"] in ("reduce", "clip", "optimizer")
        lr = verdict(rows["lr x (1 + 1e-3), one rank"])["first_divergence"]
        assert lr["step"] in (
            2,
            3,
        )  # the update at step 2 (unbounded under Adam) shows in step 3's gradients
    assert rows["ZeRO-2"]["calibrated"]["first_divergence"] is None
    assert "equivalent pairs" in proc.stdout and "calibrated bound" in proc.stdout


@pytest.mark.xfail(
    strict=True,
    reason="a known miss (docs/limits.md): three steps of the default model's gradients reduced in bfloat16 "
    "stay inside the derived bound (err/bound 0.27 at step 2 reduce); the calibrated bound finds them",
)
def test_the_derived_bound_finds_a_bf16_all_reduce(sweep):
    _, rows = sweep
    bf16 = rows["bf16 all-reduce"]["first_divergence"]
    assert (
        bf16 is not None and bf16["step"] == 2 and bf16["phase"] in ("reduce", "clip", "optimizer")
    )
