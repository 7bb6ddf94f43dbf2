"""A block of steps of one rank compared and summed up per step in one pass: the compiled kernels
(disttrace.native._compare) where built, numpy's compare and by_step (analysis/columnar.py) otherwise."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import tolerance
from disttrace.analysis.columnar import (
    _SKETCH_FLOAT32,
    _SQUARED,
    TINY,
    Columns,
    StepSummary,
    _digests,
    _sketch_columns,
    by_step,
    compare,
    same_dtype_and_shape,
    tensor_factors,
)
from disttrace.compiled import native
from disttrace.store.records import PHASES
from disttrace.store.trajectory import SKETCH_K

# The compiled pass over a block (summarize) is disttrace.native._compare (C, built at install where a compiler is
# there): it loads in under a millisecond and costs less CPU than numpy's ~60 array operations at every block size,
# one row included (docs/benchmarks.md), so every diff takes it for every block with a row. Where it is not built,
# or under DISTTRACE_NATIVE=0, numpy's path (compare and by_step) does the same work: the tests' oracle.
_native_module = (
    None  # disttrace.native._compare, False where it is not built or DISTTRACE_NATIVE=0
)
# the constants the C module is compiled with (its CONSTANTS)
_CONSTANTS = (
    TINY,
    tolerance.UNIT_ROUNDOFF["float32"],
    tolerance.UNIT_ROUNDOFF["float64"],
    tolerance.SKETCH_ROWS,
    tolerance.STAT_CHUNK,
    tolerance.FLOAT64_STATS,
)


def native_kernels():
    """disttrace.native._compare, or None (not built, DISTTRACE_NATIVE=0, or compiled with other tolerance
    constants than analysis/tolerance.py's)."""
    global _native_module
    if _native_module is None:
        mod = native("_compare")
        _native_module = mod if mod is not None and mod.CONSTANTS == _CONSTANTS else False
    return _native_module or None


def summarize(
    ba: Columns,
    bb: Columns,
    starts: np.ndarray,
    *,
    bitwise: bool,
    user: tuple[float, float] | None,
    base_bound,
    magnitudes=None,
    projections: int = SKETCH_K,
    bound_table=None,
) -> StepSummary:
    """by_step(compare(...), starts): in one compiled pass over the rows (the C module's, where built), else in
    numpy. bound_table() -> table, optional: the base bound of a row at step position s and phase order o
    is table[s, o] * tensor_factors of its name, which is what base_bound returns for it (the compiled pass
    then needs no call back into Python between its rows)."""
    kw = dict(
        bitwise=bitwise,
        user=user,
        base_bound=base_bound,
        magnitudes=magnitudes,
        projections=projections,
    )
    module = native_kernels()
    if module is not None and ba.num_rows:
        try:
            got = _fused_summary(module, ba, bb, starts, bound_table=bound_table, **kw)
        except ValueError:  # the C kernels refuse indices out of range (no store we write has them)
            got = None  # numpy's path then decides, as where the pass is not compiled for a column's type
        if got is not None:
            return got
    return by_step(compare(ba, bb, **kw), starts)


_TYPED = {
    "sum": np.float64,
    "norm": np.float64,
    "numel": np.int64,
    "nonfinite": np.int64,
    "device_digest": np.bool_,
    "micro_batch": np.uint32,
    "index": np.uint32,
}


def _fused_summary(
    fused, ba, bb, starts, *, bitwise, user, base_bound, magnitudes, projections, bound_table
) -> StepSummary | None:
    """summarize's compiled pass; None where a column is not of the type the pass is compiled for (nulls in an
    integer column): the numpy path then."""
    for c in (ba, bb):
        for name, dtype in _TYPED.items():
            if c[name].dtype != dtype:
                return None
    n, n_steps, n_orders = ba.num_rows, len(starts), len(PHASES) + 1
    order = bb["phase_order"]
    same_type = same_dtype_and_shape(ba, bb)
    kind = np.empty(n, dtype=np.int8)
    fused.classify(
        _digests(ba),
        _digests(bb),
        ba["device_digest"],
        bb["device_digest"],
        same_type,
        ba["sum"],
        bb["sum"],
        ba["norm"],
        bb["norm"],
        ba["numel"],
        ba["nonfinite"],
        bb["nonfinite"],
        kind,
    )
    f32 = _float32_sketched(fused, ba.column("dtype"))
    rows = None
    has_mags = magnitudes is not None and user is None
    table = factor = row_base = extra = unbounded = _EMPTY
    use_table = user is None and bound_table is not None
    if has_mags or (user is None and bound_table is None):
        rows = np.flatnonzero(kind == 1)
        has_mags = has_mags and len(rows) > 0
        if has_mags:
            extra, unbounded = np.zeros(n), np.zeros(n, dtype=bool)
            extra[rows], unbounded[rows] = magnitudes(rows)
        if not use_table and user is None:
            row_base = np.zeros(n)
            row_base[rows] = base_bound(
                rows, order[rows], ba.column("tensor").take(pa.array(rows, pa.int64()))
            )
    if use_table:
        table = np.ascontiguousarray(bound_table(), dtype=np.float64)
        factor = _tensor_factors(fused, ba.column("tensor"))
    if not has_mags:
        extra, unbounded = _EMPTY, _EMPTY_BOOL
    shape = ba.column("shape")
    k32a, v32a = _sketch_columns(ba.batch, "sketch", np.float32)
    k64a, v64a = _sketch_columns(ba.batch, "sketch64", np.float64)
    k32b, v32b = _sketch_columns(bb.batch, "sketch", np.float32)
    k64b, v64b = _sketch_columns(bb.batch, "sketch64", np.float64)
    counts = np.zeros((3, n_steps), dtype=np.int64)
    first = np.full(n_steps, -1, dtype=np.int64)
    specials = np.empty(n, dtype=np.int64)
    g_best = np.full(n_steps * n_orders, -1, dtype=np.int64)
    g_ratio = np.full(n_steps * n_orders, -1, dtype=np.int64)
    rel, bnd = np.empty(n), np.empty(n)
    n_special = fused.compare_block(
        kind,
        f32,
        ba["sum"],
        bb["sum"],
        ba["norm"],
        bb["norm"],
        ba["numel"],
        bb["numel"],
        k32a,
        v32a,
        k64a,
        v64a,
        k32b,
        v32b,
        k64b,
        v64b,
        np.asarray(shape.offsets.to_numpy(zero_copy_only=False), dtype=np.int64),
        np.asarray(shape.values.to_numpy(zero_copy_only=False), dtype=np.int64),
        order,
        bb["micro_batch"],
        bb["index"],
        np.ascontiguousarray(starts, dtype=np.int64),
        bool(bitwise),
        user is not None,
        float(user[0]) if user is not None else 0.0,
        float(user[1]) if user is not None else 0.0,
        use_table,
        table if use_table else _EMPTY_2D,
        factor if use_table else _EMPTY,
        row_base,
        has_mags,
        extra,
        unbounded,
        # projections past the shared ones are of other vectors on each side (compare: B's taken as A's there)
        slice(projections, None).indices(SKETCH_K)[0],
        projections,
        SKETCH_K,
        n_orders,
        counts,
        first,
        specials,
        g_best,
        g_ratio,
        rel,
        bnd,
    )
    special = [[] for _ in range(n_steps)]
    if n_special:
        sp = specials[:n_special]
        for row, s in zip(sp.tolist(), (np.searchsorted(starts, sp, side="right") - 1).tolist()):
            special[s].append(row)
    groups = []
    cells = np.flatnonzero(g_best >= 0)
    if len(cells):
        j, k = g_best[cells], g_ratio[cells]
        rk, bk = rel[k], bnd[k]
        pos = bk > 0
        ratio = rk / np.where(pos, bk, 1.0)
        for cell, rj, bj, q, r_k, b_k, p in zip(
            cells.tolist(),
            rel[j].tolist(),
            bnd[j].tolist(),
            ratio.tolist(),
            rk.tolist(),
            bk.tolist(),
            pos.tolist(),
        ):
            groups.append((cell // n_orders, cell % n_orders, rj, bj, (q, r_k, b_k) if p else None))
    return StepSummary(counts[0], counts[1], counts[2], special, first, groups)


_SET_DATA = np.frombuffer("".join(tolerance.SKETCH_FLOAT32).encode(), dtype=np.uint8)
_SET_OFFSETS = np.cumsum([0] + [len(x.encode()) for x in tolerance.SKETCH_FLOAT32], dtype=np.int64)


def _float32_sketched(fused, dtype: pa.Array) -> np.ndarray:
    """compare's `f32` (the dtype is one whose sketch is computed in float32), in one compiled pass over the
    strings where the column has no nulls (pyarrow's is_in hashes each row: ~1 ms a block)."""
    parts = _string_parts(dtype)
    if parts is None:
        return np.asarray(
            pc.is_in(dtype, value_set=_SKETCH_FLOAT32).to_numpy(zero_copy_only=False), dtype=bool
        )
    out = np.empty(len(dtype), dtype=bool)
    fused.in_set(*parts, _SET_OFFSETS, _SET_DATA, out)
    return out


_SQUARED_BYTES = np.frombuffer(_SQUARED.encode(), dtype=np.uint8)


def _string_parts(arr: pa.Array):
    """A string column without nulls as (offsets, bytes), or None."""
    if arr.type != pa.string() or arr.null_count or not len(arr):
        return None
    _, off, data = arr.buffers()
    offsets = np.frombuffer(off, dtype=np.int32)[arr.offset : arr.offset + len(arr) + 1]
    return offsets, (np.frombuffer(data, dtype=np.uint8) if data is not None else _EMPTY_U8)


def _tensor_factors(fused, names: pa.Array) -> np.ndarray:
    """tensor_factors of a block's names, in one compiled pass where the column has no nulls."""
    parts = _string_parts(names)
    if parts is None:
        return np.ascontiguousarray(tensor_factors(names), dtype=np.float64)
    out = np.empty(len(names))
    fused.factors(*parts, _SQUARED_BYTES, out)
    return out


_EMPTY_U8 = np.empty(0, dtype=np.uint8)
_EMPTY, _EMPTY_BOOL, _EMPTY_2D = np.empty(0), np.empty(0, dtype=bool), np.empty((0, 0))
