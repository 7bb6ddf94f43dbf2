"""A trajectory step's bytes, or a block of steps', decoded into SCHEMA's record batch (the format:
store/trajectory.py). The bytes are the store's, so untrusted: framed and bounded before decoding
(store/trajectory_frames.py), validated after (offsets, dictionary indices, the shapes' products and
dimensions, the fields every record has). A block takes the compiled decoder (store/blockdecode.py) where it
is built."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from disttrace.compiled import native
from disttrace.errors import BadInput
from disttrace.store.trajectory import _SCHEMA_MESSAGES, SCHEMA, SCHEMA_V2, _ints
from disttrace.store.trajectory_frames import (
    SHAPE_DIMS_PER_RECORD,
    SHAPE_DIMS_SLACK,
    _frame_block,
    _frame_steps,
    _step_expansion,
)

_READ = ipc.IpcReadOptions(
    use_threads=False
)  # a step is small: a thread pool's hand-off costs more than it saves


_DECODE_ERRORS = (
    pa.ArrowException,
    ValueError,
    OSError,
    EOFError,
    StopIteration,
    IndexError,
    struct.error,
)


def _refusal(path: Path, where: str, e: BaseException) -> BadInput:
    why = (str(e) or type(e).__name__).splitlines()[0][:120]
    return BadInput(path, f"{where}: not a trajectory record batch ({why})")


def decode_step(path: Path, data: bytes, where: str) -> pa.RecordBatch:
    """SCHEMA's record batch from one step's bytes: a schema message first (the file's first step) is checked
    to be one of ours and skipped, our own schema used instead; then a v2 step's shape dictionary and its
    record batch, or a v1 step's record batch, and nothing else. Anything else (a torn, edited or foreign
    message) is bad input naming the file and step."""
    try:
        return _decode_block([data])[0]
    except _DECODE_ERRORS as e:
        raise _refusal(path, where, e) from None


def decode_steps(path: Path, steps: list[tuple[bytes, str]]) -> tuple[pa.RecordBatch, np.ndarray]:
    """Several steps' bytes (each with where it lies, for a refusal) as one SCHEMA record batch, the steps'
    records one after the other, and each step's first row. Every step is checked as `decode_step` checks it
    alone (its messages, each compressed buffer's declared size, the step's total expansion, full validation,
    the shape products); the checks run over the block's arrays at once (every step's message headers read
    in one numpy pass where the block is as the writer writes it) and the block is decoded by one stream
    reader and its columns concatenated in one call, so the fixed cost of a step (a stream, a dozen pyarrow
    calls, a Python loop over its messages and buffers) is paid once a block (docs/design.md, "The trajectory's
    format"). A block that is refused is decoded step by step, so the refusal names the step at fault, and
    whatever each step alone accepts is accepted."""
    if len(steps) < 2:
        return _joined([decode_step(path, d, w) for d, w in steps])
    data = [d for d, _ in steps]
    if (kernel := _compiled()) is not None:
        decoded = kernel(data)  # None: declined, for the pyarrow path below to accept or refuse
        if decoded is not None:
            return decoded
    try:
        return _decode_block(data)
    except _DECODE_ERRORS:
        pass
    batches = [decode_step(path, d, w) for d, w in steps]  # raises, naming the step
    return _joined(batches)


# The compiled block decoder (store/blockdecode.py: the C kernels of disttrace/native/_blockdecode, built at
# install where a compiler is there) loads in about a millisecond and decodes even a block of two steps in a
# fifth of the pyarrow path's CPU (bench/block_decode.py --block 2), so every block of two steps or more takes
# it where it is built. Where it is not (or DISTTRACE_NATIVE=0) every block takes the pyarrow path, which is
# also the tests' oracle.
_kernel = (
    None  # store/blockdecode.decode, False where the C kernels are not there; None: not yet known
)


def native_decoder() -> bool:
    """Whether blocks are decoded by the C kernels, known without importing store/blockdecode.py (whose
    templates cost a few milliseconds: a diff whose steps all agree by the index decodes nothing)."""
    return _kernel is not False and native("_blockdecode") is not None


def _compiled():
    """store/blockdecode.py's decode where the C kernels are built (imported the first time it is wanted), else
    None."""
    global _kernel
    if (
        _kernel is None
    ):  # not built, DISTTRACE_NATIVE=0, or a pyarrow whose writer the templates do not know
        try:
            from disttrace.store import blockdecode
        except ImportError:
            _kernel = False
        else:
            _kernel = blockdecode.decode
    return _kernel or None


def _joined(batches: list[pa.RecordBatch]) -> tuple[pa.RecordBatch, np.ndarray]:
    counts = np.array([b.num_rows for b in batches], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    if not batches:
        return pa.RecordBatch.from_arrays(
            [pa.array([], f.type) for f in SCHEMA], schema=SCHEMA
        ), starts
    return (batches[0] if len(batches) == 1 else pa.concat_batches(batches)), starts


_SHAPE = SCHEMA_V2.get_field_index(
    "shape"
)  # the one column whose chunks (their dictionaries) stay apart


def _decode_block(steps: list[bytes]) -> tuple[pa.RecordBatch, np.ndarray]:
    """decode_steps' work (ValueError and Arrow's errors for a refusal, unattributed)."""
    framed = _frame_block(steps) if len(steps) > 1 else None
    if framed is None:  # one step, or a block not as the writer writes it: message by message
        layout, joined, declared = _frame_steps(steps)
    else:
        layout, joined, declared = framed
    # before decoding: a forged size would be allocated whole, and many honest-looking ones (an LZ4 bomb: each
    # buffer within LZ4's own expansion) would still add up to far more than a step of ours holds
    sizes = np.fromiter(map(len, steps), dtype=np.float64, count=len(steps))
    over = np.nonzero(declared > _step_expansion(sizes))[0]
    if over.size:
        j = int(over[0])
        raise ValueError(
            f"buffers that expand {len(steps[j])} bytes to {int(declared[j])}, more than a step's records do"
        )
    reader = ipc.open_stream(_SCHEMA_MESSAGES[layout] + joined, options=_READ)
    if len(steps) == 1:
        batch = reader.read_next_batch()
        batch.validate(full=True)  # offsets, views and dictionary indices inside their buffers
        columns, shapes, counts = batch.columns, [batch.column(_SHAPE)], [batch.num_rows]
    else:
        table = reader.read_all()
        table.validate(full=True)  # the same, batch by batch
        counts = [len(c) for c in table.column(0).chunks]
        if len(counts) != len(steps):
            raise ValueError(f"{len(counts)} record batches where {len(steps)} steps are")
        shapes = table.column(_SHAPE).chunks if layout == 2 else None
        # every other column's chunks concatenated in one call (each step's dictionary is handled below)
        rest = (table.remove_column(_SHAPE) if layout == 2 else table).combine_chunks()
        columns = [_one_chunk(c) for c in rest.columns]
        if layout == 2:
            columns.insert(_SHAPE, None)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    batch = (
        _from_v2(columns, shapes)
        if layout == 2
        else pa.RecordBatch.from_arrays(columns, schema=SCHEMA)
    )
    _check_required(batch)
    return batch, starts


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    if column.num_chunks == 1:
        return column.chunk(0)
    if column.num_chunks == 0:
        return pa.array([], column.type)
    return pa.concat_arrays(column.chunks)


def _from_v2(columns: list[pa.Array | None], chunks: list[pa.DictionaryArray]) -> pa.RecordBatch:
    """v2 batches (each column's steps concatenated; the shape's chunks, one a step, apart) as one SCHEMA
    batch: phase and dtype as plain strings, shape from each step's own dictionary, numel computed, the shard
    split into offset and logical shape. Each step's dictionary indices were validated against its own
    dictionary; they are then moved to where that dictionary sits in the steps' dictionaries concatenated,
    and every shape is taken in one call."""
    (
        step,
        micro_batch,
        phase,
        rank,
        index,
        tensor,
        dtype,
        _,
        digest,
        device_digest,
        sum_,
        norm,
        sketch,
        sketch64,
        nonfinite,
        samples,
        tokens,
        shard,
    ) = columns
    if len(chunks) == 1:
        shapes, indices = chunks[0].dictionary, chunks[0].indices
        base = None
    else:
        dictionaries = [c.dictionary for c in chunks]
        sizes = np.array([len(d) for d in dictionaries], dtype=np.int64)
        shapes = pa.concat_arrays(dictionaries)
        indices = pa.concat_arrays([c.indices for c in chunks])
        base = np.repeat(np.cumsum(sizes) - sizes, [len(c) for c in chunks])
    numel, known = _products(shapes)
    _check_shape_dims(shapes, indices, base, np.array([len(c) for c in chunks], dtype=np.int64))
    if indices.null_count:
        if base is not None:
            indices = pc.add(indices.cast(pa.int64()), pa.array(base))
        shapes_of_rows, numel_of_rows = shapes.take(indices), pa.array(numel).take(indices)
        numel_of_rows = pc.if_else(
            pa.array(known).take(indices), numel_of_rows, pa.scalar(None, pa.int64())
        )
    else:
        at = indices.to_numpy().astype(np.int64)
        if base is not None:
            at += base
        shapes_of_rows = shapes.take(pa.array(at))
        numel_of_rows = pa.array(numel[at], pa.int64(), mask=None if known.all() else ~known[at])
    return pa.RecordBatch.from_arrays(
        [
            step,
            micro_batch,
            phase.cast(pa.string()),
            rank,
            index,
            tensor,
            dtype.cast(pa.string()),
            shapes_of_rows,
            numel_of_rows,
            digest,
            device_digest,
            sum_,
            norm,
            sketch,
            sketch64,
            nonfinite,
            samples,
            tokens,
            *_split_shard(shard),
        ],
        schema=SCHEMA,
    )


_FEW_SHAPES = 64


def _products(shapes: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """Each shape's product (numel; 1 for a scalar) and whether it has one (not for a null shape); ValueError
    for one that overflows int64 or has a null dimension. Multiplied in int64 (which wraps, silently) beside a
    sum of log2 magnitudes (which cannot overflow): the few whose sum comes near 63 bits are recomputed
    exactly."""
    n = len(shapes)
    if n <= _FEW_SHAPES:  # a step's few distinct shapes: a loop costs less than a dozen numpy calls
        out, valid = np.ones(n, dtype=np.int64), np.ones(n, dtype=bool)
        for i, shape in enumerate(shapes.to_pylist()):
            if shape is None:
                valid[i] = False
                continue
            if None in shape:
                raise ValueError("a shape with a null dimension")
            exact = math.prod(shape)
            if not -(2**63) <= exact < 2**63:
                raise ValueError(f"a shape whose product overflows int64 ({shape[:8]})")
            out[i] = exact
        return out, valid
    offsets = shapes.offsets.to_numpy().astype(np.int64)
    lengths = offsets[1:] - offsets[:-1]
    if shapes.null_count:
        valid = np.asarray(shapes.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        lengths = np.where(valid, lengths, 0)  # a null shape's range (if any) is not read
    else:
        valid = np.ones(n, dtype=bool)
    first = int(offsets[0])
    out = np.ones(n, dtype=np.int64)
    if int(offsets[-1]) == first:
        return out, valid
    used = shapes.values.slice(first, int(offsets[-1]) - first)
    if used.null_count:
        dims = np.asarray(used.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
        owner = np.repeat(np.arange(n), offsets[1:] - offsets[:-1])
        if (~dims & valid[owner]).any():
            raise ValueError("a shape with a null dimension")
        used = used.fill_null(0)
    values = np.asarray(used.to_numpy(zero_copy_only=False), dtype=np.int64)
    full = lengths > 0
    if not full.any():
        return out, valid
    starts = offsets[:-1][full] - first
    ends = starts + lengths[full]
    if (ends[:-1] != starts[1:]).any():
        # reduceat runs each shape to the next one's start: past a null shape's range too, so cut it out
        values = values[
            np.concatenate([np.arange(a, b) for a, b in zip(starts.tolist(), ends.tolist())])
        ]
        ends = np.cumsum(lengths[full])
        starts = ends - lengths[full]
    values = values[: int(ends[-1])]  # nor may the last one run past its own end
    out[full] = np.multiply.reduceat(values, starts)
    bits = np.add.reduceat(np.log2(np.maximum(np.abs(values.astype(np.float64)), 1.0)), starts)
    for j in np.nonzero(bits > 62)[0].tolist():
        stop = starts[j + 1] if j + 1 < len(starts) else len(values)
        exact = math.prod(values[starts[j] : stop].tolist())
        if not -(2**63) <= exact < 2**63:
            dims = values[starts[j] : min(stop, starts[j] + 8)].tolist()
            raise ValueError(f"a shape whose product overflows int64 ({dims})")
        out[np.nonzero(full)[0][j]] = exact
    return out, valid


def _split_shard(arr: pa.ListArray) -> tuple[pa.Array, pa.Array]:
    """v2's shard list (offset, then logical shape) as v1's two lists, without a Python loop over rows."""
    n = len(arr)
    if arr.null_count == n:
        nulls = pa.nulls(n, _ints)
        return nulls, nulls
    offsets = np.asarray(arr.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    starts = offsets[:-1]
    lengths = np.where(valid, offsets[1:] - starts, 0)
    if (lengths % 2).any():
        raise ValueError("a shard whose offset and logical shape differ in length")
    half = lengths // 2
    out = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(half, out=out[1:])
    first = np.repeat(starts - out[:-1], half) + np.arange(
        out[-1]
    )  # each row's offset part, in the child values
    offsets_out, mask = pa.array(out, pa.int32()), pa.array(~valid)
    return (
        pa.ListArray.from_arrays(offsets_out, arr.values.take(pa.array(first)), mask=mask),
        pa.ListArray.from_arrays(
            offsets_out, arr.values.take(pa.array(first + np.repeat(half, half))), mask=mask
        ),
    )


_REQUIRED = (
    "step",
    "phase",
    "tensor",
    "digest",
    "device_digest",
)  # every record has them; readers index, key and hash them


def _check_shape_dims(shapes: pa.ListArray, indices: pa.Array, base, counts: np.ndarray) -> None:
    """ValueError when a step's records (`counts` of them a step, in order) take more dimensions in all from
    their dictionary (`shapes`; a row's entry is its index, plus `base` where the steps' dictionaries were
    concatenated) than the bound above."""
    dims = np.diff(shapes.offsets.to_numpy().astype(np.int64))
    at = (
        indices.fill_null(0).to_numpy().astype(np.int64)
        if indices.null_count
        else indices.to_numpy()
    )
    per_row = dims[at if base is None else at + base]
    if indices.null_count:
        per_row = np.where(indices.is_valid().to_numpy(zero_copy_only=False), per_row, 0)
    held = np.concatenate(([0], np.cumsum(per_row)))
    ends = np.cumsum(counts)
    total = held[ends] - held[ends - counts]
    over = np.flatnonzero(total > SHAPE_DIMS_PER_RECORD * counts + SHAPE_DIMS_SLACK)
    if len(over):
        k = int(over[0])
        raise ValueError(
            f"{int(counts[k])} records whose shapes hold {int(total[k])} dimensions in all, more than "
            f"{SHAPE_DIMS_PER_RECORD} a record (+{SHAPE_DIMS_SLACK}): a shape dictionary that expands"
            " without bound"
        )


def _check_required(batch: pa.RecordBatch) -> None:
    for name in _REQUIRED:
        if batch.column(name).null_count:
            raise ValueError(f"a record without '{name}'")
