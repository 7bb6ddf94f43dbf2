"""Digests of tensors that live on an accelerator, without stalling it.

digest.py's per-tensor device path asks the device for a handful of numbers per tensor, and every
`float(...)` it takes waits for the device to finish everything queued before it: on a GPU, a synchronisation
per tensor, hundreds per step. Here a hook's tensors are digested in batches and the numbers come to the host
once per step:

1. Snapshot, on the training stream: tensors of one (dtype, shape, placement) are stacked into one buffer,
   one copy kernel per group. The copy is ordered before anything the step does next, so an optimizer that
   updates a parameter in place afterwards cannot race the digest.
2. Digest, on a side stream (CUDA) that waits for the snapshot: per group and chunk, float64 sum, sum of
   squares, non-finite count, the sketch (the same vectors as digest.py: U^T X W, batched over the group)
   and the device checksum (`digest.device_digest`: position-weighted integer sums, exact mod 2^64, so the
   chunked sums equal the one-shot checksum). Each reduction runs over fixed dimensions, so the result is
   the same bit for bit on every run (no atomics). The snapshot is handed to the side stream
   (`record_stream`), so the training stream's allocator does not reuse it before the digest has read it.
3. Collect, at the step's end: every group's results (one int64 matrix, floats carried as their bits) are
   concatenated per device and copied to pinned host memory, one copy per device (a process may hold
   tensors on several, a pipeline stage each), and an event marks each copy's end. The recorder writes the
   step when the *next* step ends (or when the run closes), by which time the events have long fired: the
   host never waits for the device mid-step.

Snapshots cost memory until the side stream has read them: at most `snapshot_bytes` a step (256 MiB by
default). Tensors beyond that budget (a large model's optimizer state) are digested on the training stream
itself, tensor by tensor, without a copy: ordered before any later update, and nothing to wait for there.

Chunks hold at most `chunk` elements: whole rows of the (rows, last axis) view, or, where one row alone is
longer (a long 1-D tensor), a slice of its columns; the sketch takes the product with the chunk's fewer rows
or columns first. So the float64 and int64 working copies stay within the chunk whatever the tensor's size
(tests/test_devdigest_split.py measures the largest). The sketch vectors, cached per shape, are not chunked:
K float64 per row and per column of the view. Off CUDA (and on the CPU, where the tests run this code,
`DISTTRACE_DEVICE_DIGESTS=1`) the same kernels run on the current stream and the copy is synchronous.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from disttrace.run.record.digest import _M1, _M2
from disttrace.run.record.sketchplan import SKETCH_K, plan_for

CHUNK = (
    1 << 22
)  # elements per digest kernel: float64 and int64 working copies, ~6 x 8 bytes each at the peak
SNAPSHOT_BYTES = 1 << 28  # snapshot memory a step may hold for the side stream
_EMPTY_DIGEST = "dev:" + "0" * 32  # digest.device_digest's value for an empty tensor
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_F = (
    2 + SKETCH_K
)  # float columns of a result row: sum, sum of squares, sketch; then h1, h2, non-finite


def forced() -> bool:
    """DISTTRACE_DEVICE_DIGESTS=1: host tensors take this path too (how the tests and a laptop exercise it)."""
    return os.environ.get("DISTTRACE_DEVICE_DIGESTS") == "1"


def wanted(t: torch.Tensor, force: bool = False) -> bool:
    """CUDA tensors (MPS has no float64; other devices keep digest_tensor's host path), or any when forced."""
    return t.device.type == "cuda" or force


@dataclass(frozen=True)
class _Row:
    dtype: str
    shape: list
    numel: int


class DeviceDigests:
    """One step's digests of device tensors: `add` queues tensors and returns their rows, `collect` starts the
    one copy to the host and returns a `Fetch` whose `result()` gives digest.digest_tensor's dicts."""

    def __init__(self, chunk: int = CHUNK, snapshot_bytes: int = SNAPSHOT_BYTES):
        self.chunk, self.snapshot_bytes = chunk, snapshot_bytes
        self._snapshotted = 0  # bytes this step
        self._rows: list[_Row] = []
        self._parts: list[tuple] = []  # (device, rows, int64 results (n, _F + 3) there)
        self._streams: dict = {}  # device -> side stream (CUDA)
        self._vectors: dict = {}  # (device, shape, offset, logical shape) -> the sketch's U and W there

    def add(self, items: list[tuple]) -> list[int]:
        """Queue (tensor, offset, logical_shape) items; returns the row of each item's digest."""
        rows, groups = [], {}
        for t, off, lshape in items:
            t = t.detach()
            if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
                t = t.to_local()
            rows.append(len(self._rows))
            self._rows.append(
                _Row(str(t.dtype).removeprefix("torch."), list(t.shape), int(t.numel()))
            )
            if t.numel():
                shape = tuple(t.shape)
                key = (
                    t.device,
                    t.dtype,
                    shape,
                    tuple(off) if off else (0,) * len(shape),
                    tuple(lshape) if lshape else shape,
                )
                groups.setdefault(key, []).append((rows[-1], t))
        for (device, _dtype, shape, off, lshape), members in groups.items():
            size = len(members) * math.prod(shape) * members[0][1].element_size()
            stream = self._side_stream(device)
            if self._snapshotted + size > self.snapshot_bytes:
                for r, t in members:  # over the budget: on the training stream, in place, no copy
                    part = self._reduce(t.reshape(1, *shape), shape, off, lshape)
                    if stream is not None:
                        part.record_stream(stream)  # collect concatenates it on the side stream
                    self._parts.append((device, [r], part))
                continue
            self._snapshotted += size
            snap = torch.stack([t for _, t in members])  # the snapshot, on the training stream
            if stream is None:
                self._parts.append(
                    (device, [r for r, _ in members], self._reduce(snap, shape, off, lshape))
                )
                continue
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                part = self._reduce(snap, shape, off, lshape)
            snap.record_stream(
                stream
            )  # not reused by the training stream before the side stream has read it
            self._parts.append((device, [r for r, _ in members], part))
        return rows

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _reduce(self, snap: torch.Tensor, shape, off, lshape) -> torch.Tensor:
        """(n, _F + 3) int64: per stacked tensor, the float results as bits, then h1, h2, non-finite."""
        n = snap.shape[0]
        rows, cols = (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)
        x3 = snap.reshape(n, rows, cols)
        ints = x3.view(_INTS[snap.element_size()])
        ut, wt = self._sketch_vectors(snap.device, shape, off, lshape)
        per = max(1, self.chunk // (rows * cols))  # tensors per chunk
        span = max(1, self.chunk // (per * cols))  # rows per chunk
        width = min(
            cols, self.chunk
        )  # columns per chunk: all of them unless one row alone exceeds the chunk
        parts = []
        for a in range(0, n, per):
            acc = None
            for r0 in range(0, rows, span):
                r1 = min(rows, r0 + span)
                for c0 in range(0, cols, width):
                    c1 = min(cols, c0 + width)
                    x = x3[a : a + per, r0:r1, c0:c1].to(torch.float64)
                    v = ints[a : a + per, r0:r1, c0:c1].to(torch.int64)
                    pos = torch.arange(
                        r0 * cols, r1 * cols, cols, dtype=torch.int64, device=snap.device
                    )[:, None] + torch.arange(
                        c0, c1, dtype=torch.int64, device=snap.device
                    )  # flat indexes
                    # (m, K): U^T X W, as digest._sketch_on_device, the product with the fewer of rows and
                    # columns first, so its (m, K, .) intermediate is at most the chunk's size
                    if r1 - r0 < c1 - c0:
                        sk = ((x @ wt[:, c0:c1].T) * ut[:, r0:r1].T).sum(1)
                    else:
                        sk = ((ut[:, r0:r1] @ x) * wt[:, c0:c1]).sum(-1)
                    part = [x.sum((1, 2)), (x * x).sum((1, 2)), *sk.unbind(1)]
                    floats = torch.stack(part, 1).view(torch.int64)
                    h1 = (v * (pos * _M1 | 1)).sum((1, 2))
                    h2 = ((v ^ (v >> 7)) * (pos * _M2 | 1)).sum((1, 2))
                    nonfinite = (~torch.isfinite(x)).sum((1, 2))
                    chunk = (floats, torch.stack([h1, h2, nonfinite], 1))
                    if acc is None:
                        acc = chunk
                    else:  # later chunks add: floats as floats, integers wrapping mod 2^64
                        acc = (
                            (acc[0].view(torch.float64) + chunk[0].view(torch.float64)).view(
                                torch.int64
                            ),
                            acc[1] + chunk[1],
                        )
            parts.append(torch.cat(acc, 1))
        return torch.cat(parts)

    def _sketch_vectors(self, device, shape, off, lshape):
        key = (device, shape, off, lshape)
        if key not in self._vectors:
            if shape:
                plan = plan_for(shape, off, lshape)
                ut, wt = plan.ut64, plan.wt64
            else:  # a scalar: every v_k is 1 (digest._stats)
                ut = wt = np.ones((SKETCH_K, 1))
            self._vectors[key] = (torch.tensor(ut, device=device), torch.tensor(wt, device=device))
            if (
                device.type == "cuda"
            ):  # once per shape: both streams may read them, so the copy must be done
                torch.cuda.synchronize(device)
        return self._vectors[key]

    def collect(self) -> Fetch:
        """Start the step's device-to-host copies, one per device; the queue is empty afterwards."""
        rows, self._rows = self._rows, []
        parts, self._parts = self._parts, []
        self._snapshotted = 0
        by_device: dict = {}
        for (
            device,
            r,
            part,
        ) in parts:  # a process may hold tensors on several devices (a pipeline stage each)
            by_device.setdefault(device, []).append((r, part))
        orders, hosts, events = [], [], []
        for device, members in by_device.items():
            orders.append(np.concatenate([np.asarray(r, dtype=np.int64) for r, _ in members]))
            stream = self._side_stream(device)
            if stream is None:
                hosts.append(torch.cat([p for _, p in members]).cpu())
                continue
            stream.wait_stream(
                torch.cuda.current_stream(device)
            )  # parts made on the training stream
            with torch.cuda.stream(stream):
                packed = torch.cat([p for _, p in members])  # this device's parts
                host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                host.copy_(packed, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            hosts.append(host)
            events.append(done)
        return Fetch(rows, orders, hosts, events)


class Fetch:
    """A step's device digests on their way to the host, one copy per device; `result()` waits for the copies
    (long done when the recorder asks, a step later) and returns one digest dict per row."""

    def __init__(
        self, rows: list[_Row], orders: list[np.ndarray], hosts: list[torch.Tensor], events: list
    ):
        # orders[i]: the rows whose results hosts[i] holds, in its order; events: the CUDA copies' ends
        self.rows, self.orders, self.hosts, self.events = rows, orders, hosts, events

    def ready(self) -> bool:
        return all(e.query() for e in self.events)

    def result(self) -> list[dict]:
        for e in self.events:
            e.synchronize()
        table = (
            np.concatenate([h.numpy() for h in self.hosts])
            if self.hosts
            else np.empty((0, _F + 3), dtype=np.int64)
        )
        order = np.concatenate(self.orders) if self.orders else np.empty(0, dtype=np.int64)
        where = np.full(len(self.rows), -1, dtype=np.int64)
        where[order] = np.arange(len(order))
        floats = table[:, :_F].view(np.float64)
        out = []
        for i, row in enumerate(self.rows):
            d = {
                "dtype": row.dtype,
                "shape": row.shape,
                "numel": row.numel,
                "digest": _EMPTY_DIGEST,
                "sum": 0.0,
                "norm": 0.0,
                "sketch": None,
                "nonfinite": 0,
            }
            j = where[i]
            if j >= 0:
                s, ss = float(floats[j, 0]), float(floats[j, 1])
                h1, h2, nonfinite = (int(v) for v in table[j, _F:])
                norm = math.sqrt(ss) if math.isfinite(ss) else math.inf
                sketch = floats[j, 2:_F].tolist()
                d.update(
                    digest=f"dev:{h1 & (2**64 - 1):016x}{h2 & (2**64 - 1):016x}",
                    sum=s if math.isfinite(s) else None,
                    norm=norm if math.isfinite(norm) else None,
                    sketch=sketch if not nonfinite and math.isfinite(sum(sketch)) else None,
                    nonfinite=nonfinite,
                )
            out.append(d)
        return out
