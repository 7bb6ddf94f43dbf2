"""One compiled pass over a float32 tensor's blocks for the statistics of run/digest.py (the optional `fast`
extra: numba). Imported by digest.py only when numba is installed and a tensor of more than
digest.FUSED_MIN elements is digested; without it digest.py computes the same statistics with numpy, in
three calls a block.

Numpy reads each cache-sized block three more times after the hash (the runs' sums, their squares, the
sketch's GEMV), each a call whose kernel runs well below what the cache could deliver: together about three
times the hash's own time (bench/recorder_breakdown.py). This kernel reads each row of a block once for
the sums and squares and once for the GEMV while it is in L1, in one call per tensor.

Rounding: the same bounds as the numpy path (analysis/tolerance.py). The sum and the sum of squares are
taken in float32 over runs of at most STAT_CHUNK consecutive elements of a row, in whatever order the
vectoriser picks (`reassoc`: the bound of a run holds for any order of its terms), the runs' results added
in float64 (tolerance.sum_rounding, norm_rounding). The sketch's u^T X is a float32 sum over at most
`block_rows` <= SKETCH_ROWS rows per column, the blocks added in float64 (tolerance.sketch_rounding). No
`fastmath` flag that assumes finite values: a planted inf or nan reaches the sums as it would in numpy,
and digest.py then counts it. The values differ from numpy's by rounding only, and are the same run to run
on one machine (a fixed kernel, no threads)."""

from __future__ import annotations

import numpy as np
from numba import njit

from disttrace.analysis import tolerance

_RUN = tolerance.STAT_CHUNK


@njit(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, cache=True)
def block_stats(x, u, first, last, block_rows, m, acc):  # pragma: no cover - compiled
    """x: (rows, cols) float32, C-contiguous; u: (rows,) float32. For each block of block_rows rows from
    row `first` to `last`: m (cols,) float64 += u_blk^T X_blk (float32 within the block); acc[0], acc[1]
    += the rows' sum and sum of squares."""
    cols = x.shape[1]
    part = np.empty(cols, dtype=np.float32)
    s64 = 0.0
    q64 = 0.0
    rows = last
    for r0 in range(first, last, block_rows):
        for c in range(cols):
            part[c] = 0.0
        for r in range(r0, min(r0 + block_rows, rows)):
            row = x[r]
            ur = u[r]
            for c0 in range(0, cols, _RUN):
                c1 = min(c0 + _RUN, cols)
                s = np.float32(0.0)
                q = np.float32(0.0)
                for c in range(c0, c1):
                    v = row[c]
                    s += v
                    q += v * v
                s64 += s
                q64 += q
            for c in range(cols):
                part[c] += ur * row[c]
        for c in range(cols):
            m[c] += part[c]
    acc[0] += s64
    acc[1] += q64
