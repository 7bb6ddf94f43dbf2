"""Logical tensors combined from their shards (distinct offsets, the lowest rank's copy of a replicated
shard): one tensor's records as the record path combines them (`_Logical`), and a step's on whole columns
where a tensor is sharded on either side (`_Values`, `_compare_sharded_columns`), in the record path's order."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from disttrace.analysis import columnar, tolerance
from disttrace.analysis.diff.compare import RankStep, _fold_columns, _phase_order, _unit
from disttrace.analysis.diff.tol import _same_bits, _Tol
from disttrace.store import trajectory, trajectory_read
from disttrace.store.trajectory import SKETCH_K

if TYPE_CHECKING:
    from disttrace.analysis.diff.logical import StepWarnings


class _Logical:
    """One logical tensor of one step and phase on one side: its shards (distinct offsets, lowest rank
    wins) or, for a replicated tensor, each rank's copy."""

    __slots__ = ("recs",)

    def __init__(self):
        self.recs: list[dict] = []  # in rank order

    def value(self) -> tuple[dict, int, bool]:
        """-> (a record-like dict of the logical tensor, lowest holding rank, complete)."""
        first = self.recs[0]
        if not any("shard" in r for r in self.recs):
            return first, first.get("rank", 0), True
        shards: dict[tuple, dict] = {}
        for r in self.recs:  # rank order: the lowest rank's copy of a replicated shard wins
            sh = r.get("shard") or {
                "offset": [0] * len(r.get("shape") or []),
                "logical_shape": r.get("shape"),
            }
            shards.setdefault(tuple(sh.get("offset") or ()), r)
        ordered = [shards[k] for k in sorted(shards)]
        sums = [r.get("sum") for r in ordered]
        norms = [r.get("norm") for r in ordered]
        lshape = (first.get("shard") or {}).get("logical_shape") or first.get("shape") or []
        numel = math.prod(lshape) if lshape else int(first.get("numel") or 0)
        covered = sum(int(r.get("numel") or 0) for r in ordered)
        finite = all(s is not None for s in sums) and all(n is not None for n in norms)
        v = {
            "step": first.get("step"),
            "micro_batch": first.get("micro_batch", 0),
            "phase": first.get("phase"),
            "index": first.get("index", 0),
            "tensor": first.get("logical") or first.get("tensor"),
            "logical": first.get("logical") or first.get("tensor"),
            "digest": "shards:" + ",".join(str(r.get("digest")) for r in ordered),
            "sum": math.fsum(sums) if finite else None,
            "norm": math.sqrt(math.fsum(n * n for n in norms)) if finite else None,
            "sketch": tolerance.combine_sketches([r.get("sketch") for r in ordered])
            if finite
            else None,
            "nonfinite": sum(int(r.get("nonfinite") or 0) for r in ordered),
            "dtype": first.get("dtype"),
            "shape": list(lshape),
            "numel": numel,
            "shards": len(ordered),
        }
        return v, min(r.get("rank", 0) for r in self.recs), covered == numel


# Offsets of more dimensions than this are combined by the record path (a model's tensors have 0-4).
_MAX_DIMS = 8
_PAD = np.iinfo(np.int64).min  # below every offset: a shorter offset sorts first, as tuples do


def _ragged(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1 for each i, concatenated."""
    total = int(counts.sum())
    if not total:
        return np.empty(0, dtype=np.int64)
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts - starts, counts)


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A list<int64> column as (each row's first value's position, length (0 where null), values)."""
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    return offsets[:-1], np.where(valid, np.diff(offsets), 0), values


def _padded(starts, lengths, values, zeros=None, width: int = 0) -> np.ndarray:
    """Each row's list as a row of `width` values padded with _PAD; `zeros`: lengths of rows that are zeros."""
    out = np.full((len(lengths), width), _PAD, dtype=np.int64)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    out[rows, _ragged(np.zeros(len(lengths), dtype=np.int64), lengths)] = values[
        _ragged(starts, lengths)
    ]
    if zeros is not None:
        zrows = np.repeat(np.arange(len(zeros)), zeros)
        out[zrows, _ragged(np.zeros(len(zeros), dtype=np.int64), zeros)] = 0
    return out


def _runs(
    group: np.ndarray, padded: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows ordered by (group, offset tuple, position) -> (that order, where each distinct (group, offset)
    starts in it): a run's first row is its lowest rank's."""
    n = len(group)
    keys = [np.arange(n), length, *(padded[:, j] for j in reversed(range(padded.shape[1]))), group]
    order = np.lexsort(keys)
    if not n:
        return order, order
    differ = group[order][1:] != group[order][:-1]
    differ |= length[order][1:] != length[order][:-1]
    if padded.shape[1]:
        differ |= (padded[order][1:] != padded[order][:-1]).any(axis=1)
    return order, np.flatnonzero(np.concatenate(([True], differ)))


class _Values:
    """One side's rows of a step in the cross-topology phases (rank order) and its logical tensors as arrays:
    a group per (phase, name), each group's value (`_Logical.value`) for whole-column comparison."""

    def __init__(self, x: pa.RecordBatch, key: np.ndarray):
        self.x, n = x, x.num_rows
        self.perm = perm = np.argsort(key, kind="stable")
        k = key[perm]
        self.heads = heads = (
            np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1]))) if n else np.empty(0, int)
        )
        self.keys, self.size = k[heads], np.diff(np.append(heads, n))
        self.group = np.empty(n, dtype=np.int64)
        self.group[perm] = np.repeat(np.arange(len(heads)), self.size)
        self.first = perm[heads]
        col = lambda name, dtype: np.asarray(  # noqa: E731
            x.column(name).to_numpy(zero_copy_only=False), dtype=dtype
        )
        self.rank = col("rank", np.int64)
        self.has_shard = np.asarray(
            x.column("shard_offset").is_valid().to_numpy(zero_copy_only=False), dtype=bool
        )
        self.sharded = (
            np.logical_or.reduceat(self.has_shard[perm], heads) if n else np.empty(0, bool)
        )
        self.min_rank = np.minimum.reduceat(self.rank[perm], heads) if n else self.rank
        self.digest = columnar._digests(x).view(np.uint64) if n else np.empty((0, 2), np.uint64)
        self.device = col("device_digest", bool)
        self.sum, self.norm = col("sum", np.float64), col("norm", np.float64)
        self.numel = np.asarray(x.column("numel").fill_null(0).to_numpy(), dtype=np.int64)
        self.nonfinite = np.asarray(x.column("nonfinite").fill_null(0).to_numpy(), dtype=np.int64)
        self.sketch = self._sketches()

    def _sketches(self) -> np.ndarray:
        """Each row's sketch widened to float64 (the float32 column's where both are there, as to_records
        reads it), nan where it has none."""
        out = np.full((self.x.num_rows, SKETCH_K), np.nan)
        for name in ("sketch64", "sketch"):
            vals, valid = columnar._sketch_columns(self.x, name, np.float64)
            if valid.any():
                out[valid] = vals.reshape(-1, SKETCH_K)[valid]
        return out

    def values(self) -> bool:
        """Each group's value; False where the record path must combine them (offsets of too many dimensions,
        a logical shape whose product does not fit)."""
        x, n, first = self.x, self.x.num_rows, self.first
        G = len(first)
        s_start, s_len, s_vals = _list_parts(x.column("shard_offset"))
        h_start, h_len, h_vals = _list_parts(x.column("shape"))
        in_sharded = self.sharded[self.group] if n else np.zeros(0, bool)
        width = int(max(s_len[in_sharded].max(initial=0), h_len[in_sharded].max(initial=0)))
        if width > _MAX_DIMS:
            return False
        # the shards: per sharded group its distinct offsets (a whole copy at zeros), lowest rank's first
        rows = np.flatnonzero(in_sharded)
        shard = self.has_shard[rows]
        length = np.where(shard, s_len[rows], h_len[rows])
        padded = _padded(
            s_start[rows],
            np.where(shard, s_len[rows], 0),
            s_vals,
            np.where(shard, 0, h_len[rows]),
            width,
        )
        order, runs = _runs(self.group[rows], padded, length)
        self.shards = rows[order[runs]]  # grouped, offsets in order
        sg = self.group[self.shards]
        self.shard_count = np.bincount(sg, minlength=G)
        self.shard_start = np.concatenate(([0], np.cumsum(self.shard_count)[:-1]))
        # the logical shape: the first row's logical shape, else its shape (_Logical.value)
        ss_start, ss_len, ss_vals = _list_parts(x.column("shard_shape"))
        use_ls = self.has_shard[first] & (ss_len[first] > 0)
        self.shape_src = np.where(use_ls, first + n, first)
        l_start = np.where(use_ls, ss_start[first], h_start[first])
        l_len = np.where(use_ls, ss_len[first], h_len[first])
        l_vals = np.concatenate((h_vals, ss_vals))
        l_start = np.where(use_ls, l_start + len(h_vals), l_start)
        dims = l_vals[_ragged(l_start, l_len)]
        seg = np.repeat(np.arange(G), l_len)
        prod = np.ones(G, dtype=np.int64)
        fprod = np.ones(G)
        if len(dims):
            np.multiply.at(prod, seg, dims)
            np.multiply.at(fprod, seg, dims.astype(np.float64))
        if (np.abs(fprod) >= 2.0**62).any():
            return False
        numel = np.where(l_len > 0, prod, self.numel[first])
        # each group's value: its first row's where whole, its shards' combined where sharded
        self.v_sum, self.v_norm = self.sum[first].copy(), self.norm[first].copy()
        self.v_sketch = self.sketch[first].copy()
        self.v_numel = np.where(self.sharded, numel, self.numel[first])
        self.v_nonfinite = self.nonfinite[first].copy()
        self.complete = np.ones(G, dtype=bool)
        sh = np.flatnonzero(self.sharded)
        if len(sh):
            starts, counts = self.shard_start[sh], self.shard_count[sh]
            at = self.shards[starts]
            two = self.shards[np.minimum(starts + 1, len(self.shards) - 1)]
            pair = counts == 2
            # fsum of one or two floats is their IEEE sum, but for the sign of a zero (fsum gives +0.0)
            s, nn = self.sum[at].copy(), self.norm[at] * self.norm[at]
            k = self.sketch[at].copy()
            s[pair] += self.sum[two][pair]
            nn[pair] += (self.norm[two] * self.norm[two])[pair]
            k[pair] += self.sketch[two][pair]
            for j in np.flatnonzero(counts > 2).tolist():
                rs = self.shards[starts[j] : starts[j] + counts[j]]
                s[j], nn[j] = _fsum(self.sum[rs]), _fsum(self.norm[rs] * self.norm[rs])
                k[j] = [_fsum(c) for c in self.sketch[rs].T]
            self.v_sum[sh], self.v_norm[sh] = s + 0.0, np.sqrt(nn)
            self.v_sketch[sh] = k + 0.0
            seg = np.repeat(np.arange(len(sh)), counts)
            of = self.shards[_ragged(starts, counts)]
            nonfinite, covered = np.zeros(len(sh), np.int64), np.zeros(len(sh), np.int64)
            np.add.at(nonfinite, seg, self.nonfinite[of])
            np.add.at(covered, seg, self.numel[of])
            self.v_nonfinite[sh] = nonfinite
            self.complete[sh] = covered == numel[sh]
        return True

    def same_shards(self, ga: np.ndarray, other: _Values, gb: np.ndarray) -> np.ndarray:
        """Whether sharded groups ga (here) and gb (other) have the same digest: the same shards' digests in
        offset order (the record path's "shards:..." strings equal)."""
        out = self.shard_count[ga] == other.shard_count[gb]
        pos = np.flatnonzero(out)
        if len(pos):
            counts = self.shard_count[ga[pos]]
            ra = self.shards[_ragged(self.shard_start[ga[pos]], counts)]
            rb = other.shards[_ragged(other.shard_start[gb[pos]], counts)]
            eq = (self.digest[ra] == other.digest[rb]).all(axis=1) & (
                self.device[ra] == other.device[rb]
            )
            out[pos] = np.logical_and.reduceat(eq, np.concatenate(([0], np.cumsum(counts)[:-1])))
        return out

    def value_dict(self, g: int, cache: dict) -> tuple[dict, int, bool]:
        """_Logical.value of group g, from its records (for the units the record path's `_unit` builds)."""
        got = cache.get(g)
        if got is None:
            lg = _Logical()
            rows = self.perm[self.heads[g] : self.heads[g] + self.size[g]]
            lg.recs = trajectory_read.to_records(self.x.take(pa.array(rows, pa.int64())))
            got = cache[g] = lg.value()
        return got


def _fsum(xs) -> float:
    try:
        return math.fsum(xs.tolist())
    except (ValueError, OverflowError):  # inf - inf, or an overflow: the record path names it
        return math.nan


_NEEDED = (
    "rank",
    "micro_batch",
    "index",
    "numel",
    "nonfinite",
    "digest",
    "device_digest",
    "shape",
    "tensor",
)
_ROW_COLUMNS = ("step", "micro_batch", "phase", "index", "tensor", "dtype")


def _whole_columns(x: pa.RecordBatch) -> bool:
    """Whether a side's rows have every value the whole-column path reads (else the record path)."""
    return all(x.column(c).null_count == 0 for c in _NEEDED)


def _compare_sharded_columns(
    steps: list[int], which, span: int, ka, kb, xa, xb, tol: _Tol, evs: list[StepWarnings]
):
    """The record path of logical tensors on whole columns, for the steps of a window at positions `which`,
    where a tensor is sharded on either side: each side's logical tensors combined as arrays (`_Values`), the
    units in the record path's order (step by step, by phase, then name; B's whole copies each against A's
    value, in rank order), compared per rank by `_fold_columns` (a rank's steps in one call); units without a
    counterpart or with shards that do not cover the tensor (rare) through the record path's own `_unit`.
    ka, kb: each row's logical tensor in key order (window.py's `_keys`: step position, phase order, name), a
    step position `span` keys wide. -> each position's results by rank; None: the record path decides (a value
    it alone reads)."""
    if not (_whole_columns(xa) and _whole_columns(xb)):
        return None
    A, B = _Values(xa, ka), _Values(xb, kb)
    if not (A.values() and B.values()):
        return None
    union = np.union1d(A.keys, B.keys)
    ga = np.searchsorted(A.keys, union)
    has_a = ga < len(A.keys)
    has_a[has_a] = A.keys[ga[has_a]] == union[has_a]
    gb = np.searchsorted(B.keys, union)
    has_b = gb < len(B.keys)
    has_b[has_b] = B.keys[gb[has_b]] == union[has_b]
    ga, gb = np.where(has_a, ga, -1), np.where(has_b, gb, -1)
    pos_of = union // span  # each logical tensor's step position
    # the units: B's whole copies each against A's value; else one unit a logical tensor
    copies = has_a & has_b
    copies[copies] = ~B.sharded[gb[copies]]
    count = np.where(copies, B.size[np.maximum(gb, 0)], 1)
    u_key = np.repeat(np.arange(len(union)), count)
    u_ga, u_gb, u_copy = ga[u_key], gb[u_key], copies[u_key]
    u_pos = pos_of[u_key]
    b_row = np.full(len(u_key), -1, dtype=np.int64)
    j = np.flatnonzero(u_copy)
    if len(j):
        starts = B.heads[gb[copies]]
        b_row[j] = B.perm[_ragged(starts, count[copies])]
    u_rank = np.where(
        u_copy,
        B.rank[np.maximum(b_row, 0)],
        np.where(u_gb >= 0, B.min_rank[np.maximum(u_gb, 0)], A.min_rank[np.maximum(u_ga, 0)]),
    )
    pair = (u_ga >= 0) & (u_gb >= 0)
    complete = np.ones(len(u_key), dtype=bool)
    complete[u_ga >= 0] &= A.complete[u_ga[u_ga >= 0]]
    whole_b = (u_gb >= 0) & ~u_copy
    complete[whole_b] &= B.complete[u_gb[whole_b]]
    folded = pair & complete
    # which folded units hold the same digest (the dtype and shape are the fold's to compare)
    same = np.zeros(len(u_key), dtype=bool)
    f = np.flatnonzero(folded)
    a_whole = ~A.sharded[u_ga[f]]
    cp = u_copy[f]
    w = a_whole & cp
    ra_row = A.first[u_ga[f]]
    same[f[w]] = (A.digest[ra_row[w]] == B.digest[b_row[f[w]]]).all(axis=1) & (
        A.device[ra_row[w]] == B.device[b_row[f[w]]]
    )
    s = ~a_whole & ~cp
    if s.any():
        same[f[s]] = A.same_shards(u_ga[f[s]], B, u_gb[f[s]])
    outs: dict[int, dict[int, RankStep]] = {int(j): {} for j in which}
    # each step's ranks in the order the record path meets them (units are in step order), with their counts
    at_rank = u_pos * (int(u_rank.max(initial=0)) + 1) + u_rank
    held, first_unit, n_units = np.unique(at_rank, return_index=True, return_counts=True)
    for u, c in sorted(zip(first_unit.tolist(), n_units.tolist())):
        outs[int(u_pos[u])].setdefault(int(u_rank[u]), RankStep()).total += c
    cache_a, cache_b = {}, {}

    def value_a(u):
        return A.value_dict(int(u_ga[u]), cache_a)

    def value_b(u):
        if u_copy[u]:
            rec = trajectory_read.to_records(xb.take(pa.array([int(b_row[u])], pa.int64())))[0]
            return rec, rec.get("rank", 0), True
        return B.value_dict(int(u_gb[u]), cache_b)

    _warn_columns(steps, pos_of, ga, gb, copies, A, B, evs)
    if len(f):
        # rank by rank, a rank's units step by step (each step's in unit order)
        f = f[np.lexsort((u_pos[f], u_rank[f]))]
        ranks_f, pos_f = u_rank[f], u_pos[f]
        edges = np.flatnonzero(np.concatenate(([True], ranks_f[1:] != ranks_f[:-1], [True])))
        ca, cb = _unit_batches(f, u_ga, u_gb, u_copy, b_row, u_rank, same, A, B)
        for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist()):
            units = f[lo:hi]
            rank, pos = int(ranks_f[lo]), pos_f[lo:hi]
            cut = np.flatnonzero(np.concatenate(([True], pos[1:] != pos[:-1])))
            held = pos[cut].tolist()

            def records(rows, units=units):
                return (
                    [value_a(units[r])[0] for r in rows],
                    [value_b(units[r])[0] for r in rows],
                )

            _fold_columns(
                [steps[j] for j in held],
                rank,
                columnar.Columns(ca.slice(lo, hi - lo)),
                columnar.Columns(cb.slice(lo, hi - lo)),
                cut,
                tol,
                [outs[j][rank] for j in held],
                logical=True,
                records=records,
            )
    for u in np.flatnonzero(
        ~folded
    ).tolist():  # without a counterpart, or shards that do not cover it
        va = value_a(u) if u_ga[u] >= 0 else None
        vb = value_b(u) if u_gb[u] >= 0 else None
        ra, rb = (va[0] if va else None), (vb[0] if vb else None)
        rank, step = int(u_rank[u]), steps[int(u_pos[u])]
        if ra is not None and rb is not None and _same_bits(ra, rb):
            continue
        unit = _unit(step, ra, rb, rank, tol, logical=True)
        incomplete = [s for s, v in (("a", va), ("b", vb)) if v is not None and not v[2]]
        if incomplete:
            unit.diverged, unit.note = True, f"shards incomplete in {incomplete[0]}"
        ref = rb if rb is not None else ra
        name = ref.get("logical") or ref.get("tensor")
        key = (
            ref.get("micro_batch", 0),
            _phase_order(ref["phase"]),
            ref["phase"],
            rank,
            ref.get("index", 0),
            name,
        )
        outs[int(u_pos[u])][rank].add(key, unit)
    return outs


def _unit_batches(f, u_ga, u_gb, u_copy, b_row, u_rank, same, A: _Values, B: _Values):
    """The folded units' two sides as batches of SCHEMA's columns: A's logical value, B's logical value or
    whole copy; their digests stand for whether the two are the same (`same`), the rest is the value's."""
    n = len(f)
    sides = []
    for side in (A, B):
        g = (u_ga if side is A else u_gb)[f]
        copy = u_copy[f] if side is B else np.zeros(n, dtype=bool)
        rows = np.where(copy, b_row[f], side.first[np.maximum(g, 0)])
        gg = np.maximum(g, 0)

        def pick(whole, row, copy=copy, rows=rows, gg=gg):
            if not copy.any():  # every unit the logical value (A's side, or a sharded B)
                return whole[gg]
            if copy.all():  # every unit one of B's whole copies
                return row[rows]
            return np.where(copy.reshape((-1,) + (1,) * (whole.ndim - 1)), row[rows], whole[gg])

        sketch = pick(side.v_sketch, side.sketch)
        x = side.x
        cols = {c: x.column(c).take(pa.array(rows, pa.int64())) for c in _ROW_COLUMNS}
        # the value's shape: a copy's own, else the logical shape (a shard's logical shape where the group
        # combines shards, `_Values.shape_src`: a row of the shard_shape column past the rows' count)
        shape_src = np.where(copy, rows, side.shape_src[gg])
        logical = shape_src >= x.num_rows
        at = pa.array(np.where(logical, shape_src - x.num_rows, shape_src), pa.int64())
        cols["shape"] = x.column("shape").take(at)
        if logical.any():
            cols["shape"] = pc.if_else(
                pa.array(logical), x.column("shard_shape").take(at), cols["shape"]
            )
        cols["rank"] = pa.array(u_rank[f].astype(np.uint32))
        cols["numel"] = pa.array(pick(side.v_numel, side.numel))
        digest = np.zeros((n, 16), dtype=np.uint8)
        if side is B:
            digest[~same[f], 0] = 1
        cols["digest"] = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(16), n, [None, pa.py_buffer(digest.tobytes())]
        )
        cols["device_digest"] = pa.array(np.zeros(n, dtype=bool))
        cols["sum"] = pa.array(pick(side.v_sum, side.sum))
        cols["norm"] = pa.array(pick(side.v_norm, side.norm))
        cols["sketch"] = pa.nulls(n, trajectory.SCHEMA.field("sketch").type)
        none = np.isnan(sketch).any(axis=1)
        cols["sketch64"] = pa.FixedSizeListArray.from_arrays(
            pa.array(np.where(none[:, None], 0.0, sketch).reshape(-1)),
            SKETCH_K,
            mask=pa.array(none),
        )
        cols["nonfinite"] = pa.array(pick(side.v_nonfinite, side.nonfinite))
        for c in ("samples", "tokens", "shard_offset", "shard_shape"):
            cols[c] = pa.nulls(n, trajectory.SCHEMA.field(c).type)
        sides.append(
            pa.RecordBatch.from_arrays(
                [cols[c] for c in trajectory.FIELDS], schema=trajectory.SCHEMA
            )
        )
    return sides


def _warn_columns(steps, pos_of, ga, gb, copies, A: _Values, B: _Values, evs) -> None:
    """The record path's _warn_copies for every logical tensor of the window (`pos_of`: each one's step
    position), step by step in the record path's order: each side's copies (same offset) that differ from the
    lowest rank's, where that side's copies are not compared one by one, then shards that do not cover the
    logical tensor."""
    found = []
    for side, g, label, sub in ((A, ga, "A", 0), (B, gb, "B", 1)):
        checked = g >= 0
        if side is B:
            checked &= ~copies  # B's whole copies are each compared with A's value
        groups = np.zeros(len(side.keys), dtype=bool)
        groups[g[checked]] = True
        at_key = np.full(len(side.keys), -1, dtype=np.int64)
        at_key[g[checked]] = np.flatnonzero(checked)
        for r, r0 in _copies_differing(side, groups):
            u = at_key[side.group[r]]
            found.append(((int(u), sub, r), "replica", (label, side, r, r0)))
        present = g >= 0
        incomplete = np.zeros(len(g), dtype=bool)
        incomplete[present] = ~side.complete[g[present]]
        for u in np.flatnonzero(incomplete).tolist():
            found.append(((u, 2 + sub, 0), "cover", (label, side, int(side.first[g[u]]), None)))
    for (u, _, _), kind, (label, side, r, r0) in sorted(found, key=lambda x: x[0]):
        ev = evs[int(pos_of[u])]
        if not ev.wants(kind):
            continue
        phase, name = side.x.column("phase")[r].as_py(), side.x.column("tensor")[r].as_py()
        where = f"step {steps[int(pos_of[u])]} {phase} {name}"
        if kind == "cover":
            ev.capped("cover", f"run {label}: {where}: the shards do not cover the logical shape")
        else:
            ev.capped(
                "replica",
                f"run {label}: {where}: rank {int(side.rank[r])}'s copy differs "
                f"from rank {int(side.rank[r0])}'s (replicas should be bit-identical)",
            )


def _copies_differing(side: _Values, groups: np.ndarray) -> list[tuple[int, int]]:
    """(row, its lowest rank's copy's row) in the groups marked, for copies (same shard offset, none for a
    whole tensor) whose digest, dtype or shape differ."""
    # a group whose rows all have distinct offsets as values() told them apart holds no copies (values() keys a
    # whole copy by its shape's zeros: two whole copies of a sharded tensor are counted as possible copies)
    wholes = np.bincount(side.group[~side.has_shard], minlength=len(side.keys))
    possible = np.where(side.sharded, (side.size > side.shard_count) | (wholes > 1), side.size > 1)
    groups = groups & possible
    rows = np.flatnonzero(groups[side.group]) if len(side.group) else np.empty(0, np.int64)
    if not len(rows):
        return []
    x = side.x
    s_start, s_len, s_vals = _list_parts(x.column("shard_offset"))
    width = int(s_len[rows].max(initial=0))
    padded = _padded(s_start[rows], s_len[rows], s_vals, None, width)
    order, runs = _runs(side.group[rows], padded, s_len[rows])
    run_of = np.repeat(np.arange(len(runs)), np.diff(np.append(runs, len(order))))
    ref = np.empty(len(rows), dtype=np.int64)
    ref[order] = rows[order[runs]][run_of]
    cand = np.flatnonzero(ref != rows)
    if not len(cand):
        return []
    r, r0 = rows[cand], ref[cand]
    same = (side.digest[r] == side.digest[r0]).all(axis=1) & (side.device[r] == side.device[r0])
    kept = x.select(["dtype", "shape"])  # what the comparison reads of the rows taken
    cx = columnar.Columns(kept.take(pa.array(r, pa.int64())))
    c0 = columnar.Columns(kept.take(pa.array(r0, pa.int64())))
    same &= columnar.same_dtype_and_shape(cx, c0)
    return [(int(a), int(b)) for a, b in zip(r[~same], r0[~same])]
