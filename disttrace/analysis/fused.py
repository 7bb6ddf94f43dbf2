"""The column-wise comparison of a block of steps (analysis/columnar.py's `compare` and `by_step`) as one
compiled pass over its rows (the optional `fast` extra: numba). disttrace/native/compare.c is the same four
kernels in C, with the same arguments and results, which columnar.py takes instead where it was built (it
loads in a millisecond; DISTTRACE_NATIVE=0 leaves it out). This module is imported by columnar.py only
without the C one, where numba is installed and a diff of at least columnar.FUSED_PAIRS pairs compares a
block of at least columnar.FUSED_MIN rows; without either columnar.py runs the same arithmetic in numpy (~60
array operations a block, each holding the GIL).

`nogil`: the comparing thread releases the GIL for the whole block, so the read-ahead thread (decoding the
next blocks) runs beside it on the other core.

Exactness: every value is computed by the numpy path's formula, operation by operation in the same order, in
float64 without `fastmath` (no reassociation, no fused multiply-add): the same bits as numpy's elementwise
operations. The numpy path's reductions are re-stated as loops that pick what they pick: argmax the first
maximum (the first NaN where there is one), a group's largest error the first among equals, a step's first
divergence the smallest (micro-batch, phase, index), the first row among equal keys. tests/
test_diff_fused.py holds this module and the C one to the numpy path's `diff --json` document, and
tests/test_compare_native.py the C kernels to these, output array by output array."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, types

from disttrace.analysis import tolerance

TINY = 1e-300
_U32, _U64 = tolerance.UNIT_ROUNDOFF["float32"], tolerance.UNIT_ROUNDOFF["float64"]
_SKETCH_ROWS = tolerance.SKETCH_ROWS
_STAT_CHUNK = tolerance.STAT_CHUNK
_FLOAT64_STATS = tolerance.FLOAT64_STATS


def _ro(dtype, ndim=1):
    return types.Array(dtype, ndim, "C", readonly=True)


def _rw(dtype, ndim=1):
    return types.Array(dtype, ndim, "C")


# one signature each, compiled once (cached beside this file): the columns arrive read-only where Arrow lent
# its buffers and writable where it converted them (a float column with nulls), and either is taken as
# read-only, so no block compiles another variant
_B, _I8, _F8 = types.boolean, types.int64, types.float64
_CLASSIFY = types.int64(
    _ro(types.uint8, 2),
    _ro(types.uint8, 2),
    *(_ro(_B),) * 3,
    *(_ro(_F8),) * 4,
    *(_ro(_I8),) * 3,
    _rw(types.int8),
)
_IN_SET = types.void(_ro(types.int32), _ro(types.uint8), _ro(_I8), _ro(types.uint8), _rw(_B))
_FACTORS = types.void(_ro(types.int32), _ro(types.uint8), _ro(types.uint8), _rw(_F8))
_COMPARE = types.int64(
    _ro(types.int8),
    _ro(_B),
    *(_ro(_F8),) * 4,
    *(_ro(_I8),) * 2,
    *(_ro(types.float32), _ro(_B), _ro(_F8), _ro(_B)) * 2,
    *(_ro(_I8),) * 3,
    *(_ro(types.uint32),) * 2,
    _ro(_I8),
    _B,
    _B,
    _F8,
    _F8,
    _B,
    _ro(_F8, 2),
    *(_ro(_F8),) * 2,
    _B,
    _ro(_F8),
    _ro(_B),
    *(_I8,) * 4,
    _rw(_I8, 2),
    *(_rw(_I8),) * 4,
    *(_rw(_F8),) * 2,
)


@njit(_IN_SET, boundscheck=False, nogil=True, cache=True, error_model="numpy")
def in_set(offsets, data, set_offsets, set_data, out):  # pragma: no cover - compiled
    """pyarrow.compute.is_in of a string column without nulls (offsets, data) in a set of strings (set_offsets,
    set_data: the same layout): out[row] = whether the row's string is one of them, byte for byte."""
    for r in range(out.shape[0]):
        a, b = offsets[r], offsets[r + 1]
        found = False
        for c in range(set_offsets.shape[0] - 1):
            x, y = set_offsets[c], set_offsets[c + 1]
            if y - x != b - a:
                continue
            same = True
            for i in range(b - a):
                if data[a + i] != set_data[x + i]:
                    same = False
                    break
            if same:
                found = True
                break
        out[r] = found


@njit(_FACTORS, boundscheck=False, nogil=True, cache=True, error_model="numpy")
def factors(offsets, data, suffix, out):  # pragma: no cover - compiled
    """columnar.tensor_factors of a string column without nulls: 2.0 where the name ends with `suffix` (Adam's
    second moment), else 1.0."""
    k = suffix.shape[0]
    for r in range(out.shape[0]):
        a, b = offsets[r], offsets[r + 1]
        hit = b - a >= k
        if hit:
            for i in range(k):
                if data[b - k + i] != suffix[i]:
                    hit = False
                    break
        out[r] = 2.0 if hit else 1.0


@njit(_CLASSIFY, boundscheck=False, nogil=True, cache=True, error_model="numpy")
def classify(
    da, db, dev_a, dev_b, same_type, sa, sb, na, nb, numel_a, nf_a, nf_b, kind
):  # pragma: no cover - compiled
    """Per row, into kind (int8): 0 bit-equal (digest, digest kind, dtype and shape), 1 compared here (finite
    statistics on both sides, the same dtype and shape, not empty), 2 handed to the record path. Returns how
    many rows are of kind 1."""
    n = kind.shape[0]
    m = 0
    for r in range(n):
        same = dev_a[r] == dev_b[r] and same_type[r]
        if same:
            for j in range(16):
                if da[r, j] != db[r, j]:
                    same = False
                    break
        if same:
            kind[r] = 0
            continue
        finite = (
            nf_a[r] == 0
            and nf_b[r] == 0
            and math.isfinite(sa[r])
            and math.isfinite(sb[r])
            and math.isfinite(na[r])
            and math.isfinite(nb[r])
        )
        if finite and same_type[r] and numel_a[r] > 0:
            kind[r] = 1
            m += 1
        else:
            kind[r] = 2
    return m


@njit(_COMPARE, boundscheck=False, nogil=True, cache=True, error_model="numpy")
def compare_block(
    kind,
    f32,
    sa,
    sb,
    na,
    nb,
    numel_a,
    numel_b,
    k32a,
    v32a,
    k64a,
    v64a,
    k32b,
    v32b,
    k64b,
    v64b,
    shape_off,
    shape_val,
    order,
    micro_batch,
    index,
    starts,
    bitwise,
    user,
    rtol,
    atol,
    use_table,
    table,
    factor,
    row_base,
    has_mags,
    extra,
    unbounded,
    copied_from,
    projections,
    K,
    n_orders,
    counts,
    first,
    specials,
    g_best,
    g_ratio,
    rel_out,
    bnd_out,
):  # pragma: no cover - compiled
    """columnar.compare followed by columnar.by_step over the rows of `kind` (classify's). Per step s (rows
    from starts[s]): counts[0, s] inexact rows compared here, counts[1, s] divergent ones, counts[2, s] of
    those without a relative error; first[s] the row of the smallest divergent key (-1: none). specials: the
    rows of kind 2, in order; returns how many. Per (step, phase order) cell s * n_orders + o: g_best the row
    of the largest relative error (first among equals), g_ratio that of the largest error-to-bound ratio
    (-1: no row with an error). rel_out, bnd_out: each compared row's reported error (nan: none) and bound.

    The base bound of a row: table[step, order] * factor[row] where use_table, else row_base[row]; has_mags:
    extra[row] widens the scale and unbounded[row] makes its bounds infinite (user is False then). The sketch
    projections from copied_from on are the other side's own vectors: B's taken as A's there."""
    n = kind.shape[0]
    n_steps = starts.shape[0]
    ka = np.empty(K)
    kb = np.empty(K)
    tk = np.empty(K)
    n_special = 0
    s = -1
    for r in range(n):
        while s + 1 < n_steps and starts[s + 1] <= r:
            s += 1
        kd = kind[r]
        if kd == 0:
            continue
        if kd == 2:
            specials[n_special] = r
            n_special += 1
            continue
        x_sa, x_sb, x_na, x_nb = sa[r], sb[r], na[r], nb[r]
        numel = max(max(numel_a[r], numel_b[r]), 1)
        top = max(x_na, x_nb)
        unb = False
        if has_mags:
            top = max(top, extra[r])
            unb = unbounded[r]
        scale_n = max(top, TINY)
        scale_s = max(top * np.sqrt(np.float64(numel)), TINY)
        has_sketch = projections > 0
        # the numpy path's _sketches: sketch64 where valid, else the float32 sketch widened, else none (nan)
        wa = 2 if v64a[r] else (1 if v32a[r] else 0)
        wb = 2 if v64b[r] else (1 if v32b[r] else 0)
        for j in range(K):
            if wa == 2:
                x = k64a[r * K + j]
            elif wa == 1:
                x = np.float64(k32a[r * K + j])
            else:
                x = np.nan
            if wb == 2:
                y = k64b[r * K + j]
            elif wb == 1:
                y = np.float64(k32b[r * K + j])
            else:
                y = np.nan
            if np.isnan(x) or np.isnan(y):
                has_sketch = False
            ka[j] = x
            kb[j] = y
        for j in range(copied_from, K):
            kb[j] = ka[j]
        tn = abs(x_na - x_nb) / scale_n
        ts = abs(x_sa - x_sb) / scale_s
        for j in range(K):
            tk[j] = abs(ka[j] - kb[j]) / scale_s
        if user:
            bn = (atol + rtol * scale_n) / scale_n
            bs = (atol + rtol * scale_s) / scale_s
        else:
            if use_table:
                bn = table[s, order[r]] * factor[r]
            else:
                bn = row_base[r]
            bs = bn
        is32 = f32[r]
        x_numel = numel_a[r]
        o0, o1 = shape_off[r], shape_off[r + 1]
        last = shape_val[o1 - 1] if o1 > o0 else 0
        # _sketch_rounding
        u = _U32 if is32 else _U64
        c = max(last, 1)
        rows = max(x_numel // c, 1)
        sk_r = (
            u * np.sqrt(np.float64(min(rows, _SKETCH_ROWS)))
            + _U64 * np.sqrt(np.float64(rows + c))
            + (_U32 if is32 else 0.0)
        )
        if not last > 0:
            sk_r = 0.0
        rounding = 2 * sk_r
        if unb:
            bn = np.inf
            bs = np.inf
        bk = bs + rounding
        if not bitwise and not user:
            # _stat_rounding
            nn = max(x_numel, 1)
            in32 = is32 and nn > _FLOAT64_STATS
            run = np.sqrt(np.float64(min(nn, _STAT_CHUNK)))
            norm_r = (
                0.5 * (_U32 * (run + 1) + _U64 * np.sqrt(np.float64(nn))) + _U64 if in32 else 0.0
            )
            sum_r = _U32 * run + _U64 * np.sqrt(np.float64(nn)) if in32 and last > 0 else 0.0
            bn = bn + 2 * (norm_r if bn > 0 else 0.0)
            bs = bs + 2 * (sum_r if bs > 0 else 0.0)
        over = tn > bn or ts > bs
        if has_sketch and not over:
            for j in range(K):
                if tk[j] > bk:
                    over = True
                    break
        all_equal = bn == bn and bs == bn and (not has_sketch or bk == bn)
        # argmax over the picks (norm, sum, each projection): the first maximum, the first NaN if any
        best_i = 0
        best_v = tn if all_equal else (tn / bn if bn > 0 else (np.inf if tn > 0 else 0.0))
        if not np.isnan(best_v):
            v = ts if all_equal else (ts / bs if bs > 0 else (np.inf if ts > 0 else 0.0))
            if np.isnan(v):
                best_i = 1
            else:
                if v > best_v:
                    best_i, best_v = 1, v
                for j in range(K):
                    if has_sketch:
                        t = tk[j]
                        v = t if all_equal else (t / bk if bk > 0 else (np.inf if t > 0 else 0.0))
                    else:
                        v = -np.inf
                    if np.isnan(v):
                        best_i = 2 + j
                        break
                    if v > best_v:
                        best_i, best_v = 2 + j, v
        if best_i == 0:
            rel, bnd = tn, bn
        elif best_i == 1:
            rel, bnd = ts, bs
        else:
            rel, bnd = tk[best_i - 2], bk
        if not math.isfinite(rel):
            rel = np.nan
        diverged = True if bitwise else (over or np.isnan(rel))
        rel_out[r] = rel
        bnd_out[r] = bnd
        # by_step
        counts[0, s] += 1
        if diverged:
            counts[1, s] += 1
            if np.isnan(rel):
                counts[2, s] += 1
            f = first[s]
            if f < 0:
                first[s] = r
            else:
                mb_r, mb_f = micro_batch[r], micro_batch[f]
                if mb_r < mb_f or (
                    mb_r == mb_f
                    and (order[r] < order[f] or (order[r] == order[f] and index[r] < index[f]))
                ):
                    first[s] = r
        if not np.isnan(rel):
            cell = s * n_orders + order[r]
            g = g_best[cell]
            if g < 0 or rel > rel_out[g]:
                g_best[cell] = r
            ratio = rel / bnd if bnd > 0 else -1.0
            g = g_ratio[cell]
            if g < 0:
                g_ratio[cell] = r
            else:
                bg = bnd_out[g]
                if ratio > (rel_out[g] / bg if bg > 0 else -1.0):
                    g_ratio[cell] = r
    return n_special
