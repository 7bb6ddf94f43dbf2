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

from disttrace.analysis import tolerance
from disttrace.compiled import optional
from disttrace.run.record.sketchplan import BLOCK, SKETCH_K, Plan, plan_for


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


_tls = threading.local()  # the float64 block buffer, per thread


def _buffer() -> np.ndarray:
    b = getattr(_tls, "buf", None)
    if b is None:
        b = _tls.buf = np.empty(BLOCK)
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


# float32 tensors of more elements than this (256 KiB) take run/record/fused.py where numba is installed: the
# dim-512 model's matrices and activations; a small model's tensors (the default manifest's are at most
# 32 Ki elements) stay with numpy and never import numba
FUSED_MIN = 1 << 16
_kernel = None  # run/record/fused.py (the module), False where numba is absent or DISTTRACE_FUSED=0
_xxh3 = None  # fused.Xxh3: xxhash's C functions for the kernel, or None (xxhash fed from Python)


def _fused():
    """run/record/fused.py, whose compiled pass takes float32 tensors of more than FUSED_MIN elements, or None:
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
    for a in range(0, flat.size, BLOCK):
        b = buf[: min(BLOCK, flat.size - a)]
        np.copyto(b, flat[a : a + b.size])
        s += float(b.sum())
        ss += float(np.dot(b, b))
    return s, ss


def _fused_stats(x: np.ndarray, plan: Plan, hasher):
    """_stats of a float32 array of more than FUSED_MIN elements in run/record/fused.py's compiled pass, hashed
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


def _table_row(plan: Plan) -> tuple:
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
    plan = plan_for(tuple(shape), off, lshape) if with_sketch and x.size else None
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
        else max(1, min(rows, tolerance.SKETCH_ROWS, BLOCK // max(cols, 1)))
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
        elif cols <= BLOCK:  # float64: one row per block (1-D tensors, long rows), a small tensor
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
            for c0 in range(0, cols, BLOCK):
                seg = row[c0 : c0 + BLOCK]
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
    instead: run/record/devdigest.py); on the CPU, xxh3 over the raw bytes. `with_sketch=False`
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
    plan = plan_for(shape, off, lshape)
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
