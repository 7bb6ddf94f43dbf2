"""The compiled pass over a float32 tensor's blocks (run/record/fused.py, the optional numba extra) records what
the numpy path records: the same digest (the one-shot xxh3 of the raw bytes), and a sum, norm and sketch
within the rounding tolerance.py derives of an independent float64 oracle, for every block layout a
model's tensors take (rows a multiple of the block or not, rows shorter or longer than a run, more than
SKETCH_ROWS rows a block); planted non-finite values are counted as before, a float32 overflow still
falls back to float64, one flipped bit still changes the digest, and two digests of one tensor are
identical (the determinism the reference runs rely on)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import xxhash
from test_sketch_cost import _data, _scale, oracle

from disttrace.analysis import tolerance
from disttrace.run.record import digest as D
from disttrace.run.record.digestmany import digest_many
from disttrace.run.record.sketchplan import plan_for

pytest.importorskip("numba")

# (rows, cols): cols a multiple of the run (512) or not (1376: runs of 128 and a last of 96 a row, 95 rows
# a block), SKETCH_ROWS-row blocks (200 columns), a 3-D activation, a last block shorter than the others,
# one block
SHAPES = [(1536, 512), (1376, 512), (300, 1376), (1000, 200), (4, 256, 512), (700, 190), (256, 512)]


@pytest.fixture(params=["numpy", "fused"])
def path(request, monkeypatch):
    monkeypatch.setattr(D, "_kernel", False if request.param == "numpy" else None)
    if request.param == "fused":
        assert D._fused() is not None
    return request.param


def _uses_kernel(shape) -> bool:
    plan = plan_for(tuple(shape), (0,) * len(shape), tuple(shape))
    return plan.block_rows > 1 and math.prod(shape) > D.FUSED_MIN


def test_a_small_model_never_takes_the_kernel():
    """The default manifest's largest tensors (the 512 x 64 embedding and output) stay with numpy, so its
    runs never import numba."""
    assert not _uses_kernel((512, 64)) and not _uses_kernel((192, 64))


@pytest.mark.parametrize("kind", ["normal", "positive", "wide-range"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_both_paths_agree_with_a_float64_oracle_within_the_derived_rounding(shape, kind, path):
    assert _uses_kernel(shape)
    t = _data(shape, kind, seed=11)
    x = t.numpy()
    d = D.digest_tensor(t)
    assert d["digest"] == xxhash.xxh3_128_hexdigest(x.tobytes())
    scale = _scale(x)
    err = np.abs(np.array(d["sketch"]) - oracle(x)) / scale
    assert err.max() <= tolerance.sketch_rounding(d["dtype"], d["shape"]), err
    a = x.astype(np.float64).ravel()
    assert abs(d["sum"] - math.fsum(a)) <= tolerance.sum_rounding(d["dtype"], d["shape"]) * scale
    exact = math.sqrt(math.fsum(a * a))
    assert abs(d["norm"] - exact) <= tolerance.norm_rounding(d["dtype"], d["shape"]) * exact


def test_the_kernel_really_runs_and_is_float32_arithmetic(monkeypatch):
    """Not the numpy path under another name: the two round differently (both within the bound above)."""
    t = _data((1536, 512), "normal", seed=2)
    monkeypatch.setattr(D, "_kernel", False)
    ref = D.digest_tensor(t)
    monkeypatch.setattr(D, "_kernel", None)
    got = D.digest_tensor(t)
    assert got["digest"] == ref["digest"]
    assert got["sketch"] != ref["sketch"] and got["norm"] != ref["norm"]
    assert D.digest_tensor(t) == got  # run to run: bit for bit


def test_non_finite_values_overflow_and_a_flipped_bit(path):
    t = _data((1376, 512), "normal", seed=4)
    bad = t.clone()
    bad[700, 3], bad[1375, 511] = float("nan"), float("inf")
    d = D.digest_tensor(bad)
    assert d["nonfinite"] == 2 and d["sum"] is None and d["sketch"] is None
    big = t * 1e25  # squares beyond float32: the statistics again in float64
    d = D.digest_tensor(big)
    a = big.numpy().astype(np.float64).ravel()
    exact = math.sqrt(math.fsum(a * a))
    assert math.isfinite(d["norm"]) and abs(d["norm"] - exact) <= 1e-6 * exact
    flipped = t.clone()
    flipped.view(torch.int32)[999, 77] ^= 1 << 3
    assert D.digest_tensor(flipped)["digest"] != D.digest_tensor(t)["digest"]


@pytest.mark.slow  # two fresh interpreters (torch, numba): seconds each
def test_two_processes_record_the_same_bits():
    """What two reference runs rely on: the compiled pass gives the same numbers in another process (the
    kernel loaded from numba's cache or compiled again)."""
    import subprocess
    import sys

    code = (
        "import torch, orjson; from disttrace.run.record import digest as D; "
        "g = torch.Generator().manual_seed(9); t = torch.randn(1376, 512, generator=g); "
        "assert D._fused() is not None; print(orjson.dumps(D.digest_tensor(t)).decode())"
    )
    out = [
        subprocess.run(
            [sys.executable, "-c", code], check=True, capture_output=True, text=True
        ).stdout
        for _ in range(2)
    ]
    assert out[0] == out[1] and '"sketch":[' in out[0]


# ---------------------------------------------------------------- one call per list, hashed inside
# digest_many hands a list's large float32 tensors to fused.many_stats in one call, which feeds xxhash's own
# C function a few rows at a time and reduces them from L1. The oracles: xxhash's one-shot digest of the
# bytes, the kernel before it (below: its sketch part, u^T X in float32 row after row, whose bits this one
# keeps; only the last float64 product with W is now the kernel's own), and the same numbers whichever
# way the tensors are cut (per tensor, per block, pieces of any size).


def _list(seed=5):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g) for s in SHAPES]
    ts += [torch.randn(512, generator=g), torch.randn(300, 64, generator=g).double()]  # not fused
    ts += [torch.rand(700, 512, generator=g) * 1e-3]  # positive, small
    return ts


def test_one_call_for_a_list_records_what_one_tensor_at_a_time_does(monkeypatch):
    ts = _list()
    got = digest_many([(t, None, None) for t in ts])
    assert [d["digest"] for d in got] == [xxhash.xxh3_128_hexdigest(t.numpy()) for t in ts]
    assert got == [D.digest_tensor(t) for t in ts]  # one compiled call per tensor
    from disttrace.run.record import fused

    for chunk in (4 << 10, 64 << 10):  # the hashing's pieces take no part in the arithmetic
        monkeypatch.setattr(fused, "CHUNK_BYTES", chunk)
        assert digest_many([(t, None, None) for t in ts]) == got
    monkeypatch.setattr(
        D, "_xxh3", None
    )  # xxhash fed from Python a block at a time, one call a block
    assert digest_many([(t, None, None) for t in ts]) == got


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_sketch_is_the_previous_kernels_to_float64_rounding(shape):
    """Each column's u * x added row after row in float32 within a block, as the kernel before this one
    (one call a block, kept here as the oracle): the same u^T X bit for bit, so the sketch differs from
    the previous one by the float64 rounding of its last product W^T (u^T X) only, far below the float32
    rounding tolerance.sketch_rounding allows (a change of the float32 order would show here)."""
    t = _data(shape, "normal", seed=3)
    x = t.numpy()
    plan = plan_for(tuple(shape), (0,) * len(shape), tuple(shape))
    x2 = x.reshape(-1, shape[-1])
    m = np.zeros(plan.cols)
    for r0 in range(0, plan.rows, plan.block_rows):
        _previous_block_sketch(x2, plan.u32, r0, min(r0 + plan.block_rows, plan.rows), m)
    got = np.array(digest_many([(t, None, None)])[0]["sketch"])
    assert np.all(np.abs(got - plan.wt64 @ m) <= 1e-14 * (np.abs(plan.wt64) @ np.abs(m)))


def test_a_non_finite_tensor_in_a_list_leaves_the_others_as_they_were():
    ts = _list(seed=8)
    ref = digest_many([(t, None, None) for t in ts])
    bad = [t.clone() for t in ts]
    bad[1][5, 7] = float("nan")
    got = digest_many([(t, None, None) for t in bad])
    assert got[1]["nonfinite"] == 1 and got[1]["sum"] is None and got[1]["sketch"] is None
    assert got[1]["digest"] != ref[1]["digest"]
    assert got[:1] + got[2:] == ref[:1] + ref[2:]


def _previous_block_sketch(x, u, first, last, m):
    from numba import njit

    global _previous_kernel
    if _previous_kernel is None:

        @njit(fastmath={"reassoc", "contract"}, boundscheck=False, cache=True)
        def kernel(x, u, first, last, m):  # the sketch part of the kernel before this one
            part = np.zeros(x.shape[1], dtype=np.float32)
            for r in range(first, last):
                row = x[r]
                ur = u[r]
                for c in range(x.shape[1]):
                    part[c] += ur * row[c]
            for c in range(x.shape[1]):
                m[c] += part[c]

        _previous_kernel = kernel
    _previous_kernel(x, u, first, last, m)


_previous_kernel = None
