"""A hook's list of tensors digested together (`digest_many`): the small float32 host tensors in batches,
the large float32 ones in one call of run/record/fused.py's compiled pass, the others one by one through
run/record/digest.py; each record the one digest_tensor gives (docs/format.md)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import xxhash

from disttrace.analysis import tolerance
from disttrace.run.record import digest as core
from disttrace.run.record.seen import Seen
from disttrace.run.record.sketchplan import SKETCH_K, Plan, plan_for

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
        plan = plan_for(shape, off, lshape)
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
    with np.errstate(all="ignore"):  # once for the list (see digest._digest_host)
        for i, on_cpu in layout.host:
            t = locals_[i].detach()
            _, off, lshape = items[i]
            if seen is not None and on_cpu:
                out[i] = seen.host_digest(t, off, lshape, recheck)
            else:
                out[i] = core._digest_host(t, off, lshape)
        for i in layout.device:
            _, off, lshape = items[i]
            out[i] = core._digest_on_device(locals_[i].detach(), off, lshape)
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
        self.plans: list[Plan] = []
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
            rows.append(core._table_row(plan))
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
    key = (core._kernel, core._xxh3, _chunk_bytes(), signature)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _Layout(signature, tensors)
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        # building it may have loaded the compiled pass (its first large tensor): kept under what it saw
        _LAYOUTS[(core._kernel, core._xxh3, _chunk_bytes(), signature)] = layout
    return layout


def _chunk_bytes() -> int:
    """The compiled pass's hashing piece (its table's `chunk` column depends on it), 0 without it."""
    return core._kernel.CHUNK_BYTES if core._kernel else 0


def _fusable(t: torch.Tensor, off, lshape) -> Plan | None:
    """The sketch's plan of a host float32 tensor that fused.many_stats takes (more than digest.FUSED_MIN
    elements, blocks of several rows; numba and xxhash's C functions at hand), else None."""
    if t.dtype is not torch.float32 or t.numel() <= core.FUSED_MIN or t.device.type != "cpu":
        return None
    if core._fused() is None or core._xxh3 is None:
        return None
    shape = tuple(t.shape)
    plan = plan_for(
        shape, tuple(off) if off else (0,) * len(shape), tuple(lshape) if lshape else shape
    )
    return plan if plan.block_rows > 1 else None


def _digest_fused(
    layout: _Layout, tensors: list, items: list, out: list, seen: Seen | None, recheck: bool
) -> None:
    """digest._digest_host of each of the layout's large float32 tensors, all in one compiled call that hands back
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
    xxh3 = core._xxh3
    states = xxh3.states(n)
    results, digests = np.empty((n, 2 + SKETCH_K)), np.zeros((n, 2), dtype=np.uint64)
    core._kernel.many_stats(
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
        # what digest's _fused_finish and _record make of it, without their array (needed only when it fails)
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
                d = core._record("float32", x, *core._fused_finish(x, s, ss, sk, hexes[p]))
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
