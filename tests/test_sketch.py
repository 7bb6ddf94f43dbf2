"""Issue 13, item 5: numeric comparison sees more than sum and norm. A permutation of a tensor's elements and
offsetting errors (+e here, -e there) keep both; the random-projection sketch catches them. The sketch is
additive over shards: a dp=2 ZeRO-3 run (FSDP2 shards) still compares equal with dp=1."""

from __future__ import annotations

import math

import numpy as np
import orjson
import pytest
import torch
from conftest import raw_records
from test_diff_synthetic import find, gen_records, manifest, write_run

from disttrace.analysis import calibration, tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.run.record.digest import digest_tensor, sketch
from disttrace.run.record.sketchplan import axis_vectors

STEP, RANK, INDEX = 2, 0, 1  # the optimizer record of layers.0.attention.wq.weight (64 x 64)


def _with(records, step, rank, index, t: torch.Tensor) -> None:
    r = find(records, step, 0, "optimizer", rank, index)
    r.update(digest_tensor(t))


def _pair(tmp_path, x: torch.Tensor, y: torch.Tensor, keep_sketch=True):
    m = manifest(**{"parallelism.dp": 1, "training.steps": 3})
    a, b = gen_records(m, range(1, 4)), gen_records(m, range(1, 4))
    _with(a, STEP, RANK, INDEX, x)
    _with(b, STEP, RANK, INDEX, y)
    if not keep_sketch:
        for recs in (a, b):
            for r in recs[RANK]:
                r.pop("sketch", None)
    return write_run(tmp_path / "a", m, a), write_run(tmp_path / "b", m, b), m


def _blind_to_sum_and_norm(x, y, m) -> None:
    """The oracle that sum and norm alone cannot see the change: both within the derived bound."""
    dx, dy = x.double(), y.double()
    bound = tolerance.bound(m, m, STEP, "optimizer")
    norm = float(dx.norm())
    assert abs(float(dx.norm()) - float(dy.norm())) / norm < bound / 10
    assert abs(float(dx.sum()) - float(dy.sum())) / (norm * math.sqrt(x.numel())) < bound / 10


def _changes(seed=0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 64, generator=g)
    perm = x.reshape(-1)[torch.randperm(x.numel(), generator=g)].reshape(64, 64)
    # offsetting errors: +e at one element, -e at another; with x_j = x_i + e the norm is unchanged too
    off, e = x.clone(), 1.0
    off[3, 5] = 0.25
    off[40, 17] = 0.25 + e
    moved = off.clone()
    moved[3, 5] += e
    moved[40, 17] -= e
    return {"permutation": (x, perm), "offsetting": (off, moved)}


@pytest.mark.parametrize("kind", ["permutation", "offsetting"])
def test_numeric_diff_catches_what_sum_and_norm_cannot(tmp_path, kind):
    x, y = _changes()[kind]
    assert not torch.equal(x, y)
    a, b, m = _pair(tmp_path / "with", x, y)
    _blind_to_sum_and_norm(x, y, m)
    d = diff_runs(a, b, mode="numeric")
    f = d.first_divergence
    assert not d.equal and (f.step, f.phase, f.index) == (STEP, "optimizer", INDEX), f
    # the same records without their sketch: sum and norm alone call the runs equal (the blind spot)
    a0, b0, _ = _pair(tmp_path / "without", x, y, keep_sketch=False)
    assert diff_runs(a0, b0, mode="numeric").equal


def test_sketch_is_the_projection_it_claims_and_adds_over_shards():
    """Against an explicit vector: v_k[i, j] = a_00[i] * a_k1[j] (the leading factor shared by the K
    projections: version 2), ||v_k||^2 = numel; and the shards' sketches at their offsets add up to the
    whole tensor's (row and column splits alike)."""
    x = np.random.default_rng(3).standard_normal((12, 10))
    v = np.einsum("i,jk->ijk", axis_vectors(0, 12)[:, 0], axis_vectors(1, 10))
    assert np.allclose((v * v).sum(axis=(0, 1)), 120)
    assert np.allclose(sketch(x), np.einsum("ij,ijk->k", x, v))
    rows = np.add(sketch(x[:5], (0, 0), (12, 10)), sketch(x[5:], (5, 0), (12, 10)))
    cols = np.add(sketch(x[:, :4], (0, 0), (12, 10)), sketch(x[:, 4:], (0, 4), (12, 10)))
    assert np.allclose(rows, sketch(x)) and np.allclose(cols, sketch(x))


# ---------------------------------------------------------------- stores of two sketch versions


def _v1_sketch(x: torch.Tensor) -> list[float]:
    """Version 1's projections (a leading factor per projection), from that definition: what a store
    written before version 2 holds for a 2-D tensor (float64 here: within float32 rounding of the GEMM)."""
    v = np.einsum("ik,jk->ijk", axis_vectors(0, x.shape[0]), axis_vectors(1, x.shape[1]))
    return np.einsum("ij,ijk->k", x.double().numpy(), v).tolist()


def _versioned(tmp_path, name, t: torch.Tensor, version: int):
    """A run whose (STEP, optimizer, INDEX) record is t's, its sketch of `version`: 1 as a store before
    the version was written (index lines without it), 2 as the recorder writes now."""
    m = manifest(**{"parallelism.dp": 1, "training.steps": 3})
    recs = gen_records(m, range(1, 4))
    _with(recs, STEP, RANK, INDEX, t)
    if version == 1:
        find(recs, STEP, 0, "optimizer", RANK, INDEX)["sketch"] = _v1_sketch(t)
    run = write_run(tmp_path / name, m, recs)
    if version != 1:
        for f in (run / "trajectory").glob("*.steps.jsonl"):
            lines = [orjson.loads(x) for x in f.read_bytes().splitlines()]
            f.write_bytes(b"".join(orjson.dumps({**x, "sketch": version}) + b"\n" for x in lines))
    return run, m


def _noisy(x: torch.Tensor) -> torch.Tensor:
    """x with each element moved by a relative 1e-7: what another summation order makes of it."""
    g = torch.Generator().manual_seed(5)
    return (
        x.double() * (1 + 1e-7 * torch.randn(x.shape, generator=g, dtype=torch.float64))
    ).float()


@pytest.mark.parametrize("versions", [(1, 2), (2, 1)], ids=["old-new", "new-old"])
def test_sketches_of_two_versions_are_not_compared_and_raise_no_false_alarm(tmp_path, versions):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    y = _noisy(x)
    va, vb = versions
    a, m = _versioned(tmp_path, "a", x, va)
    b, _ = _versioned(tmp_path, "b", y, vb)
    _blind_to_sum_and_norm(x, y, m)
    # the oracle: the two versions' projections of the same tensor are far apart (other vectors) but the
    # first, whose vectors both versions share
    k1, k2 = np.array(_v1_sketch(x)), np.array(sketch(x.numpy()))
    scale = float(x.norm()) * 64
    assert np.abs(k1 - k2)[1:].min() / scale > 1e-3 and abs(k1[0] - k2[0]) / scale < 1e-6
    d = diff_runs(a, b, mode="numeric")
    assert d.equal, d.first_divergence
    assert any("its first projection is compared" in w for w in d.warnings), d.warnings
    # control: the same pair read as one version compares the sketches, and diverges on them
    a1, _ = _versioned(tmp_path, "a1", x, vb)
    one = diff_runs(a1, b, mode="numeric")
    assert one.equal and not any("sketches" in w for w in one.warnings)
    if vb == 2:  # B's v2 sketch against A's v1 one, both claiming version 2: a false divergence
        a_v1_as_v2, _ = _versioned(tmp_path, "a2", x, 1)
        for f in (a_v1_as_v2 / "trajectory").glob("*.steps.jsonl"):
            lines = [orjson.loads(z) for z in f.read_bytes().splitlines()]
            f.write_bytes(b"".join(orjson.dumps({**z, "sketch": 2}) + b"\n" for z in lines))
        wrong = diff_runs(a_v1_as_v2, b, mode="numeric")
        f = wrong.first_divergence
        assert not wrong.equal and (f.step, f.phase, f.index) == (STEP, "optimizer", INDEX)
    # calibration's noise between them is the rounding's, not the other vectors'
    noise = calibration.noise(a, b, magnitudes=False)[0]
    assert noise[STEP]["optimizer"] < 1e-6, noise


@pytest.mark.parametrize("versions", [(1, 2), (2, 1)], ids=["old-new", "new-old"])
def test_a_real_change_is_found_across_sketch_versions_at_its_coordinates(tmp_path, versions):
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    a, _ = _versioned(tmp_path, "a", x, versions[0])
    b, _ = _versioned(tmp_path, "b", x * 1.001, versions[1])
    for mode in ("numeric", "bitwise"):
        d = diff_runs(a, b, mode=mode)
        f = d.first_divergence
        assert not d.equal and (f.step, f.phase, f.index) == (STEP, "optimizer", INDEX), (mode, f)


@pytest.mark.parametrize("kind", ["permutation", "offsetting"])
def test_across_versions_the_shared_projection_still_sees_what_sum_and_norm_cannot(tmp_path, kind):
    """Between an old store and a new one only the first projection compares (the others are other
    vectors): a change sum and norm cannot see is still caught, at its coordinates."""
    x, y = _changes()[kind]
    a, m = _versioned(tmp_path, "a", x, 1)
    b, _ = _versioned(tmp_path, "b", y, 2)
    _blind_to_sum_and_norm(x, y, m)
    d = diff_runs(a, b, mode="numeric")
    f = d.first_divergence
    assert not d.equal and (f.step, f.phase, f.index) == (STEP, "optimizer", INDEX), f


# ---------------------------------------------------------------- real runs: shards against whole tensors


@pytest.fixture(scope="module")
def topologies(runs):
    """dp=1 (the run test_foundation.py compares with dp=2) and ZeRO-3 (test_strategies.py's): the session's."""
    one = runs.reference("--set", "parallelism.dp=1", "--set", "training.grad_accum_steps=4")
    zero3 = runs.reference("--set", "parallelism.zero_stage=3")
    return one, zero3


def _optimizer_records(run, rank, step):
    for r in raw_records(run, rank):
        if r["step"] == step and r["phase"] == "optimizer":
            yield r


def test_zero3_shards_compare_with_dp1_through_their_sketches(topologies):
    one, zero3 = topologies
    d = diff_runs(one, zero3, mode="numeric")
    assert d.equal, d.first_divergence
    # independently of diff: each sharded parameter's shard sketches, summed, give dp=1's sketch (to float32
    # rounding of a different summation order: far below 1e-4 of norm * sqrt(numel))
    whole = {r["tensor"]: r for r in _optimizer_records(one, 0, 4)}
    shards: dict[str, list] = {}
    for rank in (0, 1):
        for r in _optimizer_records(zero3, rank, 4):
            if "shard" in r and ":" not in r["tensor"]:
                shards.setdefault(r["tensor"], []).append(r)
    assert len(shards) >= 10
    for name, parts in shards.items():
        assert len(parts) == 2 and all(p["sketch"] for p in parts)
        w = whole[name]
        scale = w["norm"] * math.sqrt(w["numel"])
        combined = np.sum([p["sketch"] for p in parts], axis=0)
        assert np.max(np.abs(combined - np.array(w["sketch"]))) / scale < 1e-4, name
        # and a shard alone is far from it: the vectors really are placed by logical position
        assert (
            np.max(np.abs(np.array(parts[0]["sketch"]) - np.array(w["sketch"]))) / scale > 1e-3
        ), name
