"""A block of v2 trajectory steps decoded in four compiled calls: the C kernels of disttrace/native/blockdecode.c,
built at install where a compiler is there. Imported by store/trajectory_decode.py the first time a block takes it;
where the C extension is not built (or DISTTRACE_NATIVE=0) this module does not import and the pyarrow path
decodes every block (docs/format.md, "The trajectory's format").

Why. At ~150 records a step a step's cost is fixed, not per record: ~24 LZ4 frames (one per non-empty buffer,
each its own decompression context), two messages and pyarrow's per-chunk work, ~110 us a step (docs/
benchmarks.md). Here one call reads every step's two message headers, decompresses every buffer of the block
and assembles the block's columns in `SCHEMA` (offsets rebased, bitmaps joined, dictionary indices replaced
by their shapes, views copied out as strings), releasing the GIL.

What it takes. Only a block exactly as this pyarrow's writer writes it: each step a shape dictionary message
and a record batch message whose flatbuffer headers are byte for byte the writer's own but for the values
that vary (the body's length, the batch's length, its field nodes and buffer descriptors), so no flatbuffer
is interpreted here (what Arrow's verifier would accept is what the writer wrote); every buffer an LZ4 frame
with the writer's frame header (independent 64 KiB blocks, no checksums, no content size) or stored as it
is; every size, offset and index checked before it is used (C checks no bounds of its own), each block of LZ4 held
to the format's end rules, each step's declared sizes to the bounds store/trajectory_frames.py sets. Anything else,
and whatever a column holds that the writer never writes (a null where a record always has a value, a string
view longer than its inline bytes, a shape whose product comes near int64's range), declines: `decode` returns
None and the block takes the pyarrow path, which accepts it or names the step it refuses. What is returned is
validated fully by pyarrow again. `tests/test_block_decode.py` holds it to pyarrow's reading on random stores
and on mutated bytes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from disttrace.compiled import native
from disttrace.store.blocklayout import (  # noqa: F401 (_BUFFERS, _NODES, OUT: for the tests' crafting)
    _BUFFERS,
    _DICT_BUFFERS,
    _DICT_NODES,
    _FIXED,
    _FIXED_ARR,
    _N_OUT,
    _NB,
    _NN,
    _NODES,
    _O_DEV,
    _O_DTYPE_O,
    _O_DTYPE_S,
    _O_FIXED,
    _O_NUMEL,
    _O_PHASE_O,
    _O_PHASE_S,
    _O_SA_C,
    _O_SA_O,
    _O_SA_V,
    _O_SH_O,
    _O_SH_OFF,
    _O_SH_SHAPE,
    _O_SH_V,
    _O_SHAPE_O,
    _O_SHAPE_V,
    _O_SK64_C,
    _O_SK64_CV,
    _O_SK64_V,
    _O_SK_C,
    _O_SK_CV,
    _O_SK_V,
    _O_TENSOR_O,
    _O_TENSOR_S,
    DECLINED,
    LAYOUT,
    OUT,
)
from disttrace.store.trajectory import _SCHEMA_MESSAGES, SCHEMA, SCHEMA_V2, _ints
from disttrace.store.trajectory_frames import _fb_fields, _u32
from disttrace.store.trajectory_write import _OPTIONS, _columns_v2

# ---------------------------------------------------------------- the writer's headers, as templates


def _templates() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The dictionary and record batch messages' prefix and flatbuffer as this pyarrow writes them for a step
    (a one-record step written with the trajectory's options), each with a mask of the bytes that vary from
    step to step, and where those values lie: per message (its length, the body length's position, the
    batch length's, the nodes' vector's, the buffers' vector's)."""
    batch = pa.RecordBatch.from_arrays(
        _columns_v2(
            [
                {
                    "step": 1,
                    "micro_batch": 0,
                    "phase": "backward",
                    "rank": 0,
                    "index": 0,
                    "tensor": "w",
                    "dtype": "float32",
                    "shape": [2, 3],
                    "numel": 6,
                    "digest": "ab" * 16,
                    "sum": 1.0,
                    "norm": 2.0,
                    "sketch": [1.0, 2.0, 3.0, 4.0],
                    "nonfinite": 0,
                }
            ]
        ),
        schema=SCHEMA_V2,
    )
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, SCHEMA_V2, options=_OPTIONS) as w:
        w.write_batch(batch)
    data = sink.getvalue().to_pybytes()
    r = pa.BufferReader(data)
    ipc.read_message(r)  # the schema
    out_tpl, out_mask, out_pos = [], [], []
    for kind, nodes, buffers in (
        ("dictionary", _DICT_NODES, _DICT_BUFFERS),
        ("record batch", _NODES, _BUFFERS),
    ):
        at = r.tell()
        m = ipc.read_message(r)
        if m.type != kind:
            raise ImportError("the writer's step is not a dictionary and a record batch")
        fb = memoryview(m.metadata)
        size = 8 + m.metadata.size
        tpl = np.frombuffer(data, dtype=np.uint8, count=size, offset=at).copy()
        mask = np.zeros(size, dtype=np.uint8)
        root = _u32(fb, 0)
        _, _, header, body = _fb_fields(fb, root, (0, 1, 2, 3))
        h = header + _u32(fb, header)
        if kind == "dictionary":
            (data_at,) = _fb_fields(fb, h, (1,))
            h = data_at + _u32(fb, data_at)
        length, nodes_at, buffers_at = _fb_fields(fb, h, (0, 1, 2))
        nodes_at += _u32(fb, nodes_at)
        buffers_at += _u32(fb, buffers_at)
        if _u32(fb, nodes_at) != nodes or _u32(fb, buffers_at) != buffers:
            raise ImportError("the writer's step has other field nodes or buffers than SCHEMA_V2's")
        pos = [size, 8 + body, 8 + length, 8 + nodes_at + 4, 8 + buffers_at + 4]
        for p, n in ((pos[1], 8), (pos[2], 8), (pos[3], 16 * nodes), (pos[4], 16 * buffers)):
            mask[p : p + n] = 1
        out_tpl.append(tpl)
        out_mask.append(mask)
        out_pos.append(pos)
    return out_tpl[0], out_mask[0], out_tpl[1], out_mask[1], np.array(out_pos, dtype=np.int64)


_TPL_D, _MASK_D, _TPL_B, _MASK_B, _POS = _templates()
_SCHEMA_MESSAGE = _SCHEMA_MESSAGES[2]

# ---------------------------------------------------------------- the kernels


class Kernels(NamedTuple):
    """The four kernels, as _run calls them (the C module's functions, or the tests' wrappers of them)."""

    headers: Callable
    inflate: Callable
    check: Callable
    assemble: Callable


def c_kernels() -> Kernels | None:
    """The C build of the kernels, or None where it was not built, DISTTRACE_NATIVE=0, or it was built from
    another layout than this checkout's (a stale build: not used)."""
    m = native("_blockdecode")
    if m is None or getattr(m, "LAYOUT", None) != LAYOUT:
        return None
    return Kernels(m.headers, m.inflate, m.check, m.assemble)


_K = c_kernels()
if _K is None:
    raise ImportError(
        "the C block decoder is not built (or DISTTRACE_NATIVE=0): the pyarrow path decodes"
    )


# ---------------------------------------------------------------- the batch


def kernel_status(steps: list[bytes], kernels: Kernels | None = None) -> int:
    """The kernels' status for a block (0: decoded; else a key of DECLINED), for the tests."""
    return _run(steps, kernels)[0]


# per output buffer that is a validity bitmap: the step's field node whose null counts it joins
_BITMAPS = {
    **{o: k for (k, *_), (_, o) in zip(_FIXED, _O_FIXED.tolist())},
    _O_SK_V: 12,
    _O_SK_CV: 13,
    _O_SK64_V: 14,
    _O_SK64_CV: 15,
    _O_SA_V: 17,
    _O_SH_V: 20,
}
_BITMAP_OUT = np.array(list(_BITMAPS), dtype=np.int64)
_BITMAP_NODE = np.array(list(_BITMAPS.values()), dtype=np.int64) + _DICT_NODES
_PER_ROW = np.zeros(_N_OUT, dtype=np.int64)  # output bytes a record, and per total (below)
for (_, _, _, width, _), (o, _) in zip(_FIXED, _O_FIXED.tolist()):
    _PER_ROW[o] = width
_PER_ROW[[_O_NUMEL]] = 8
_PER_ROW[[_O_SK_C]] = 16
_PER_ROW[[_O_SK64_C]] = 32
_OFFSETS = [_O_PHASE_O, _O_TENSOR_O, _O_DTYPE_O, _O_SHAPE_O, _O_SA_O, _O_SH_O]
_IS_BITMAP = np.zeros(_N_OUT, dtype=np.bool_)
_IS_BITMAP[_BITMAP_OUT] = True
_IS_BITMAP[_O_DEV] = True
_IS_OFFSETS = np.zeros(_N_OUT, dtype=np.bool_)
_IS_OFFSETS[_OFFSETS] = True
# the totals _check counts: rows, tensor bytes, phase bytes, dtype bytes, shape values, samples, shard halves
_BY_TOTAL = [
    (_O_TENSOR_S, 1, 1),
    (_O_PHASE_S, 2, 1),
    (_O_DTYPE_S, 3, 1),
    (_O_SHAPE_V, 4, 8),
    (_O_SA_C, 5, 8),
    (_O_SH_OFF, 6, 8),
    (_O_SH_SHAPE, 6, 8),
]


def _pool_array(size: int) -> np.ndarray:
    """Bytes from Arrow's memory pool, which keeps the pages it frees (numpy's allocations of a block's
    megabytes would be fresh pages each time: a page fault every 4 KiB)."""
    return np.frombuffer(pa.allocate_buffer(size), dtype=np.uint8)


_local = threading.local()


def _scratch(size: int) -> np.ndarray:
    """This thread's scratch array of at least `size` bytes: the decompressed buffers are read only by the
    kernels, so each thread keeps one (warm in cache, its pages mapped) from block to block."""
    have = getattr(_local, "scratch", None)
    if have is None or have.shape[0] < size:
        have = _local.scratch = np.empty(max(size, 1 << 20), dtype=np.uint8)
    return have[:size]


def _run(steps: list[bytes], kernels: Kernels | None = None):
    """(status, arena, where, null counts, rows per step) of the kernels (the C build's unless given) for a
    block."""
    kern = kernels or _K
    n = len(steps)
    skip = len(_SCHEMA_MESSAGE)
    sizes = np.fromiter(map(len, steps), dtype=np.int64, count=n)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    for i, s in enumerate(steps):
        if (
            s[:skip] == _SCHEMA_MESSAGE
        ):  # the file's first step: its schema message, ours, byte for byte
            starts[i] += skip
    raw = np.frombuffer(b"".join(steps), dtype=np.uint8)
    bat = np.empty((n, 2), dtype=np.int64)
    node = np.empty((n, _NN, 2), dtype=np.int64)
    buf = np.empty((n, _NB, 4), dtype=np.int64)
    status, scratch_size = kern.headers(
        raw, starts, ends, sizes, _TPL_D, _MASK_D, _TPL_B, _MASK_B, _POS, bat, node, buf
    )
    if status:
        return status, None, None, None, None
    scratch = _scratch(scratch_size)
    spos = np.empty((n, _NB), dtype=np.int64)
    slen = np.empty((n, _NB), dtype=np.int64)
    status = kern.inflate(raw, buf, scratch, spos, slen)
    if status:
        return status, None, None, None, None
    rows = np.zeros(n, dtype=np.int64)
    totals = np.zeros(7, dtype=np.int64)
    s16, s32, s64 = (scratch.view(x) for x in (np.int16, np.int32, np.int64))
    status = kern.check(scratch, s16, s32, s64, bat, node, spos, slen, _FIXED_ARR, rows, totals)
    if status:
        return status, None, None, None, None
    total = int(totals[0])
    nulls = np.zeros(_N_OUT, dtype=np.int64)
    nulls[_BITMAP_OUT] = node[:, _BITMAP_NODE, 1].sum(axis=0)
    size = _PER_ROW * total
    size[_OFFSETS] = 4 * (total + 1)
    for o, k, width in _BY_TOTAL:
        size[o] = width * int(totals[k])
    size[_O_DEV] = (total + 7) >> 3
    absent = _BITMAP_OUT[nulls[_BITMAP_OUT] == 0]
    size[_BITMAP_OUT] = np.where(
        np.isin(_BITMAP_OUT, [_O_SK_CV, _O_SK64_CV]), (4 * total + 7) >> 3, (total + 7) >> 3
    )
    size[absent] = -1
    where = np.full((_N_OUT, 2), -1, dtype=np.int64)
    present = size >= 0
    padded = np.where(present, (size + 63) & ~63, 0)
    where[present, 0] = (np.cumsum(padded) - padded)[present]
    where[present, 1] = size[present]
    arena = _pool_array(int(padded.sum()))
    kern.assemble(
        scratch,
        s16,
        s32,
        s64,
        node,
        spos,
        slen,
        rows,
        _FIXED_ARR,
        _O_FIXED,
        where,
        _IS_BITMAP,
        _IS_OFFSETS,
        arena,
        arena.view(np.int32),
        arena.view(np.int64),
    )
    return 0, arena, where, nulls, rows


_STRING = pa.string()
_U32 = pa.uint32()
_I64 = pa.int64()


def decode(
    steps: list[bytes], kernels: Kernels | None = None
) -> tuple[pa.RecordBatch, np.ndarray] | None:
    """decode_steps' batch and each step's first row, from the kernels' four calls; None where they decline
    (or pyarrow's full validation of what they made refuses), for the pyarrow path to decide."""
    try:
        status, arena, where, nulls, rows = _run(steps, kernels)
    except ValueError:  # the C functions refuse what one kernel hands the next outside its buffers
        return None  # (the kernels' own checks decline first): the pyarrow path decides
    if status:
        return None
    try:
        return _batch(arena, where, nulls, rows)
    except (
        pa.ArrowException,
        ValueError,
    ):  # what pyarrow refuses of the arrays: the pyarrow path decides
        return None


def _batch(arena, where, nulls, rows) -> tuple[pa.RecordBatch, np.ndarray]:
    total = int(rows.sum())
    whole = pa.py_buffer(arena)
    spans = where.tolist()
    counts = nulls.tolist()

    def b(name: str):
        at, size = spans[OUT[name]]
        return None if at < 0 else whole.slice(at, size)

    def fixed(name: str, typ):
        return pa.Array.from_buffers(
            typ, total, [b(name + ".v"), b(name)], null_count=counts[OUT[name + ".v"]]
        )

    def string(name: str):
        return pa.Array.from_buffers(
            _STRING, total, [None, b(name + ".o"), b(name + ".s")], null_count=0
        )

    def lists(name: str, values: pa.Array, v: str, o: str):
        return pa.Array.from_buffers(
            _ints, total, [b(v), b(o)], null_count=counts[OUT[v]], children=[values]
        )

    def sketch(name: str, typ, value_type):
        child = pa.Array.from_buffers(
            value_type, 4 * total, [b(name + ".child.v"), b(name + ".child")],
            null_count=counts[OUT[name + ".child.v"]],
        )  # fmt: skip
        return pa.Array.from_buffers(
            typ, total, [b(name + ".v")], null_count=counts[OUT[name + ".v"]], children=[child]
        )

    def int64s(name: str, count: int):
        return pa.Array.from_buffers(_I64, count, [None, b(name)], null_count=0)

    shape_values = spans[OUT["shape.values"]][1] // 8
    samples_values = spans[OUT["samples.child"]][1] // 8
    shard_values = spans[OUT["shard_offset.child"]][1] // 8
    columns = [
        fixed("step", _U32),
        fixed("micro_batch", _U32),
        string("phase"),
        fixed("rank", _U32),
        fixed("index", _U32),
        string("tensor"),
        string("dtype"),
        pa.Array.from_buffers(
            _ints,
            total,
            [None, b("shape.o")],
            null_count=0,
            children=[int64s("shape.values", shape_values)],
        ),  # fmt: skip
        pa.Array.from_buffers(_I64, total, [None, b("numel")], null_count=0),
        fixed("digest", pa.binary(16)),
        pa.Array.from_buffers(pa.bool_(), total, [None, b("device_digest")], null_count=0),
        fixed("sum", pa.float64()),
        fixed("norm", pa.float64()),
        sketch("sketch", SCHEMA.field("sketch").type, pa.float32()),
        sketch("sketch64", SCHEMA.field("sketch64").type, pa.float64()),
        fixed("nonfinite", _I64),
        lists("samples", int64s("samples.child", samples_values), "samples.v", "samples.o"),
        fixed("tokens", _I64),
        lists("shard_offset", int64s("shard_offset.child", shard_values), "shard.v", "shard.o"),
        lists("shard_shape", int64s("shard_shape.child", shard_values), "shard.v", "shard.o"),
    ]
    batch = pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
    batch.validate(
        full=True
    )  # what pyarrow checks of any batch: UTF-8, offsets, sizes, null counts
    starts = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)
    return batch, starts
