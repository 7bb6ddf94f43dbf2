"""Tensor digests: bit-exact (any flipped bit changes it) and cheap (xxh3-128 runs at memory bandwidth,
docs/design.md, "Facts"), plus sum, L2 norm and sketch for tolerance comparisons across topologies
(reduced in float32 for float32 tensors, within the rounding analysis/tolerance.py derives).
Checkpoint files, read once, get sha256 instead (checkpoint.py)."""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
import xxhash
from torch.multiprocessing.reductions import StorageWeakRef

from disttrace.analysis import tolerance
from disttrace.compiled import optional


def raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


_M1, _M2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)  # as signed int64


def device_digest(t: torch.Tensor) -> str:
    """A 128-bit checksum computed where the tensor lives (no host copy of the tensor: on a GPU only two
    integers cross). The raw bits, read as integers v_i, are summed with odd position weights w_i
    (int64 arithmetic wraps mod 2^64): flipping bit k of element i changes the sum by 2^k * w_i, never 0
    mod 2^64 for odd w_i, so any single flipped bit changes it. Two independent weightings make 128 bits.
    Not a cryptographic hash: it guards against faults, not adversaries."""
    flat = t.detach().contiguous().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    v = flat.view(ints).to(torch.int64)
    pos = torch.arange(v.numel(), dtype=torch.int64, device=v.device)
    h1 = (v * (pos * _M1 | 1)).sum()
    h2 = ((v ^ (v >> 7)) * (pos * _M2 | 1)).sum()
    return f"dev:{int(h1) & (2**64 - 1):016x}{int(h2) & (2**64 - 1):016x}"


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
# With numba installed (the `fast` extra), a float32 tensor of more than FUSED_MIN elements takes run/fused.py
# instead, where numpy's three calls a block each cost about what the hash does
# (bench/recorder_breakdown.py): digest_many hands a hook list's such tensors to one compiled call, which
# feeds xxh3 (xxhash's own C function) a few rows at a time and reduces them from L1: the sums and squares
# in groups of at most STAT_CHUNK rows of a column, the block's u^T X, each tensor's W^T (u^T X) at its
# end. The same bounds hold; the values differ from numpy's by rounding only, the digests not at all.
SKETCH_K = 4
SKETCH_SEED = 0x5EED_D15C
# elements per block: 512 KiB of float32 (L2-sized); the sketch's float32 row blocks depend on it
_BLOCK = 1 << 17


def axis_vectors(axis: int, length: int) -> np.ndarray:
    """(length, SKETCH_K) float64: the sketch's factors along one logical axis of that length."""
    g = np.random.default_rng([SKETCH_SEED, axis, length]).standard_normal((length, SKETCH_K))
    g *= np.sqrt(length / np.maximum((g * g).sum(axis=0), 1e-300))
    g.setflags(write=False)
    return g


class _Plan:
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
        self.block_rows = max(1, min(self.rows, tolerance.SKETCH_ROWS, _BLOCK // max(self.cols, 1)))
        self.on_device: dict = {}  # device -> (ut64, wt64) copies there


@functools.lru_cache(maxsize=1024)
def _plan(shape: tuple, off: tuple, lshape: tuple) -> _Plan:
    if len(lshape) != len(shape) or len(off) != len(shape):
        raise ValueError(
            f"shard shape {shape} / offset {off} do not match the logical shape {lshape}"
        )
    return _Plan(shape, off, lshape)


_tls = threading.local()  # the float64 block buffer, per thread


def _buffer() -> np.ndarray:
    b = getattr(_tls, "buf", None)
    if b is None:
        b = _tls.buf = np.empty(_BLOCK)
    return b


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype) -> np.ndarray:
    v = np.ones(n, dtype=dtype)
    v.setflags(write=False)
    return v


_vecdot = getattr(np, "vecdot", None)  # numpy >= 2; einsum is the same reduction in numpy 1.x


def _sums(flat: np.ndarray) -> tuple[float, float]:
    """(sum, sum of squares) of a contiguous 1-D block in its own dtype, over runs of at most
    tolerance.STAT_CHUNK consecutive elements (a dot product with ones, and with itself), the runs' results
    added in float64: no float64 copy of the block, and a rounding bounded by the run length whatever order
    the dot products take (tolerance.sum_rounding, norm_rounding)."""
    n, chunk = flat.size, tolerance.STAT_CHUNK
    q = n - n % chunk
    s = ss = 0.0
    if q:
        z = flat[:q].reshape(-1, chunk)
        s = float((z @ _ones(chunk, flat.dtype)).sum(dtype=np.float64))
        runs = _vecdot(z, z) if _vecdot is not None else np.einsum("ij,ij->i", z, z)
        ss = float(runs.sum(dtype=np.float64))
    if q < n:
        tail = flat[q:]
        s += float(tail.sum(dtype=np.float64))
        ss += float(np.dot(tail, tail))
    return s, ss


# float32 tensors of more elements than this (256 KiB) take run/fused.py where numba is installed: the
# dim-512 model's matrices and activations; a small model's tensors (the default manifest's are at most
# 32 Ki elements) stay with numpy and never import numba
FUSED_MIN = 1 << 16
_kernel = None  # run/fused.py (the module), False where numba is absent or DISTTRACE_FUSED=0
_xxh3 = None  # fused.Xxh3: xxhash's C functions for the kernel, or None (xxhash fed from Python)


def _fused():
    """run/fused.py, whose compiled pass takes float32 tensors of more than FUSED_MIN elements, or None:
    numba is an optional extra (`pip install disttrace[fast]`), imported the first time such a tensor is
    digested (a tiny model never pays its import). DISTTRACE_FUSED=0 keeps the numpy path (the benches'
    baseline)."""
    global _kernel, _xxh3
    if _kernel is None:
        fused = optional("disttrace.run.record.fused", "DISTTRACE_FUSED")
        if fused is not None:
            _xxh3 = fused.Xxh3.load()
        _kernel = fused or False
    return _kernel or None


def _stats64(x: np.ndarray) -> tuple[float, float]:
    """(sum, sum of squares) in float64 through a float64 copy of each block: the statistics of a float32
    tensor whose values overflow or underflow float32 arithmetic (squares beyond 3.4e38 or in the
    subnormal range)."""
    flat = x.reshape(-1)
    buf = _buffer()
    s = ss = 0.0
    for a in range(0, flat.size, _BLOCK):
        b = buf[: min(_BLOCK, flat.size - a)]
        np.copyto(b, flat[a : a + b.size])
        s += float(b.sum())
        ss += float(np.dot(b, b))
    return s, ss


def _fused_stats(x: np.ndarray, plan: _Plan, hasher):
    """_stats of a float32 array of more than FUSED_MIN elements in run/fused.py's compiled pass, hashed
    on the way (its digest returned, `hasher` fed nothing) where xxhash's C functions could be bound,
    else each block fed to `hasher` and then reduced while it is in cache (the same statistics)."""
    kernel, xxh3 = _kernel, _xxh3
    digest = None
    if hasher is None or xxh3 is not None:
        states = np.zeros(1, dtype=np.int64) if hasher is None else xxh3.states(1)
        out, digests = np.zeros((1, 2 + SKETCH_K)), np.zeros((1, 2), dtype=np.uint64)
        kernel.many_stats(
            np.array([_table_row(plan)], dtype=np.int64),
            np.array([x.ctypes.data], dtype=np.int64),
            states,
            xxh3.update if hasher is not None else 0,
            xxh3.reset if hasher is not None else 0,
            xxh3.digest if hasher is not None else 0,
            out,
            digests,
        )
        if hasher is not None:
            digest = (
                xxh3.hex(*digests[0].tolist()) if xxh3.digest else xxh3.hexdigest(int(states[0]))
            )
        s, ss, *sk = out[0].tolist()
        return _fused_finish(x, s, ss, sk, digest)
    acc, sk = np.zeros(2), np.zeros(SKETCH_K)
    x2, m, chunk = (
        x.reshape(plan.rows, plan.cols),
        np.zeros(plan.cols),
        kernel.chunk_rows(plan.cols),
    )
    for r0 in range(0, plan.rows, plan.block_rows):
        blk = x2[r0 : r0 + plan.block_rows]
        hasher.update(blk)
        kernel.tensor_stats(
            blk, plan.u32[r0 : r0 + plan.block_rows], plan.block_rows, chunk, 0, 0, m, acc
        )
    kernel.project(plan.wt64, m, sk)
    return _fused_finish(x, *acc.tolist(), sk.tolist(), digest)


def _table_row(plan: _Plan) -> tuple:
    """A tensor's row of fused.many_stats' table (fused.TABLE)."""
    return (
        plan.rows,
        plan.cols,
        *plan.addresses,
        plan.block_rows,
        _kernel.chunk_rows(plan.cols),
    )


def _fused_finish(x: np.ndarray, s: float, ss: float, sk: list, digest):
    if not (math.isfinite(s) and tolerance.stats_in_range(ss, x.size)):
        s, ss = _stats64(x)  # as in _stats: float32's range exceeded, the statistics in float64
    return s, ss, sk if math.isfinite(sum(sk)) else None, digest


def _stats(x: np.ndarray, offset, logical_shape, hasher=None, with_sketch: bool = True):
    """(sum, sum of squares, sketch or None, digest or None) of a contiguous float32 or float64 array in one
    pass over cache-sized blocks; `hasher` (xxh3) is fed the raw bytes on the way, unless the compiled pass
    hashes them itself: it then gives their digest (the hexdigest `hasher` would have given) and `hasher`
    is fed nothing. A block of several rows is
    reduced in the array's own dtype, sum and sum of squares in runs of STAT_CHUNK elements (`_sums`), with
    nothing copied; one row per block (1-D tensors, rows of more than half a block) goes through the
    float64 buffer."""
    shape = x.shape
    if not shape:  # a scalar: the empty product, every v_k is 1
        if hasher is not None:
            hasher.update(x.tobytes())
        v = float(x)
        return v, v * v, [v] * SKETCH_K if with_sketch else None, None
    if not x.size:
        return 0.0, 0.0, None, None
    lshape = tuple(logical_shape) if logical_shape else shape
    off = tuple(offset) if offset else (0,) * len(shape)
    plan = _plan(tuple(shape), off, lshape) if with_sketch and x.size else None
    if (
        plan is not None
        and plan.block_rows > 1
        and x.size > FUSED_MIN
        and x.dtype == np.float32
        and _fused() is not None
    ):
        return _fused_stats(x, plan, hasher)
    cols = shape[-1]
    x2 = x.reshape(-1, cols)
    rows = x2.shape[0]
    f64 = x.dtype == np.float64
    buf = None if f64 else _buffer()
    rb = (
        plan.block_rows
        if plan is not None
        else max(1, min(rows, tolerance.SKETCH_ROWS, _BLOCK // max(cols, 1)))
    )
    s = ss = 0.0
    # u^T X (cols,): float64 over blocks, one block's float32 GEMV as it is
    m = (np.zeros(cols) if rb < rows else True) if plan is not None and rb > 1 else None
    direct = np.zeros(SKETCH_K) if plan is not None and rb == 1 else None
    u = (plan.u64 if f64 else plan.u32) if plan is not None else None
    in_runs = (
        f64 or x.size > tolerance.FLOAT64_STATS
    )  # float32 runs (tolerance.sum_rounding), or float64
    for r0 in range(0, rows, rb):
        blk = x2[r0 : r0 + rb]
        if hasher is not None:
            hasher.update(blk)
        if rb > 1 and in_runs:  # in the block's dtype, from the block as it lies in cache
            bs, bss = _sums(blk.reshape(-1))
            s += bs
            ss += bss
            if m is not None:
                part = u[r0 : r0 + rb] @ blk  # the float32 GEMV (float64 for float64 tensors)
                if rb >= rows:  # one block: no float64 accumulator to fill
                    m = part
                else:
                    m += part
        elif cols <= _BLOCK:  # float64: one row per block (1-D tensors, long rows), a small tensor
            if f64:
                b = blk.reshape(-1)
            else:
                b = buf[: blk.size]
                np.copyto(b, blk.reshape(-1))
            s += float(b.sum())
            ss += float(np.dot(b, b))
            if direct is not None:
                direct += plan.u64[r0] * (plan.wt64 @ b)
            elif m is not None:
                part = u[r0 : r0 + rb] @ blk
                m = part if rb >= rows else m + part
        else:  # a row longer than a block: its columns in chunks
            proj = np.zeros(SKETCH_K) if direct is not None else None
            row = blk.reshape(-1)
            for c0 in range(0, cols, _BLOCK):
                seg = row[c0 : c0 + _BLOCK]
                if f64:
                    b = seg
                else:
                    b = buf[: seg.size]
                    np.copyto(b, seg)
                s += float(b.sum())
                ss += float(np.dot(b, b))
                if proj is not None:
                    proj += plan.wt64[:, c0 : c0 + seg.size] @ b
            if proj is not None:
                direct += plan.u64[r0] * proj
    if (
        rb > 1
        and in_runs
        and not f64
        and not (math.isfinite(s) and tolerance.stats_in_range(ss, x.size))
    ):
        # float32 arithmetic overflowed or lost digits to subnormals: the statistics again in float64
        # (a non-finite value stays non-finite there and is counted by the caller)
        s, ss = _stats64(x)
    if plan is None:
        return s, ss, None, None
    sk = direct if m is None else plan.wt64 @ np.asarray(m, dtype=np.float64)
    sk = sk.tolist()
    return (
        s,
        ss,
        sk if math.isfinite(sum(sk)) else None,  # a float32 overflow: no sketch rather than inf
        None,
    )


def sketch(a: np.ndarray, offset=None, logical_shape=None) -> list[float]:
    """SKETCH_K projections of the array `a` (a whole tensor, or a shard at `offset` of a tensor of
    `logical_shape`): float32 arithmetic for float32 (and narrower float) arrays, float64 otherwise."""
    a = np.asarray(a)
    if a.dtype != np.float32:
        a = a.astype(np.float32 if a.dtype in (np.float16,) else np.float64)
    return _stats(np.ascontiguousarray(a), offset, logical_shape)[2]


def digest_tensor(
    t: torch.Tensor, offset=None, logical_shape=None, with_sketch: bool = True
) -> dict:
    """{'digest','sum','norm','sketch','nonfinite','dtype','shape','numel'} of one (local) tensor; `offset`
    and `logical_shape` place a shard in its logical tensor (for the sketch). On a GPU the digest and the
    float64 statistics are computed on the device, waiting for it (the recorder batches device tensors
    instead: run/devdigest.py); on the CPU, xxh3 over the raw bytes. `with_sketch=False`
    leaves the sketch out (bench/digest_cost.py's baseline)."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
        t = t.to_local()
    if t.device.type == "cuda":
        return _digest_on_device(t, offset, logical_shape, with_sketch)
    with np.errstate(all="ignore"):  # a fault may plant inf/nan: counted below, not warned about
        return _digest_host(t, offset, logical_shape, with_sketch)


_DTYPE_NAMES: dict = {}  # torch dtype -> its name in a record ("float32")


def _digest_host(
    t: torch.Tensor, offset=None, logical_shape=None, with_sketch: bool = True
) -> dict:
    """digest_tensor of a local, detached tensor not on a GPU, the caller holding np.errstate (digest_many
    enters it once for a hook's list: it costs about as much as the rest of a tensor's Python)."""
    cpu = t.contiguous() if t.device.type == "cpu" else t.cpu().contiguous()
    dtype = cpu.dtype
    if dtype is torch.float32 or dtype is torch.float64:  # hashed block by block in the same pass
        h = xxhash.xxh3_128()
        x = cpu.numpy()
        s, ss, sk, digest = _stats(x, offset, logical_shape, h, with_sketch)
        h = digest or h.hexdigest()
    else:  # float16/bfloat16 -> float32 (exact), integers -> float64; the raw bytes hashed as they are
        h = xxhash.xxh3_128_hexdigest(raw_bytes(cpu))
        x = cpu.to(torch.float32 if dtype.is_floating_point else torch.float64).numpy()
        s, ss, sk, _ = _stats(x, offset, logical_shape, None, with_sketch)
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return _record(name, x, s, ss, sk, h)


def _record(dtype: str, x: np.ndarray, s: float, ss: float, sk, h: str) -> dict:
    """A host tensor's digest dict from its statistics (x: its values as the statistics read them)."""
    n = math.sqrt(ss) if math.isfinite(ss) else math.inf
    nonfinite = 0
    if not (math.isfinite(s) and math.isfinite(n)):  # counting is slow: only when the sum says so
        nonfinite = int((~np.isfinite(x)).sum())
    return {
        "dtype": dtype,
        "shape": list(x.shape),
        "numel": x.size,
        "digest": h,
        "sum": s if math.isfinite(s) else None,
        "norm": n if math.isfinite(n) else None,
        "sketch": sk if not nonfinite and x.size else None,
        "nonfinite": nonfinite,
    }


def digest_of_digests(digests: list[str]) -> str:
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def _sketch_on_device(a: torch.Tensor, offset, logical_shape) -> list[float]:
    """`sketch` with torch ops in float64 where the tensor lives, with the same vectors (only SKETCH_K
    numbers cross to the host)."""
    shape = tuple(a.shape)
    if not shape:
        return [float(a)] * SKETCH_K
    lshape = tuple(logical_shape) if logical_shape else shape
    off = tuple(offset) if offset else (0,) * len(shape)
    plan = _plan(shape, off, lshape)
    if a.device not in plan.on_device:
        plan.on_device[a.device] = tuple(
            torch.tensor(v, device=a.device) for v in (plan.ut64, plan.wt64)
        )
    ut, wt = plan.on_device[a.device]
    m = ut @ a.reshape(-1, shape[-1])  # (K, cols)
    return [float(x) for x in (m * wt).sum(dim=1).cpu()]


def _digest_on_device(
    t: torch.Tensor, offset=None, logical_shape=None, with_sketch: bool = True
) -> dict:
    a = t.to(torch.float64)
    s, n = float(a.sum()), float(torch.linalg.vector_norm(a))
    nonfinite = 0
    if not (math.isfinite(s) and math.isfinite(n)):
        nonfinite = int((~torch.isfinite(a)).sum())
    sk = (
        _sketch_on_device(a, offset, logical_shape)
        if with_sketch and not nonfinite and a.numel()
        else None
    )
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "numel": int(t.numel()),
        "digest": device_digest(t) if t.numel() else "dev:" + "0" * 32,
        "sum": s if math.isfinite(s) else None,
        "norm": n if math.isfinite(n) else None,
        "sketch": sk,
        "nonfinite": nonfinite,
    }


# ---------------------------------------------------------------- many small tensors at once
# A hook hands the recorder a list of tensors (every parameter's gradient, every optimizer state). On a small
# model each tensor costs more in Python (a dozen numpy calls, ~50-70 us) than in arithmetic, so the small
# float32 CPU tensors of one list are digested together: one concatenated buffer, xxh3 of each tensor's
# slice (the same bytes, so the same digest as digest_tensor's), float64 sums and sums of squares by one
# segmented reduction (np.add.reduceat), and the sketch as one float64 matrix-vector product of each
# tensor's slice with its vectors v_k = U_k (x) W_k (the same vectors as the per-tensor path, laid end to
# end; built once per list of shapes and cached: faster than np.add.reduceat over the (K, total) elementwise
# products). The float64 reductions round less than the per-tensor float32 GEMV, so
# tolerance.sketch_rounding bounds this path too; two runs of one manifest take the same path and stay
# bit-identical.
SMALL = tolerance.FLOAT64_STATS  # elements: a tensor at most this large is digested with the others
_GROUP = 1 << 18  # elements per batch: its sketch vectors are SKETCH_K x 2 MiB of float64, cached


@functools.lru_cache(maxsize=8)  # at most 8 x 8 MiB
def _vectors(signature: tuple) -> np.ndarray:
    """(SKETCH_K, total) float64: each tensor's v_k = outer(U_k, W_k), flattened row-major, end to end."""
    parts = []
    for shape, off, lshape in signature:
        plan = _plan(shape, off, lshape)
        parts.append((plan.ut64[:, :, None] * plan.wt64[:, None, :]).reshape(SKETCH_K, -1))
    v = np.concatenate(parts, axis=1)
    v.setflags(write=False)
    return v


def _batchable(t: torch.Tensor) -> bool:
    return (
        t.dtype is torch.float32
        and 0 < t.numel() <= SMALL
        and t.device.type == "cpu"
        and t.dim() > 0
    )


def digest_many(items: list[tuple], seen: Seen | None = None, recheck: bool = False) -> list[dict]:
    """digest_tensor for each (tensor, offset, logical_shape), in order: the small float32 CPU tensors in
    batches, the large float32 ones in one compiled call, the others one by one; with `seen`, a tensor
    whose bytes were digested lately is hashed only (`Seen`; `recheck`: even if its version changed
    since). How each tensor is taken is decided once per list of dtypes, shapes, devices and placements
    (`_Layout`): a hook hands over the same list every step."""
    locals_ = []
    signature = []
    for t, off, lshape in items:
        if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
            t = t.detach().to_local()
        locals_.append(t)
        signature.append(
            (
                t.dtype,
                t.shape,
                t.device,
                tuple(off) if off else None,
                tuple(lshape) if lshape else None,
            )
        )
    layout = _layout(tuple(signature), locals_)
    out: list = [None] * len(items)
    if layout.fused:  # numpy only where one fails its checks (np.errstate there)
        _digest_fused(layout, locals_, items, out, seen, recheck)
    if not (layout.host or layout.device or layout.batches):
        return out
    with np.errstate(all="ignore"):  # once for the list (see _digest_host)
        for i, on_cpu in layout.host:
            t = locals_[i].detach()
            _, off, lshape = items[i]
            if seen is not None and on_cpu:
                out[i] = seen.host_digest(t, off, lshape, recheck)
            else:
                out[i] = _digest_host(t, off, lshape)
        for i in layout.device:
            _, off, lshape = items[i]
            out[i] = _digest_on_device(locals_[i].detach(), off, lshape)
        for batch in layout.batches:
            _digest_batch(batch, locals_, out)
    return out


class _Layout:
    """How `digest_many` takes a list of tensors, decided from their dtypes, shapes, devices and placements
    alone (what `_layout` is keyed by): the host tensors digested one by one (index, on the CPU: `Seen`
    applies), the device ones, the small float32 ones' batches (`_batch`), and the large float32 ones
    `fused.many_stats` takes: their indices, plans (held: the table has the addresses of their vectors),
    rows of its table (fused.TABLE: all it needs but the bytes' address), shapes and element counts. Per
    tensor per step, that is a tuple of its metadata and a look-up instead of a dozen checks, a placement
    plan's cache look-up and a table row built in Python."""

    __slots__ = ("host", "device", "batches", "fused", "plans", "table", "shapes", "numels")

    def __init__(self, signature: tuple, tensors: list):
        self.host: list[tuple[int, bool]] = []
        self.device: list[int] = []
        self.batches: list[tuple] = []
        self.fused: list[int] = []
        self.plans: list[_Plan] = []
        rows, self.shapes, numels = [], [], []
        batch: list[int] = []
        size = 0
        for i, (t, (_, shape, device, off, lshape)) in enumerate(zip(tensors, signature)):
            if _batchable(t):
                if size + t.numel() > _GROUP and batch:
                    self.batches.append(_batch(batch, signature))
                    batch, size = [], 0
                batch.append(i)
                size += t.numel()
                continue
            if device.type == "cuda":
                self.device.append(i)
                continue
            plan = _fusable(t, off, lshape)
            if plan is None:
                self.host.append((i, device.type == "cpu"))
                continue
            self.fused.append(i)
            self.plans.append(plan)
            rows.append(_table_row(plan))
            self.shapes.append(list(shape))
            numels.append(t.numel())
        if batch:
            self.batches.append(_batch(batch, signature))
        self.table = np.array(rows, dtype=np.int64).reshape(-1, 6)  # fused.TABLE's columns
        self.numels = numels


def _batch(indices: list[int], signature: tuple) -> tuple:
    """A batch of small float32 tensors (`_digest_batch`): their indices, where each starts in the batch's
    buffer and how long it is, their sketch vectors' key (`_vectors`), their shapes."""
    shapes, places = [], []
    for i in indices:
        _, shape, _, off, lshape = signature[i]
        shape = tuple(shape)
        shapes.append(shape)
        places.append((shape, off or (0,) * len(shape), lshape or shape))
    lengths = [math.prod(shape) for shape in shapes]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return indices, starts, starts.tolist(), lengths, tuple(places), shapes


_LAYOUTS: dict = {}  # (the compiled pass's availability, a list's signature) -> _Layout
_LAYOUTS_MAX = 1024  # distinct lists kept (a hook's list, each single tensor `add` hands over)


def _layout(signature: tuple, tensors: list) -> _Layout:
    key = (_kernel, _xxh3, _chunk_bytes(), signature)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _Layout(signature, tensors)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        # building it may have loaded the compiled pass (its first large tensor): kept under what it saw
        _LAYOUTS[(_kernel, _xxh3, _chunk_bytes(), signature)] = layout
    return layout


def _chunk_bytes() -> int:
    """The compiled pass's hashing piece (its table's `chunk` column depends on it), 0 without it."""
    return _kernel.CHUNK_BYTES if _kernel else 0


def _fusable(t: torch.Tensor, off, lshape) -> _Plan | None:
    """The sketch's plan of a host float32 tensor that fused.many_stats takes (more than FUSED_MIN
    elements, blocks of several rows; numba and xxhash's C functions at hand), else None."""
    if t.dtype is not torch.float32 or t.numel() <= FUSED_MIN or t.device.type != "cpu":
        return None
    if _fused() is None or _xxh3 is None:
        return None
    shape = tuple(t.shape)
    plan = _plan(
        shape, tuple(off) if off else (0,) * len(shape), tuple(lshape) if lshape else shape
    )
    return plan if plan.block_rows > 1 else None


def _digest_fused(
    layout: _Layout, tensors: list, items: list, out: list, seen: Seen | None, recheck: bool
) -> None:
    """_digest_host of each of the layout's large float32 tensors, all in one compiled call that hands back
    each one's statistics and digest: the statistics _fused_stats computes one by one, bit for bit. After
    it, two `tolist`s and a few Python operations a tensor (numpy's calls, each one's machinery fetched
    again from memory after the bytes streamed through the caches, cost more)."""
    keep: list[int] = []  # positions in layout.fused of the tensors digested (not reused by `seen`)
    held, tokens, addresses = [], [], []
    for j, i in enumerate(layout.fused):
        t = tensors[i]
        token = None
        if seen is not None:
            _, off, lshape = items[i]
            hit, token = seen.lookup(t, off, lshape, recheck)
            if hit is not None:
                out[i] = hit
                continue
        if not t.is_contiguous():
            t = t.detach().contiguous()  # a copy, held until the kernel has read it
        keep.append(j)
        held.append(t)
        tokens.append(token)
        addresses.append(t.data_ptr())
    n = len(keep)
    if not n:
        return
    xxh3 = _xxh3
    states = xxh3.states(n)
    results, digests = np.empty((n, 2 + SKETCH_K)), np.zeros((n, 2), dtype=np.uint64)
    _kernel.many_stats(
        layout.table if n == len(layout.fused) else layout.table[keep],
        np.array(addresses, dtype=np.int64),
        states,
        xxh3.update,
        xxh3.reset,
        xxh3.digest,
        results,
        digests,
    )
    hexes = (
        [xxh3.hex(high, low) for high, low in digests.tolist()]
        if xxh3.digest
        else [xxh3.hexdigest(s) for s in states.tolist()]
    )
    shapes, numels, fused, in_range = (
        layout.shapes,
        layout.numels,
        layout.fused,
        tolerance.stats_in_range,
    )
    for p, (s, ss, *sk) in enumerate(results.tolist()):
        j = keep[p]
        numel = numels[j]
        # what _fused_finish and _record make of it, without their array (needed only when it fails)
        if math.isfinite(s) and in_range(ss, numel) and math.isfinite(sum(sk)):
            d = {
                "dtype": "float32",
                "shape": list(shapes[j]),
                "numel": numel,
                "digest": hexes[p],
                "sum": s,
                "norm": math.sqrt(ss),
                "sketch": sk,
                "nonfinite": 0,
            }
        else:
            x = held[p].detach().numpy()
            with np.errstate(all="ignore"):
                d = _record("float32", x, *_fused_finish(x, s, ss, sk, hexes[p]))
        token = tokens[p]
        out[fused[j]] = seen.store(token, d) if token is not None else d


def _digest_batch(batch: tuple, tensors: list, out: list) -> None:
    """The small float32 tensors of one batch (`_batch`) together, the caller holding np.errstate."""
    indices, starts, starts_l, lengths, places, shapes = batch
    xs = [tensors[i].detach().contiguous().numpy().reshape(-1) for i in indices]
    buf = np.concatenate(xs)
    x64 = buf.astype(np.float64)
    sums = np.add.reduceat(x64, starts).tolist()
    sqs = np.add.reduceat(x64 * x64, starts).tolist()
    vectors = _vectors(places)
    sk = np.stack(
        [vectors[:, a : a + n] @ x64[a : a + n] for a, n in zip(starts_l, lengths)], axis=1
    ).T.tolist()  # (n, K)
    raw = memoryview(buf.view(np.uint8))
    for j, i in enumerate(indices):
        a, n = starts_l[j] * 4, lengths[j]
        s, ss = sums[j], sqs[j]
        norm = math.sqrt(ss) if math.isfinite(ss) else math.inf
        nonfinite = 0
        if not (math.isfinite(s) and math.isfinite(norm)):
            nonfinite = int((~np.isfinite(xs[j])).sum())
        sketch = sk[j]
        out[i] = {
            "dtype": "float32",
            "shape": list(shapes[j]),
            "numel": n,
            "digest": xxhash.xxh3_128_hexdigest(raw[a : a + 4 * n]),
            "sum": s if math.isfinite(s) else None,
            "norm": norm if math.isfinite(norm) else None,
            "sketch": sketch if not nonfinite and math.isfinite(sum(sketch)) else None,
            "nonfinite": nonfinite,
        }


# ---------------------------------------------------------------- bytes digested once
# A step's phases often hand over tensors an earlier phase of the step (or the step before) already handed:
# under tensor or pipeline parallelism the last micro-batch's local gradients are the reduced ones; a
# checkpoint saves the parameters and the optimizer state the optimizer phase has just recorded; clipping by
# a coefficient of 1 rewrites the reduced gradients unchanged; a frozen parameter, an unused one's zero
# gradient, one step counter per parameter repeat from step to step. Their sums, norms and sketches are a
# function of their bytes and placement only, so they need not be computed again: hashing the bytes (the
# digest's cheapest part, xxh3) proves the bytes are the ones the statistics were computed from.


class Seen:
    """The digests of the tensors digested in this step and the one before, by where their bytes live, so a
    tensor whose bytes were digested is hashed only (the section above).

    A tensor is looked up by its storage (held by a weak reference: a storage freed since, its address
    reused by a new tensor, is not a candidate), the address, dtype, shape and strides of its bytes in it,
    its placement, and its version counter, which every in-place torch op bumps: a tensor whose version
    changed is digested afresh (unless `recheck`). An unchanged version is not taken as proof (a write
    through `.data`, numpy or a backend outside the dispatcher does not bump it): the bytes are hashed, and
    the earlier statistics are reused only when the hash is the digest they were recorded with. A 0-d
    tensor is looked up by its bytes themselves. Only the per-tensor path (`digest_tensor`) is remembered;
    the small tensors digested together keep their batches as they were. Nothing of a tensor is kept but
    its record's numbers and a weak reference to its storage."""

    def __init__(self):
        self._now: dict = {}
        self._before: dict = {}
        # tensors whose statistics were reused, and those hashed in vain (same storage, other bytes)
        self.hits = self.misses = 0
        self.hit_bytes = 0  # the bytes of the reused ones (hashed, not digested)

    def next_step(self) -> None:
        """Entries live for the step they were made in and the next (a frozen tensor is reused every step)."""
        self._before, self._now = self._now, {}

    @staticmethod
    def _key(t: torch.Tensor, off, lshape):
        """(key, version, storage): a 0-d tensor's key is its bytes (no version, no storage)."""
        place = (tuple(off) if off else None, tuple(lshape) if lshape else None)
        if t.dim() == 0:
            return ("value", t.dtype, bytes(raw_bytes(t)), place), None, None
        try:
            version = t._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter: not remembered
            return None, None, None
        storage = t.untyped_storage()
        # t.shape (a torch.Size) equals and hashes as the tuple of its sizes; t.stride() is a tuple
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), place), version, storage

    def digest(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False) -> dict:
        """digest_tensor(t, off, lshape), its statistics reused where the same bytes were digested lately."""
        if t.device.type != "cpu":
            return digest_tensor(t, off, lshape)
        with np.errstate(all="ignore"):
            return self.host_digest(t.detach(), off, lshape, recheck)

    def host_digest(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False) -> dict:
        """`digest` of a local, detached host tensor, the caller holding np.errstate (digest_many)."""
        hit, token = self.lookup(t, off, lshape, recheck)
        return hit if hit is not None else self.store(token, _digest_host(t, off, lshape))

    def lookup(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False):
        """(the record of `t`'s bytes digested lately, or None; the token `store` takes to remember the
        digest made instead): a local host tensor."""
        if not t.numel():
            return None, None
        key, version, storage = self._key(t, off, lshape)
        if key is None:
            return None, None
        entry = self._now.get(key) or self._before.get(key)
        ref = None
        if entry is not None and self._same_storage(entry[1], storage):
            ref = entry[1]  # the same storage: its weak reference serves the new entry too
            if storage is None or (
                (recheck or entry[0] == version)
                and xxhash.xxh3_128_hexdigest(raw_bytes(t)) == entry[2]["digest"]
            ):
                self.hits += 1
                self.hit_bytes += t.numel() * t.element_size()
                self._now[key] = (version, entry[1], entry[2])
                return dict(entry[2]), None
            if recheck or entry[0] == version:
                self.misses += 1
        return None, (key, version, storage, ref)

    def store(self, token, d: dict) -> dict:
        """Remember digest `d` under `lookup`'s token (None: nothing to remember); what to record."""
        if token is None:
            return d
        key, version, storage, ref = token
        if ref is None and storage is not None:
            ref = StorageWeakRef(storage)
        self._now[key] = (version, ref, d)
        return dict(d)

    @staticmethod
    def _same_storage(ref, storage) -> bool:
        if ref is None or storage is None:
            return ref is None and storage is None
        # ref.expired() without its Python frame and the deprecated torch.Storage alias it goes through
        return ref.cdata == storage._cdata and not _expired(ref.cdata)


_expired = torch.UntypedStorage._expired
