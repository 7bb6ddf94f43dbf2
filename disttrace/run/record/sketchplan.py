"""The sketch's random projections (docs/format.md): the vectors of a tensor or shard, by its shape and its
place in the logical tensor, built once (`plan_for`). run/record/digest.py (host tensors), run/record/digestmany.py (small
tensors in batches) and run/record/devdigest.py (device tensors) reduce with them."""

from __future__ import annotations

import functools
import math

import numpy as np

from disttrace.analysis import tolerance

# ---------------------------------------------------------------- the random-projection sketch
# Sum and norm are two numbers: a permutation of a tensor's elements keeps both, and so do offsetting errors
# (+e here, -e there) to first order. The sketch adds SKETCH_K dot products <x, v_k> with fixed random
# vectors. v_k is indexed by the element's position in the *logical* tensor, as a product over axes:
# v_k[i_0, .., i_D-1] = fl32(prod_{d<D-1} a_{0,d}[i_d]) * a_{k,D-1}[i_D-1], each a_{k,d} a seeded Gaussian
# vector of the logical axis length scaled to RMS 1 (so ||v_k||^2 = numel, to float32 rounding of the leading
# factor): the leading axes' factor u is one vector shared by the K projections (a_{0,d}), rounded to
# float32 once (fl32) because the kernel below multiplies by it in float32; the last axis has K factors.
# A shard at offsets o_d uses the slices a_{k,d}[o_d : o_d + n_d] (and the same products), so the sketches
# of a tensor's shards add up to the whole tensor's exactly in exact arithmetic: logical tensors still
# compare across topologies. The bound of a sketch difference is the sum's (analysis/tolerance.py): with
# |dx_i| <= eps |x_i|, |sum_i dx_i v_i| <= eps ||x|| ||v|| = eps ||x|| sqrt(numel), plus the sketch's own
# rounding (tolerance.sketch_rounding). A difference dX escapes projection k only if W_k is orthogonal to
# u^T dX, a vector of C random combinations of dX's rows: probability 0 for any fixed dX, as with K
# separate leading factors; two elements swapped within a column move u^T dX by (u_i - u_j) x.
#
# This is the sketch's version 2 (store.trajectory.SKETCH_VERSION, written in each step index line). Version
# 1 had K leading factors a_{k,d}: a float32 GEMM U_blk^T X_blk (K x C) a block, whose packing of the block
# cost about as much as the xxh3 pass; the shared factor makes it a GEMV, about a third of the GEMM
# (bench/recorder_passes.py measures both). The values differ, so diff compares sketches only between
# stores of one version (a pair of versions compares on digest, sum and norm, and says so).
#
# Cost. The tensor, seen as X (R rows = the leading axes, C columns = the last axis), gives
# sketch_k = (u^T X) W[:, k]. Per block of at most SKETCH_ROWS rows (a block fits in cache): one float32
# GEMV y += u_blk^T X_blk (C values, accumulated in float64), and at the end the float64 product W^T y.
# The same pass over the block hashes it (streamed xxh3 = the one-shot hash of the raw bytes) and takes its
# sum and sum of squares in float32 runs of tolerance.STAT_CHUNK elements (two dot products a run, added in
# float64), so the tensor is read from memory once and each further operation reads the block from cache
# (L2-sized: 512 KiB). A float64 copy of each block, summed and squared there, cost more than the sketch's
# GEMM (bench/recorder_passes.py times each component) and needed 1.5 MiB of cache a block; the float32 runs round by about u32 * sqrt(STAT_CHUNK)
# (tolerance.sum_rounding, norm_rounding, which diff adds to the derived bound of the sum and norm terms),
# and a float32 tensor whose squares leave float32's range gets its sum and norm in float64 after all.
# A float32 reduction over at most SKETCH_ROWS rows rounds by about u32 * sqrt(SKETCH_ROWS) relative to
# ||x|| sqrt(numel) (tolerance.sketch_rounding, which diff adds to the bound of the sketch terms): the GEMV's
# column sums are those rows, as the GEMM's were. float64 tensors (and integers) use the same vectors in
# float64.
# With numba installed (the `fast` extra), a float32 tensor of more than FUSED_MIN elements takes run/record/fused.py
# instead, where numpy's three calls a block each cost about what the hash does
# (bench/recorder_breakdown.py): digest_many hands a hook list's such tensors to one compiled call, which
# feeds xxh3 (xxhash's own C function) a few rows at a time and reduces them from L1: the sums and squares
# in groups of at most STAT_CHUNK rows of a column, the block's u^T X, each tensor's W^T (u^T X) at its
# end. The same bounds hold; the values differ from numpy's by rounding only, the digests not at all.
SKETCH_K = 4
SKETCH_SEED = 0x5EED_D15C
# elements per block: 512 KiB of float32 (L2-sized); the sketch's float32 row blocks depend on it
BLOCK = 1 << 17


def axis_vectors(axis: int, length: int) -> np.ndarray:
    """(length, SKETCH_K) float64: the sketch's factors along one logical axis of that length."""
    g = np.random.default_rng([SKETCH_SEED, axis, length]).standard_normal((length, SKETCH_K))
    g *= np.sqrt(length / np.maximum((g * g).sum(axis=0), 1e-300))
    g.setflags(write=False)
    return g


class Plan:
    """The sketch's vectors for one (shape, offset, logical shape), built once (functools cache): the
    leading axes' shared factor u (as float32, and the same values in float64; `ut64` repeats it as the K
    rows of U for the paths that take U^T X W whole: device tensors, small ones together), the last axis'
    factors W."""

    __slots__ = (
        "rows",
        "cols",
        "block_rows",
        "u32",
        "u64",
        "ut64",
        "wt64",
        "on_device",
        "addresses",
    )

    def __init__(self, shape: tuple, off: tuple, lshape: tuple):
        self.cols = shape[-1]
        self.rows = math.prod(shape[:-1])
        u = np.ones(1)
        for d in range(
            len(shape) - 1
        ):  # row-major over the leading axes, products in a fixed order
            a = axis_vectors(d, lshape[d])[off[d] : off[d] + shape[d], 0]
            u = (u[:, None] * a[None, :]).reshape(-1)
        self.u32 = np.ascontiguousarray(u, dtype=np.float32)  # (rows,): fl32 of the product, once
        self.u64 = self.u32.astype(
            np.float64
        )  # the same values: float64 tensors use the same vectors
        self.ut64 = np.ascontiguousarray(np.broadcast_to(self.u64, (SKETCH_K, self.rows)))
        w = axis_vectors(len(shape) - 1, lshape[-1])[off[-1] : off[-1] + self.cols]
        self.wt64 = np.ascontiguousarray(w.T)  # (K, cols)
        self.addresses = (self.u32.ctypes.data, self.wt64.ctypes.data)  # for fused.many_stats
        self.block_rows = max(1, min(self.rows, tolerance.SKETCH_ROWS, BLOCK // max(self.cols, 1)))
        self.on_device: dict = {}  # device -> (ut64, wt64) copies there


@functools.lru_cache(maxsize=1024)
def plan_for(shape: tuple, off: tuple, lshape: tuple) -> Plan:
    if len(lshape) != len(shape) or len(off) != len(shape):
        raise ValueError(
            f"shard shape {shape} / offset {off} do not match the logical shape {lshape}"
        )
    return Plan(shape, off, lshape)
