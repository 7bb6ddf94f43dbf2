"""The sketch computed cheaply (float32 GEMVs per cache-sized block, one pass that also hashes and sums; see
run/record/digest.py) stays the sketch: against an independent float64 oracle of the same vectors it is within the
rounding that tolerance.sketch_rounding derives, shards still add up to the whole tensor within it, the
digest is still the one-shot xxh3 of the raw bytes, and diff does not call identical values divergent
on the sketch's rounding (it did at a tight tolerance before the rounding term)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from test_diff_synthetic import PARAMS, digest, find, gen_records, manifest, write_run

from disttrace.analysis import tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.run.record.digest import digest_tensor, sketch
from disttrace.run.record.sketchplan import SKETCH_K, axis_vectors

SHAPES = [
    (64,),
    (37,),
    (64, 64),
    (192, 64),
    (1536, 512),
    (2000, 3),
    (3, 5, 7),
    (4, 64, 96),
    (2, 140000),
    (700, 1),
]


def oracle(x: np.ndarray, offset=None, logical_shape=None) -> np.ndarray:
    """<x, v_k> in float64 with the vectors spelled out from their definition (run/record/digest.py, version 2):
    the leading axes' first factors (one for all K projections) multiplied in axis order and rounded to
    float32 once, times the last axis' K factors."""
    shape = x.shape
    lshape = logical_shape or shape
    off = offset or (0,) * len(shape)
    lead = np.ones(SKETCH_K)
    for d in range(len(shape) - 1):
        a = axis_vectors(d, lshape[d])[off[d] : off[d] + shape[d], :1].repeat(SKETCH_K, axis=1)
        lead = lead[..., None, :] * a.reshape((1,) * d + (shape[d], SKETCH_K))
    lead = lead.astype(np.float32).astype(np.float64)
    last = axis_vectors(len(shape) - 1, lshape[-1])[off[-1] : off[-1] + shape[-1]]
    v = lead[..., None, :] * last  # shape + (K,)
    return np.tensordot(x.astype(np.float64), v, axes=x.ndim)


def _scale(x: np.ndarray) -> float:
    a = x.astype(np.float64)
    return float(np.linalg.norm(a.ravel())) * math.sqrt(a.size)


def _data(shape, kind, seed=0):
    g = np.random.default_rng(seed)
    x = g.standard_normal(shape)
    if kind == "positive":  # like Adam's second moment: no cancellation in the data
        x = x * x
    elif kind == "wide-range":  # magnitudes over 8 decades
        x = x * 10.0 ** g.uniform(-4, 4, shape)
    return torch.from_numpy(x.astype(np.float32))


@pytest.mark.parametrize("kind", ["normal", "positive", "wide-range"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_float32_sketch_agrees_with_a_float64_oracle_within_the_derived_rounding(shape, kind):
    t = _data(shape, kind)
    d = digest_tensor(t)
    x = t.numpy()
    rho = tolerance.sketch_rounding(d["dtype"], d["shape"])
    assert (
        0 < rho < 2e-6
    )  # a bound that means something: below the derived per-step bound of a tiny run
    err = np.abs(np.array(d["sketch"]) - oracle(x)) / _scale(x)
    assert err.max() <= rho, (err, rho)
    # the digest is the one-shot xxh3 of the raw bytes; the sum and the norm, reduced in float32 runs, are
    # within their own derived rounding of the exactly rounded float64 ones (math.fsum)
    assert d["digest"] == xxhash.xxh3_128_hexdigest(x.tobytes())
    a = x.astype(np.float64).ravel()
    rho_s = tolerance.sum_rounding(d["dtype"], d["shape"])
    rho_n = tolerance.norm_rounding(d["dtype"], d["shape"])
    if (
        x.size > tolerance.FLOAT64_STATS
    ):  # float32 runs: below the derived per-step bound of a tiny run
        assert 0 < rho_s < 1e-6 and 0 < rho_n < 5e-7
    else:  # float64, as the small tensors digested together: to float64 rounding
        assert rho_s == rho_n == 0.0
        rho_s = rho_n = 1e-12
    assert abs(d["sum"] - math.fsum(a)) <= rho_s * _scale(x)
    exact_norm = math.sqrt(math.fsum(a * a))
    assert abs(d["norm"] - exact_norm) <= rho_n * exact_norm


def test_float32_is_really_used_and_float64_tensors_keep_float64():
    """The bound is not vacuous: a float32 tensor's sketch differs from the float64 oracle (it is float32
    arithmetic), a float64 tensor's agrees to float64 rounding."""
    x = _data((1536, 512), "normal")
    e32 = np.abs(np.array(digest_tensor(x)["sketch"]) - oracle(x.numpy())).max() / _scale(x.numpy())
    x64 = x.double()
    e64 = np.abs(np.array(digest_tensor(x64)["sketch"]) - oracle(x64.numpy())).max() / _scale(
        x64.numpy()
    )
    assert e32 > 1e-12 and e64 < tolerance.sketch_rounding("float64", [1536, 512]) < 1e-13


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64])
def test_narrow_and_integer_dtypes(dtype):
    t = (torch.randn(48, 40, generator=torch.Generator().manual_seed(7)) * 50).to(dtype)
    d = digest_tensor(t)
    x = t.to(torch.float64).numpy()
    assert d["digest"] == xxhash.xxh3_128_hexdigest(
        t.contiguous().view(torch.uint8).numpy().tobytes()
    )
    err = np.abs(np.array(d["sketch"]) - oracle(x)) / _scale(x)
    assert err.max() <= tolerance.sketch_rounding(d["dtype"], d["shape"])


SPLITS = {
    "rows": ((64, 48), [((0, 0), (20, 48)), ((20, 0), (44, 48))]),
    "columns": ((64, 48), [((0, 0), (64, 17)), ((0, 17), (64, 31))]),
    "tall rows (several blocks)": ((1500, 96), [((0, 0), (700, 96)), ((700, 0), (800, 96))]),
    "3-D middle axis": ((3, 10, 8), [((0, 0, 0), (3, 4, 8)), ((0, 4, 0), (3, 6, 8))]),
    "1-D": ((1000,), [((0,), (300,)), ((300,), (700,))]),
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_shards_add_up_to_the_whole_within_the_rounding(split):
    lshape, parts = SPLITS[split]
    t = _data(lshape, "normal", seed=5)
    whole = np.array(digest_tensor(t)["sketch"])
    total = np.zeros(SKETCH_K)
    for off, size in parts:
        piece = t[tuple(slice(o, o + n) for o, n in zip(off, size))]
        total += digest_tensor(piece, list(off), list(lshape))["sketch"]
        # each shard alone against the oracle of its place in the logical tensor
        assert np.abs(
            np.array(sketch(piece.numpy(), off, lshape)) - oracle(piece.numpy(), off, lshape)
        ).max() <= tolerance.sketch_rounding("float32", list(size)) * _scale(piece.numpy())
    scale = _scale(t.numpy())
    # whole and shards each carry at most sketch_rounding(logical shape) * scale (tolerance.sketch_rounding)
    assert (
        np.abs(total - whole).max()
        <= 2 * tolerance.sketch_rounding("float32", list(lshape)) * scale
    )
    first = digest_tensor(
        t[tuple(slice(o, o + n) for o, n in zip(*parts[0]))], list(parts[0][0]), list(lshape)
    )
    assert (
        np.abs(np.array(first["sketch"]) - whole).max() > 1e-3 * scale
    )  # placed by logical position


# ---------------------------------------------------------------- diff holds the sketch to the rounding


STEP, INDEX = 2, 1  # the optimizer record of PARAMS[1] (64 x 64)


def _runs(tmp_path, whole: torch.Tensor, halves: list[torch.Tensor]):
    """A: dp=2, the tensor as two row shards (rank r holds rows 32r..32r+31, as FSDP2 shards). B: dp=1, accumulation 2,
    the tensor whole. Every other record agrees (test_diff_synthetic's generator)."""
    ma, mb = manifest(), manifest(**{"parallelism.dp": 1, "training.grad_accum_steps": 2})
    ra, rb = gen_records(ma, range(1, 4)), gen_records(mb, range(1, 4))
    lshape = list(whole.shape)
    for rank, half in enumerate(halves):
        r = find(ra, STEP, 0, "optimizer", rank, INDEX)
        r.update(
            digest_tensor(half, [32 * rank, 0], lshape),
            shard={"offset": [32 * rank, 0], "logical_shape": lshape},
        )
        r["digest"] = digest(r)
    r = find(rb, STEP, 1, "optimizer", 0, INDEX)
    r.update(digest_tensor(whole))
    r["digest"] = digest(r)
    return write_run(tmp_path / "a", ma, ra), write_run(tmp_path / "b", mb, rb)


def test_identical_values_sharded_differently_do_not_diverge_on_sketch_rounding(tmp_path):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 64, generator=g) * torch.rand(64, 64, generator=g) * 10
    halves = [x[:32].contiguous(), x[32:].contiguous()]
    a, b = _runs(tmp_path / "same", x, halves)
    shards = [digest_tensor(h, [32 * i, 0], [64, 64]) for i, h in enumerate(halves)]
    gap = np.abs(np.sum([s["sketch"] for s in shards], axis=0) - digest_tensor(x)["sketch"]).max()
    scale = float(x.double().norm()) * 64
    rtol = 1e-13  # far tighter than any derived bound: only the sketch's own rounding is left
    # the float32 sketches of the two layouts do differ (float32 sums over 64 rows against two of 32): the
    # rounding term matters
    assert gap / scale > rtol
    assert gap / scale <= 2 * tolerance.sketch_rounding("float32", [64, 64])
    d = diff_runs(a, b, mode="numeric", rtol=rtol, atol=0.0)
    assert d.equal, d.first_divergence
    assert diff_runs(a, b, mode="numeric").equal
    # and a permutation inside one shard still diverges at that step and tensor (the sketch still sees it)
    perm = halves[1].reshape(-1)[torch.randperm(halves[1].numel(), generator=g)].reshape(32, 64)
    a2, b2 = _runs(tmp_path / "permuted", x, [halves[0], perm])
    f = diff_runs(a2, b2, mode="numeric").first_divergence
    assert (f.step, f.phase, f.tensor) == (STEP, "optimizer", PARAMS[INDEX]), f


@pytest.mark.parametrize(
    "scale", [1e25, 1e-22, 0.0], ids=["squares overflow float32", "subnormal", "zeros"]
)
def test_sum_and_norm_outside_float32_range_are_taken_in_float64(scale):
    """Squares beyond float32's range (a flipped exponent bit makes 1e33) or in its subnormal range would
    make a float32 norm infinite or inexact beyond norm_rounding: those tensors' statistics are taken again
    in float64, so the record holds the norm an exact computation rounds to, not None or 0."""
    x = (_data((1536, 512), "normal", seed=3).double() * scale).float()
    d = digest_tensor(x)
    a = x.numpy().astype(np.float64).ravel()
    exact = math.sqrt(math.fsum(a * a))
    assert d["nonfinite"] == 0 and d["norm"] is not None
    assert abs(d["norm"] - exact) <= tolerance.norm_rounding("float32", [1536, 512]) * exact
    assert abs(d["sum"] - math.fsum(a)) <= tolerance.sum_rounding("float32", [1536, 512]) * _scale(
        x.numpy()
    )
    if scale:
        assert d["norm"] > 0
