"""Batched device digests (run/record/devdigest.py): long rows and tensors on several devices, on CPU tensors with
`digest._digest_on_device` as the oracle (see tests/test_devdigest.py).

Long rows: a row longer than the chunk (any 1-D tensor longer than it) is split along its columns, so the
float64 and int64 working copies stay within the chunk; the results still equal the oracle's (the checksum
exactly).
Several devices: a process may hold tensors on several devices; `collect` makes one host copy per device.
CPU tensors are all on one device, so the multi-device test relabels the queued parts between two CPU
"devices"."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from test_devdigest import _check_against_oracle, _items
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from disttrace.run.faults import flip_bit
from disttrace.run.record import devdigest
from disttrace.run.record.devdigest import DeviceDigests, Fetch
from disttrace.run.record.digest import _digest_on_device


class _Largest(TorchDispatchMode):
    """The largest tensor an op allocates (an output not sharing an input's storage: views are not counted)."""

    def __init__(self):
        super().__init__()
        self.nbytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            a.untyped_storage().data_ptr()
            for a in tree_flatten((args, kwargs))[0]
            if isinstance(a, torch.Tensor)
        }
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs:
                if o.untyped_storage().nbytes() > self.nbytes:
                    self.nbytes, self.op = o.untyped_storage().nbytes(), (str(func), tuple(o.shape))
        return out


def _digests(items, chunk: int, budget: int, monkeypatch) -> list[dict]:
    """The batched digests of `items`, asserting that no working copy made while reducing them (inside
    `_reduce`, so not the snapshot) exceeds the chunk: 8 bytes an element, or the per-tensor result table
    (_F + 3 int64 per stacked tensor) where that is larger. Each tensor is digested twice, the second time measured
    (the first caches the sketch vectors, kept per shape, not a working copy), and the two agree bit for bit."""
    largest = _Largest()
    measuring = []
    reduce = DeviceDigests._reduce

    def measured(self, *args):
        if not measuring:
            return reduce(self, *args)
        with largest:
            return reduce(self, *args)

    monkeypatch.setattr(DeviceDigests, "_reduce", measured)
    dev = DeviceDigests(chunk=chunk, snapshot_bytes=budget)
    dev.add(items)
    first = dev.collect().result()
    measuring.append(True)
    dev.add(items)
    got = dev.collect().result()
    assert got == first  # fixed reductions: the same bits every time
    stacked = max(
        Counter(
            (t.dtype, tuple(t.shape), str(off), str(lshape)) for t, off, lshape in items
        ).values()
    )
    bound = 8 * max(chunk, (devdigest._F + 3) * stacked)
    assert largest.nbytes <= bound, (largest.nbytes, bound, largest.op)
    return got


def _long_rows():
    g = torch.Generator().manual_seed(11)
    nan = torch.randn(2, 500, generator=g)
    nan[1, 377] = float("nan")  # in the middle of a split row
    inf = torch.randn(700, generator=g)
    inf[650] = float("inf")
    return [
        (torch.randn(1000, generator=g), None, None),  # 1-D, many chunks long
        (torch.randn(1000, generator=g), None, None),  # the same shape: stacked with the one before
        (torch.randn(3, 300, generator=g), None, None),  # each row longer than the chunk
        (torch.randn(2, 3, 150, generator=g), None, None),
        (torch.randn(513, generator=g).double(), None, None),
        (torch.randn(777, generator=g).to(torch.bfloat16), None, None),
        (torch.randn(3, 257, generator=g).to(torch.bfloat16), None, None),
        (torch.randint(-(2**40), 2**40, (2, 300), generator=g), None, None),  # int64
        (torch.randint(0, 50000, (555,), generator=g), None, None),  # token ids
        (
            torch.randn(4, 200, generator=g),
            [4, 100],
            [16, 400],
        ),  # a shard placed in its logical tensor
        (torch.randn(300, generator=g), [50], [1000]),  # a 1-D shard
        (torch.tensor(2.5), None, None),
        (torch.randn(40, generator=g), None, None),  # within one chunk
        (nan, None, None),
        (inf, None, None),
    ]


@pytest.mark.parametrize("chunk", [64, 100, 7])
@pytest.mark.parametrize("budget", [1 << 28, 0])
def test_long_rows_are_split_and_still_agree_with_the_per_tensor_path(chunk, budget, monkeypatch):
    """Rows longer than the chunk (1-D tensors, shards with offsets, NaN and inf inside a split row, bfloat16,
    int64), stacked in snapshots or digested in place: the checksum equals the oracle's exactly, sums, norms
    and sketches to float64 rounding, and no working copy exceeds the chunk."""
    items = _long_rows()
    _check_against_oracle(_digests(items, chunk, budget, monkeypatch), items)


def test_the_earlier_shapes_agree_with_rows_of_32_and_more_columns_split(monkeypatch):
    """tests/test_devdigest.py's items at a chunk of 16 elements: its rows of 32, 40, 64 and 100 columns split
    (test_devdigest's chunk of 1 splits them all too, without the bound on the working copies)."""
    items = _items()
    _check_against_oracle(_digests(items, 16, 1 << 28, monkeypatch), items)


@pytest.mark.parametrize("shape,element", [((200,), 100), ((2, 200), 270), ((200,), 199)])
def test_a_flipped_bit_in_a_later_column_chunk_changes_the_digest(shape, element, monkeypatch):
    """Chunk 64: the flipped element is in the second column chunk of its row (a 1-D tensor's, the second row's
    of a 2-D one), or in the last, partial one."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(5))
    base = _digests([(t, None, None)], 64, 1 << 28, monkeypatch)[0]
    for bit in (0, 17, 31):
        u = t.clone()
        flip_bit(u, element, bit)
        got = _digests([(u, None, None)], 64, 1 << 28, monkeypatch)[0]
        assert got["digest"] != base["digest"], bit
        assert got["digest"] == _digest_on_device(u)["digest"], bit


def test_parts_on_two_devices_are_copied_per_device_and_their_rows_kept(monkeypatch):
    """A process holding tensors on two devices: the parts are grouped by device, one host copy each, and
    every row still gets its own tensor's digest. The queued parts alternate between torch.device("cpu") and
    torch.device("cpu", 1) (no stream: both take the CPU path), so grouping reorders them."""
    items = _items() + _long_rows()
    dev = DeviceDigests(
        chunk=64, snapshot_bytes=4096
    )  # some groups snapshotted, the rest tensor by tensor
    half = len(items) // 2
    assert dev.add(items[:half]) + dev.add(items[half:]) == list(range(len(items)))
    parts = dev._parts
    assert len(parts) >= 4 and all(device == torch.device("cpu") for device, _, _ in parts)
    other = torch.device("cpu", 1)
    dev._parts = [
        (other if i % 2 else device, rows, part) for i, (device, rows, part) in enumerate(parts)
    ]
    fetch = dev.collect()
    assert len(fetch.hosts) == 2 and fetch.events == []
    assert sorted(int(r) for order in fetch.orders for r in order) == [
        r for _, rows, _ in parts for r in rows
    ]  # every digested row once (the empty tensor has none)
    assert fetch.ready()
    _check_against_oracle(fetch.result(), items)


class _Event:
    def __init__(self, done: bool):
        self.done, self.waited = done, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1


def test_a_fetch_is_ready_when_every_devices_copy_is():
    """ready() only once every device's copy event has fired; result() waits for each of them."""
    events = [_Event(True), _Event(False)]
    fetch = Fetch([], [], [], events)
    assert not fetch.ready()
    events[1].done = True
    assert fetch.ready()
    assert fetch.result() == [] and [e.waited for e in events] == [1, 1]
