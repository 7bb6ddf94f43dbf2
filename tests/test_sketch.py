"""Issue 13, item 5: numeric comparison sees more than sum and norm. A permutation of a tensor's elements and
offsetting errors (+e here, -e there) keep both; the random-projection sketch catches them. The sketch is
additive over shards: a dp=2 ZeRO-3 run (FSDP2 shards) still compares equal with dp=1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import raw_records
from test_diff_synthetic import find, gen_records, manifest, write_run

from disttrace.analysis import tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.run.digest import axis_vectors, digest_tensor, sketch

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
    """Against an explicit vector: v_k[i, j] = a_k0[i] * a_k1[j], ||v_k||^2 = numel; and the shards' sketches
    at their offsets add up to the whole tensor's (row and column splits alike)."""
    x = np.random.default_rng(3).standard_normal((12, 10))
    v = np.einsum("ik,jk->ijk", axis_vectors(0, 12), axis_vectors(1, 10))
    assert np.allclose((v * v).sum(axis=(0, 1)), 120)
    assert np.allclose(sketch(x), np.einsum("ij,ijk->k", x, v))
    rows = np.add(sketch(x[:5], (0, 0), (12, 10)), sketch(x[5:], (5, 0), (12, 10)))
    cols = np.add(sketch(x[:, :4], (0, 0), (12, 10)), sketch(x[:, 4:], (0, 4), (12, 10)))
    assert np.allclose(rows, sketch(x)) and np.allclose(cols, sketch(x))


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
