"""One compiled pass over a float32 tensor for the digest and statistics of run/record/digest.py (the optional
`fast` extra: numba). Imported by digest.py only when numba is installed and a tensor of more than
digest.FUSED_MIN elements is digested; without it digest.py computes the same statistics with numpy, in
three calls a block.

Numpy reads each cache-sized block three more times after the hash (the runs' sums, their squares, the
sketch's GEMV), each a call whose kernel runs well below what the cache could deliver: together about three
times the hash's own time (bench/recorder_breakdown.py). `tensor_stats` takes a whole tensor in one call:
it feeds xxh3 a few rows at a time (the C function of the xxhash package itself, `Xxh3`: the digest is the
streamed xxh3-128 of the raw bytes, so the one-shot hash's bit for bit) and reduces those rows while they
are in L1, four rows at a time, each column's sum, sum of squares and sketch term in one vector lane.

Rounding: the same bounds as the numpy path (analysis/tolerance.py). The sum and the sum of squares are
taken in float32 over groups of at most STAT_CHUNK elements (a column's elements in up to STAT_CHUNK
consecutive rows of a block), the groups' results added in float64, a block's total then added to the
tensor's (tolerance.sum_rounding, norm_rounding: the bound of a group holds for any order of its terms).
The sketch's u^T X is a float32 sum over at most `block_rows` <= SKETCH_ROWS rows per column, each column's
products added row after row (the order of numpy's GEMV and of this kernel before it: the same sketch bit
for bit), the blocks added in float64 (tolerance.sketch_rounding). No `fastmath` flag that assumes finite
values: a planted inf or nan reaches the sums as it would in numpy, and digest.py then counts it. The
values differ from numpy's by rounding only, and are the same run to run on one machine (a fixed kernel,
no threads); neither the hashing's pieces (`chunk_rows`) nor one call per block instead of one per tensor
changes a bit of them."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import xxhash
from llvmlite import ir
from numba import carray, njit, types
from numba.extending import intrinsic

from disttrace.analysis import tolerance

_RUN = tolerance.STAT_CHUNK
# the rows hashed, then reduced, at a time: about this many bytes (L1 holds 32-48 KiB a core, beside the
# kernel's five column vectors), a multiple of 4 rows
CHUNK_BYTES = 8 << 10


def chunk_rows(cols: int) -> int:
    return max(4, CHUNK_BYTES // (4 * max(cols, 1)) // 4 * 4)


@intrinsic
def _call_update(typingctx, fn, state, base, offset, size):  # pragma: no cover - compiled
    """fn(state, base + offset, size) for the C function at address `fn` with XXH3_128bits_update's
    signature. The address is an argument, not a constant of the compiled code, so the kernel is cached
    across processes as any other."""
    if not all(isinstance(a, types.Integer) for a in (fn, state, base, offset, size)):
        return None
    sig = types.int32(fn, state, base, offset, size)

    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fn_, state_, base_, offset_, size_ = (
            context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)
        )
        f = builder.inttoptr(fn_, ir.FunctionType(ir.IntType(32), [i8p, i8p, i64]).as_pointer())
        data = builder.inttoptr(builder.add(base_, offset_), i8p)
        return builder.call(f, [builder.inttoptr(state_, i8p), data, size_])

    return sig, codegen


@intrinsic
def _call_reset(typingctx, fn, state):  # pragma: no cover - compiled
    """fn(state) for the C function at address `fn` with XXH3_128bits_reset's signature."""
    if not all(isinstance(a, types.Integer) for a in (fn, state)):
        return None
    sig = types.int32(fn, state)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fn_, state_ = (
            context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)
        )
        f = builder.inttoptr(fn_, ir.FunctionType(ir.IntType(32), [i8p]).as_pointer())
        return builder.call(f, [builder.inttoptr(state_, i8p)])

    return sig, codegen


@intrinsic
def _call_digest(typingctx, fn, state):  # pragma: no cover - compiled
    """fn(state) for the C function at address `fn` with XXH3_128bits_digest's signature: its XXH128_hash_t
    (low64, high64), a struct of two 64-bit integers returned in two registers, as LLVM returns {i64, i64}
    (the probe in `Xxh3.load` checks it against xxhash's digest)."""
    if not all(isinstance(a, types.Integer) for a in (fn, state)):
        return None
    sig = types.UniTuple(types.uint64, 2)(fn, state)

    def codegen(context, builder, signature, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        fn_, state_ = (
            context.cast(builder, v, t, types.int64) for v, t in zip(args, signature.args)
        )
        pair = ir.LiteralStructType([i64, i64])
        f = builder.inttoptr(fn_, ir.FunctionType(pair, [i8p]).as_pointer())
        h = builder.call(f, [builder.inttoptr(state_, i8p)])
        parts = [builder.extract_value(h, 0), builder.extract_value(h, 1)]
        return context.make_tuple(builder, signature.return_type, parts)

    return sig, codegen


def _pointer_at(dtype, ir_type):
    @intrinsic
    def at(typingctx, address):  # pragma: no cover - compiled
        """The address as a pointer (for numba.carray)."""
        if not isinstance(address, types.Integer):
            return None
        sig = types.CPointer(dtype)(address)

        def codegen(context, builder, signature, args):
            a = context.cast(builder, args[0], signature.args[0], types.int64)
            return builder.inttoptr(a, ir.PointerType(ir_type))

        return sig, codegen

    return at


_float32_at = _pointer_at(types.float32, ir.FloatType())
_float64_at = _pointer_at(types.float64, ir.DoubleType())

# one row of many_stats' table: a tensor's shape, where its u and W lie, its blocks and hashing pieces; what
# a list of tensors of the same shapes and placements shares from step to step (digest.py keeps it)
TABLE = ("rows", "cols", "u", "w", "block_rows", "chunk")


@njit(boundscheck=False, nogil=True, cache=True)
def many_stats(
    table, xs, states, update, reset, digest, out, digests
):  # pragma: no cover - compiled
    """tensor_stats, then project, of each tensor a row of `table` (int64, columns TABLE) describes, its
    bytes at address xs[i], in one call: a hook's large tensors reduced one after the other with no Python
    between them (whose objects each tensor's bytes would otherwise evict from the caches). Row i:
    out[i] = (sum, sum of squares, the SKETCH_K sketch values) (W (K, cols) float64 at its address); its
    hash state states[i] (an address; 0: not hashed) is reset with `reset` first and, with `digest` (an
    address; 0: none), its xxh3-128 is digests[i] (uint64: the high half, then the low one, the order of
    xxhash's hexdigest). One call hands back everything a tensor's record needs, so that what follows it
    in Python is two `tolist`s, not a numpy call per column after the bytes have left the caches cold."""
    k = out.shape[1] - 2
    for i in range(table.shape[0]):
        rows, cols = table[i, 0], table[i, 1]
        x = carray(_float32_at(xs[i]), (rows, cols))
        u = carray(_float32_at(table[i, 2]), (rows,))
        w = carray(_float64_at(table[i, 3]), (k, cols))
        state = states[i]
        if state != 0:
            _call_reset(reset, state)
        m = np.zeros(cols)
        acc = out[i, :2]
        acc[0] = 0.0
        acc[1] = 0.0
        _stats(x, u, table[i, 4], table[i, 5], update if state != 0 else 0, state, m, acc)
        project(w, m, out[i, 2:])
        if state != 0 and digest != 0:
            low, high = _call_digest(digest, state)
            digests[i, 0] = high
            digests[i, 1] = low


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, cache=True)
def project(w, m, out):  # pragma: no cover - compiled
    """out[k] = W[k] . m in float64 (the sketch's K projections from u^T X)."""
    for k in range(w.shape[0]):
        t = 0.0
        for c in range(w.shape[1]):
            t += w[k, c] * m[c]
        out[k] = t


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, cache=True)
def tensor_stats(x, u, block_rows, chunk, update, state, m, acc):  # pragma: no cover - compiled
    """x: (rows, cols) float32, C-contiguous; u: (rows,) float32. For each block of block_rows rows:
    m (cols,) float64 += u_blk^T X_blk (float32 within the block); acc[0], acc[1] += the block's sum and
    sum of squares. With `update` (an address; 0: none) the bytes go through update(state, ...) on the
    way, `chunk` rows (a multiple of 4) at a time, each piece then reduced from L1 (`_stats`)."""
    _stats(x, u, block_rows, chunk, update, state, m, acc)


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, cache=True)
def _stats(x, u, block_rows, chunk, update, state, m, acc):  # pragma: no cover - compiled
    """x: (rows, cols) float32, C-contiguous; u: (rows,) float32. For each block of block_rows rows:
    m (cols,) float64 += u_blk^T X_blk (float32 within the block); acc[0], acc[1] += the block's sum and
    sum of squares. With `update` (an address; 0: none) the bytes go through update(state, ...) on the
    way, `chunk` rows (a multiple of 4) at a time, each piece then reduced from L1."""
    rows, cols = x.shape
    part = np.empty(cols, dtype=np.float32)
    s32 = np.zeros(cols, dtype=np.float32)
    q32 = np.zeros(cols, dtype=np.float32)
    base = x.ctypes.data
    row_bytes = cols * 4
    for r0 in range(0, rows, block_rows):
        r1 = min(r0 + block_rows, rows)
        for c in range(cols):
            part[c] = 0.0
        n = 0  # rows in s32, q32
        s = 0.0
        q = 0.0
        for g0 in range(r0, r1, chunk):
            g1 = min(g0 + chunk, r1)
            if update != 0:
                _call_update(update, state, base, g0 * row_bytes, (g1 - g0) * row_bytes)
            r = g0
            while r < g1:
                if r + 4 <= g1:
                    a, b, e, d = x[r], x[r + 1], x[r + 2], x[r + 3]
                    ua, ub, ue, ud = u[r], u[r + 1], u[r + 2], u[r + 3]
                    for c in range(cols):
                        va, vb, ve, vd = a[c], b[c], e[c], d[c]
                        p = part[c]
                        p += ua * va
                        p += ub * vb
                        p += ue * ve
                        p += ud * vd
                        part[c] = p
                        s32[c] += (va + vb) + (ve + vd)
                        q32[c] += (va * va + vb * vb) + (ve * ve + vd * vd)
                    r += 4
                    n += 4
                else:  # the block's last rows
                    a = x[r]
                    ua = u[r]
                    for c in range(cols):
                        va = a[c]
                        part[c] += ua * va
                        s32[c] += va
                        q32[c] += va * va
                    r += 1
                    n += 1
                if n >= _RUN or r == r1:  # groups of at most STAT_CHUNK rows: into float64
                    for c in range(cols):
                        s += s32[c]
                        q += q32[c]
                        s32[c] = 0.0
                        q32[c] = 0.0
                    n = 0
        for c in range(cols):
            m[c] += part[c]
        acc[0] += s
        acc[1] += q


class _Hash128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


class Xxh3:
    """xxh3-128's streaming functions in the xxhash package's own C library (those xxhash.xxh3_128 calls,
    its runtime-dispatched AVX2 build where it has one), for the kernel to call by address. One state per
    thread. `load()` gives None where the library does not export them or they do not give xxhash's digest
    of a test tensor: digest.py then feeds xxhash a block at a time, as before."""

    def __init__(self, lib):
        fn = getattr(lib, "XXH3_128bits_update_dispatch", None) or lib.XXH3_128bits_update
        self.update = ctypes.cast(fn, ctypes.c_void_p).value
        self._create = lib.XXH3_createState
        self._create.restype = ctypes.c_void_p
        self._create.argtypes = []
        self._reset = lib.XXH3_128bits_reset
        self._reset.argtypes = [ctypes.c_void_p]
        self.reset = ctypes.cast(self._reset, ctypes.c_void_p).value
        self._digest = lib.XXH3_128bits_digest
        self._digest.argtypes = [ctypes.c_void_p]
        self._digest.restype = _Hash128
        self.digest = ctypes.cast(self._digest, ctypes.c_void_p).value
        self._tls = threading.local()

    def state(self) -> int:
        """This thread's state, reset (its address)."""
        s = getattr(self._tls, "state", None)
        if s is None:
            s = self._create()  # kept for the thread's life: a few hundred bytes
            if not s:
                raise MemoryError("XXH3_createState")
            self._tls.state = s
        self._reset(s)
        return s

    def states(self, n: int) -> np.ndarray:
        """n states of this thread's (many_stats resets them), other than `state()`'s: their addresses as
        int64, the same ones every call of a thread (its pool only grows)."""
        pool = getattr(self._tls, "pool", None)
        if pool is None or len(pool) < n:
            pool = list(pool) if pool is not None else []
            while len(pool) < n:
                s = self._create()
                if not s:
                    raise MemoryError("XXH3_createState")
                pool.append(s)
            pool = self._tls.pool = np.array(pool, dtype=np.int64)
        return pool[:n]

    def hexdigest(self, state: int) -> str:
        """As xxhash's hexdigest: the canonical (big-endian) 128 bits, the high half first."""
        h = self._digest(state)
        return f"{h.high64:016x}{h.low64:016x}"

    @staticmethod
    def hex(high: int, low: int) -> str:
        """xxhash's hexdigest of a digest many_stats wrote (`digests[i]`)."""
        return f"{high:016x}{low:016x}"

    @classmethod
    def load(cls) -> Xxh3 | None:
        try:
            from xxhash import _xxhash

            x = cls(ctypes.CDLL(_xxhash.__file__))
        except (ImportError, OSError, AttributeError):
            return None
        g = np.random.default_rng(0)
        probes = [g.standard_normal(shape).astype(np.float32) for shape in ((97, 300), (64, 512))]
        us = [np.ones(len(p), np.float32) for p in probes]
        states = x.states(2)
        w = np.ones((4, 512))
        table = np.array(
            [(*p.shape, u.ctypes.data, w.ctypes.data, 40, 8) for p, u in zip(probes, us)],
            dtype=np.int64,
        )
        xs = np.array([p.ctypes.data for p in probes], dtype=np.int64)
        digests = np.zeros((2, 2), dtype=np.uint64)
        out = np.zeros((2, 6))
        many_stats(table, xs, states, x.update, x.reset, x.digest, out, digests)
        want = [xxhash.xxh3_128_hexdigest(p) for p in probes]
        if [x.hexdigest(st) for st in states.tolist()] != want:
            return None
        if [
            x.hex(*d) for d in digests.tolist()
        ] != want:  # the struct not returned as the kernel reads it
            x.digest = 0  # digest.py then asks each state's digest through ctypes
        return x
