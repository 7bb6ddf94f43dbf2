"""Attached runs record the magnitudes the numeric bound scales each gradient by (run/record/scales.py, through the
attach API's module hooks), so a pair of user scripts whose weight gradient cancels gets the sound bound
instead of a false divergence. tests/scripts/cancel_train.py: a projection of inputs that are nearly one
vector, whose output gradient sums to zero over the tokens (dW cancels to ~1e-3 of its terms), the same 16
samples a step in every layout. Oracles: Cauchy-Schwarz (every recorded gradient's norm is at most its
magnitude), the same mathematics in another summation order (equal), the norm-relative bound's known false
alarm on the same stores (divergent once the magnitudes are hidden), and a planted learning-rate skew on one
rank (divergent where the skewed update first shows)."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.magnitudes import Magnitudes
from disttrace.store import scales
from disttrace.store.rundir import Run

SCRIPT = ROOT / "tests" / "scripts" / "cancel_train.py"
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"


def train(out: Path, *args, ranks: int = 1, launcher: bool = False) -> Path:
    cmd = [sys.executable, str(SCRIPT)]
    if ranks > 1 or launcher:
        cmd = [TORCHRUN, "--nproc-per-node", str(ranks), str(SCRIPT)]
    proc = subprocess.run(
        [*cmd, str(out), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])


def _magnitudes_bound_the_gradients(run: Path) -> None:
    """||g|| <= sum over ranks of each rank's ||X|| ||dY|| / dp for every reduced gradient recorded."""
    r = Run(run)
    dp = r.manifest.parallelism.dp
    mags: dict = {}
    for rank in r.ranks():
        got = scales.read(run / f"trajectory/rank-{rank:05d}{scales.SUFFIX}")
        rows = zip(got.step.tolist(), got.phase.tolist(), got.index.tolist(), got.m.tolist())
        for step, phase, i, v in rows:
            if scales.PHASES[phase] == "reduce":
                mags[(step, i)] = mags.get((step, i), 0.0) + v / dp
    seen = 0
    for rank in r.ranks():
        for rec in r.records(rank):
            if rec["phase"] == "reduce":
                assert rec["norm"] <= mags[(rec["step"], rec["index"])] * (1 + 1e-5), rec["tensor"]
                seen += 1
    assert seen


def _hide_magnitudes(run: Path, into: Path) -> Path:
    copy = into / run.name
    shutil.copytree(run, copy)
    for p in copy.glob("trajectory/*.scales.*"):
        p.unlink()
    return copy


def test_a_cancelling_attached_pair_gets_the_sound_bound(tmp_path):
    """One process each: micro-batch 8 x accumulation 2 against 4 x 4 (another GEMM shape of the same
    sums). Equal on the magnitudes' scale; on the norm's the cancelling projection is a false divergence."""
    a = train(tmp_path / "runs", "--mb", "8", "--accum", "2")
    b = train(tmp_path / "runs", "--mb", "4", "--accum", "4")
    for run in (a, b):
        assert (run / f"trajectory/rank-00000{scales.SUFFIX}").is_file()
        _magnitudes_bound_the_gradients(run)
    observed = orjson.loads((a / "manifest.lock.json").read_bytes())["observed"]
    assert (
        observed["global_batch"] == 16 and observed["tokens"] == 16 * 64
    )  # float inputs: the vectors
    d = diff_runs(a, b, mode="numeric")
    assert d.tolerance.scale == "magnitudes" and d.equal, d.first_divergence
    assert d.tolerance.derivation["T"] == 16 * 64  # the counted tokens, not a factor of 1
    assert d.stats.tensors_compared > d.stats.bit_equal  # they did round differently
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    n = diff_runs(_hide_magnitudes(a, hidden), b, mode="numeric")
    assert n.tolerance.scale == "norm" and not n.equal
    assert n.first_divergence.tensor == "proj.weight"  # the cancelling one


@pytest.mark.slow  # four 2-rank jobs under torchrun
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "manual"])
def test_ddp_fsdp2_and_plain_scripts_record_them(tmp_path, engine):
    """2 ranks x micro-batch 4 x accumulation 2 under DDP, FSDP2 or a hand-written all-reduce, against one
    rank of 4 x 4: every rank's magnitudes are written and sealed, bound the reduced gradients, and the
    pair compares equal on their scale; rank 1's learning rate x (1 + 1e-3) is found where it was planted
    (rank 1's learning rate, recorded at step 1's optimizer step)."""
    # FSDP2 renames the model's class (FSDPCentred), which is the experiment's: its reference is FSDP2 too
    ref = ["--engine", "fsdp2"] if engine == "fsdp2" else []
    one = train(tmp_path / "runs", "--mb", "4", "--accum", "4", *ref, launcher=bool(ref))
    two = train(tmp_path / "runs", "--mb", "4", "--accum", "2", "--engine", engine, ranks=2)
    seal = orjson.loads((two / "COMPLETE").read_bytes())["seal"]["files"]
    for rank in (0, 1):
        assert f"trajectory/rank-{rank:05d}{scales.SUFFIX}" in seal
    _magnitudes_bound_the_gradients(two)
    d = diff_runs(one, two, mode="numeric")
    assert d.tolerance.scale == "magnitudes" and d.equal, d.first_divergence
    skew = train(
        tmp_path / "runs", "--mb", "4", "--accum", "2", "--engine", engine, "--skew-lr", ranks=2
    )
    f = diff_runs(two, skew, mode="numeric").first_divergence
    assert (
        f is not None and (f.step, f.phase, f.rank) == (1, "optimizer", 1) and "lr" in f.tensor
    ), f


def test_a_clipped_pair_carries_the_clip_coefficients_difference(tmp_path):
    """Clipping engaged on a global norm that cancels (the head has no bias, so the cancelling projection
    carries the norm; a small third layer whose gradient does not cancel): micro-batch 8 x 2 against 4 x 4.
    The clip coefficient is max_norm / ||G||, whose relative difference is the norm's (bounded only on the
    scale of its parts, ~1e5 times the norm here): without carrying it into what the coefficient scales,
    `shift.weight`'s clipped gradient was a false divergence at step 2 (err/bound 10.5). Control: the same
    pair clipped at another max_norm (2e-5) is divergent."""
    args = ("--no-bias", "--spread", "1e-4", "--shift", "5e-7", "--steps", "2")
    a = train(tmp_path / "runs", "--mb", "8", "--accum", "2", *args, "--clip", "2.5e-5")
    b = train(tmp_path / "runs", "--mb", "4", "--accum", "4", *args, "--clip", "2.5e-5")
    mag = Magnitudes(Run(a))
    for step in (1, 2):
        norm, coef = mag._clip_scalars(step)
        assert coef < 1 and norm > 0  # clipping engaged
        keys, red = mag.reduced(step)
        spread = math.sqrt(sum(v * v for v in red.tolist())) / norm
        assert spread > 1e4  # the norm cancels
        got = mag.clipped(step)
        assert got[0].tolist() == keys.tolist()
        assert got[1].tolist() == [v * (1 + spread) for v in red.tolist()]
    # each moment is held to its own parameter's magnitude (the recorder numbers state after the parameters)
    states = {r["tensor"]: r["index"] for r in Run(a).records(0) if r["phase"] == "optimizer"}
    table = dict(zip(*(a.tolist() for a in mag.state_params(0))))
    for name in ("proj.weight", "head.weight", "shift.weight"):
        for key in ("exp_avg", "exp_avg_sq"):
            assert table[states[f"{name}:{key}"]] == states[name]
    d = diff_runs(a, b, mode="numeric")
    assert d.tolerance.scale == "magnitudes" and d.equal, d.first_divergence
    assert d.stats.tensors_compared > d.stats.bit_equal  # they did round differently
    c = train(tmp_path / "runs", "--mb", "4", "--accum", "4", *args, "--clip", "2e-5")
    assert not diff_runs(a, c, mode="numeric").equal
