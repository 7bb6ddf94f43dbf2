"""The trajectory on disk: one Arrow IPC stream per rank, `trajectory/rank-NNNNN.arrows`, one record batch per
step (docs/design.md, "Run store").

Why columnar. A JSON line spent ~355 bytes on one record (field names, hex digests, floats as text), and a
reader parsed every field of every record. A column of 16-byte digests, float64 sums and norms and a
float32 sketch compresses to ~50 bytes a record (LZ4 per column buffer; step, rank, phase and index runs
cost almost nothing), and diff reads whole columns into numpy without building a dict per record.

Why one batch per step, self-contained. The step index (`rank-NNNNN.steps.jsonl`) keeps each step's byte
offset and length, the sha256 chain seals those bytes (store/seal.py), and diff seeks to one step without
reading the others. So a step's bytes must decode on their own: the one dictionary-encoded column (shape)
has its dictionary re-sent in every step's bytes, just before the step's record batch (a stream may replace
a dictionary; every Arrow reader reads it so). The first step's bytes also hold the stream's schema message;
readers decode with the schemas below, never with a schema read from the store, so a forged header cannot
change what a column means.

Two layouts on disk, one for readers. Every reader gets `SCHEMA`'s batch (analysis, diff, `to_records`).
Version 1 (the first Arrow layout, still read) is `SCHEMA` itself. Version 2 (`SCHEMA_V2`, the one
written) stores the same records in fewer bytes: at ~180 records a step each column's Arrow metadata and
LZ4 frame cost ~0.5 byte a record and a string or list column's int32 offsets ~4 (LZ4 cannot shorten an
increasing sequence), so phase and dtype are string views (names of up to 12 bytes sit inside the 16-byte
view, and equal views compress to nothing), shape is a per-step dictionary of the distinct shapes, numel
(the product of the shape, always) is not stored, and the shard's offset and logical shape share one list.
A step's layout is told by its own bytes: a v2 step starts with its dictionary message, a v1 step with its
record batch. A writer appending to a v1 stream (a job restarted into a run directory an older disttrace
wrote) keeps writing v1, so the file stays one stream.

Any Arrow reader reads the file as it is (`pyarrow.ipc.open_stream`, `polars.read_ipc_stream`, DuckDB over
the Arrow table): `disttrace show RUN records --jsonl` exports it as JSON lines. A crash mid-step leaves a
torn final message: reported and left out, as a torn JSON line is. JSON-lines trajectories
(`rank-NNNNN.jsonl`, one record a line, the format before Arrow) are still read.
"""

from __future__ import annotations

import io
import math
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from disttrace.compiled import native
from disttrace.errors import BadInput
from disttrace.store import safeio

SUFFIX = ".arrows"  # Arrow's extension for the IPC stream format
LEGACY_SUFFIX = ".jsonl"
# LZ4 frames per column buffer. Measured on 1,000-record steps (`python bench/trajectory_codec.py`): zstd
# 42 bytes a record and 0.72 ms to decode a step, LZ4 56 bytes and 0.12 ms, uncompressed 212 bytes and
# 0.04 ms; decoding is what a numeric diff of every record pays, so LZ4
COMPRESSION = "lz4"
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what the stream writer appends at close

# dtypes whose sketch is computed in float32 (run/record/digest.py) and therefore stored in float32: storing it in
# float64 would keep digits the computation never had (tolerance.sketch_rounding counts the storage rounding)
SKETCH_FLOAT32 = ("float32", "float16", "bfloat16")
SKETCH_K = 4
# the sketch's definition (run/record/digest.py): 1, K leading factors per projection (stores before 2026-12-01,
# whose step index lines have no `sketch`); 2, one leading factor shared by the K projections. Sketches of
# two versions are other projections of the tensor but the first (v_0's factors are a_{0,d} on every axis in
# both): diff compares every projection within one version, the first between 1 and 2
SKETCH_VERSION = 2


def shared_projections(a: set, b: set) -> int:
    """How many leading sketch projections two runs' records have the same vectors for, given the sets of
    sketch versions their step indexes state (None: a version not known): all within one version, the
    first between versions 1 and 2, none otherwise (and all where a side states none: it has no records)."""
    both = a | b
    if not a or not b or (len(both) == 1 and None not in both):
        return SKETCH_K
    return 1 if both <= {1, 2} else 0


# digest kinds: xxh3-128 of the raw bytes (32 hex characters), or the device checksum ("dev:" + 32 hex)
_DEVICE_PREFIX = "dev:"

_ints = pa.list_(pa.int64())
SCHEMA = pa.schema(
    [
        ("step", pa.uint32()),
        ("micro_batch", pa.uint32()),
        ("phase", pa.string()),
        ("rank", pa.uint32()),
        ("index", pa.uint32()),
        ("tensor", pa.string()),
        ("dtype", pa.string()),
        ("shape", _ints),
        ("numel", pa.int64()),
        ("digest", pa.binary(16)),
        (
            "device_digest",
            pa.bool_(),
        ),  # the digest is the device checksum (run/record/digest.py), not xxh3 of the bytes
        ("sum", pa.float64()),  # null: not finite
        ("norm", pa.float64()),
        (
            "sketch",
            pa.list_(pa.float32(), SKETCH_K),
        ),  # float32-computed sketches (SKETCH_FLOAT32 dtypes)
        ("sketch64", pa.list_(pa.float64(), SKETCH_K)),  # float64 and integer tensors' sketches
        ("nonfinite", pa.int64()),
        ("samples", _ints),  # data phase: the batch's sample ids
        ("tokens", pa.int64()),  # loss phase: the tokens the loss is a mean over
        (
            "shard_offset",
            _ints,
        ),  # a DTensor shard: where this rank's piece sits in the logical tensor
        ("shard_shape", _ints),
    ]
)
FIELDS = tuple(SCHEMA.names)

# what is written now (docstring, "Two layouts"); bench/trajectory_columns.py measures what each column costs
_SHAPE_INDEX = (
    pa.int16()
)  # distinct shapes in one step: 32,767 at most (a model's tensors share a few dozen)
SCHEMA_V2 = pa.schema(
    [
        ("step", pa.uint32()),
        ("micro_batch", pa.uint32()),
        ("phase", pa.string_view()),
        ("rank", pa.uint32()),
        ("index", pa.uint32()),
        (
            "tensor",
            pa.string(),
        ),  # mostly longer than a view's 12 inline bytes: a view would cost 16 bytes a row
        ("dtype", pa.string_view()),
        ("shape", pa.dictionary(_SHAPE_INDEX, _ints)),  # numel is the product of the shape
        ("digest", pa.binary(16)),
        ("device_digest", pa.bool_()),
        ("sum", pa.float64()),
        ("norm", pa.float64()),
        ("sketch", pa.list_(pa.float32(), SKETCH_K)),
        ("sketch64", pa.list_(pa.float64(), SKETCH_K)),
        ("nonfinite", pa.int64()),
        ("samples", _ints),
        ("tokens", pa.int64()),
        ("shard", _ints),  # a DTensor shard: its offset, then the logical shape (as many of each)
    ]
)
_SCHEMAS = {1: SCHEMA, 2: SCHEMA_V2}
VERSION = 2  # what a new stream is written in


# ---------------------------------------------------------------- writing


class _Chunks(io.RawIOBase):
    """The stream writer's sink: collects what one write_batch emits, so the recorder gets the step's exact
    bytes (to hash and seal) before they reach the file."""

    def __init__(self):
        self.chunks: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.chunks.append(bytes(b))
        return len(b)

    def take(self) -> bytes:
        out = b"".join(self.chunks)
        self.chunks.clear()
        return out


def _messages_end(data: bytes, n: int) -> int:
    r = pa.BufferReader(data)
    for _ in range(n):
        ipc.read_message(r)
    return r.tell()


_OPTIONS = ipc.IpcWriteOptions(compression=COMPRESSION, use_threads=False)
_READ = ipc.IpcReadOptions(
    use_threads=False
)  # a step is small: a thread pool's hand-off costs more than it saves
_SCHEMA_MESSAGES = {v: schema.serialize().to_pybytes() for v, schema in _SCHEMAS.items()}


def _fields(records: list[dict]) -> dict[str, list]:
    """The records of one step as one list per field (the recorder's dicts, TrajectoryRecord's shape); a
    column at a time (a comprehension per field), the recorder's hot path."""
    extra = set().union(*records) - _KNOWN
    if extra:
        raise ValueError(f"trajectory record with fields the schema does not hold: {sorted(extra)}")
    cols = {k: [r.get(k) for r in records] for k in _PLAIN}
    digests = [r["digest"] for r in records]
    dev = [d.startswith(_DEVICE_PREFIX) for d in digests]
    cols["digest"] = [
        bytes.fromhex(d[len(_DEVICE_PREFIX) :] if v else d) for d, v in zip(digests, dev)
    ]
    cols["device_digest"] = dev
    in32 = [d in SKETCH_FLOAT32 for d in cols["dtype"]]
    sketches = [r.get("sketch") for r in records]
    cols["sketch"] = [k if f else None for k, f in zip(sketches, in32)]
    cols["sketch64"] = [None if f else k for k, f in zip(sketches, in32)]
    cols["shard"] = [r.get("shard") for r in records]
    return cols


def _columns(records: list[dict]) -> list[pa.Array]:
    """The records of one step as SCHEMA's columns (version 1, and what readers get)."""
    cols = _fields(records)
    shards = cols["shard"]
    cols["shard_offset"] = [x["offset"] if x else None for x in shards]
    cols["shard_shape"] = [x["logical_shape"] if x else None for x in shards]
    return [pa.array(cols[f.name], f.type) for f in SCHEMA]


def _view(values: list) -> pa.Array:
    """A string-view column without the empty data buffer pyarrow adds when every string is inline: Polars
    (2.1) cannot read an empty LZ4-compressed buffer there, and it would cost a buffer's metadata anyway."""
    a = pa.array(values, pa.string_view())
    bufs = a.buffers()
    if len(bufs) > 2 and all(b is None or b.size == 0 for b in bufs[2:]):
        a = pa.Array.from_buffers(pa.string_view(), len(a), bufs[:2], null_count=a.null_count)
    return a


def _columns_v2(records: list[dict]) -> list[pa.Array]:
    """The records of one step as SCHEMA_V2's columns."""
    cols = _fields(records)
    distinct: dict = {}
    keys = []
    for s, n in zip(cols["shape"], cols["numel"]):
        if s is None or n != math.prod(
            s
        ):  # not stored: readers compute it, so it must be the product
            raise ValueError(
                f"a trajectory record whose numel {n} is not the product of its shape {s}"
            )
        keys.append(distinct.setdefault(tuple(s), len(distinct)))
    if len(distinct) > 2**15 - 1:
        raise ValueError(
            f"{len(distinct)} distinct tensor shapes in one step: the trajectory holds 32,767"
        )
    cols["shape"] = pa.DictionaryArray.from_arrays(
        pa.array(keys, _SHAPE_INDEX), pa.array([list(k) for k in distinct], _ints)
    )
    cols["shard"] = [
        None if x is None else list(x["offset"]) + list(x["logical_shape"]) for x in cols["shard"]
    ]
    out = []
    for f in SCHEMA_V2:
        v = cols[f.name]
        out.append(
            v
            if isinstance(v, pa.Array)
            else _view(v)
            if f.type == pa.string_view()
            else pa.array(v, f.type)
        )
    return out


_PLAIN = (
    "step",
    "micro_batch",
    "phase",
    "rank",
    "index",
    "tensor",
    "dtype",
    "shape",
    "numel",
    "sum",
    "norm",
    "nonfinite",
    "samples",
    "tokens",
)
_KNOWN = frozenset(_PLAIN) | {"digest", "sketch", "shard"}
_ENCODE = {1: _columns, 2: _columns_v2}


def _file_version(path: Path) -> int:
    """The layout of an existing stream (its schema message, first in the file); VERSION for a new one."""
    try:
        with open(path, "rb") as f:
            message = ipc.read_message(pa.PythonFile(f, mode="r"))
        if (
            message is not None
            and message.type == "schema"
            and ipc.read_schema(message).equals(SCHEMA)
        ):
            return 1
    except (pa.ArrowException, OSError, ValueError, EOFError):
        pass
    return VERSION


class TrajectoryWriter:
    """Appends one rank's steps to its Arrow stream; each step is written and flushed whole, so a crash loses
    at most the step being written (a torn final message, which readers report and leave out)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._sink = _Chunks()
        # appending to an existing stream (a job restarted into its run directory): its schema is there already,
        # and its layout is kept (an older disttrace's v1 stream stays v1: one file, one schema)
        self._with_schema = self._f.tell() == 0
        self.version = VERSION if self._with_schema else _file_version(self.path)
        self._encode = _ENCODE[self.version]
        self._schema = _SCHEMAS[self.version]
        self._written = False

    @property
    def offset(self) -> int:
        return self._f.tell()

    def write_step(self, records: list[dict]) -> bytes:
        """Write one step's records (already in the order of docs/design.md) as one record batch (v2: after
        its shape dictionary); returns the bytes written, which the step index hashes and chains."""
        return self.write_batch(self.encode(records))

    def encode(self, records: list[dict]) -> pa.RecordBatch:
        """One step's records as the record batch this stream's layout stores (what write_step writes)."""
        return pa.RecordBatch.from_arrays(self._encode(records), schema=self._schema)

    def write_batch(self, batch: pa.RecordBatch) -> bytes:
        """write_step for a step already in columns, in this stream's layout (a synthetic store builds its
        steps from arrays; the recorder hands records). The checks `encode` makes of each record (numel the
        product of the shape, the shapes' count) are the caller's; the readers hold every step to them."""
        if not batch.schema.equals(self._schema):
            raise ValueError("a record batch not in this trajectory's layout")
        # a stream of its own for each step: a writer re-sends a dictionary only when it changed, and each
        # step's bytes must hold theirs. Its schema message is kept for the file's first step only
        writer = ipc.new_stream(pa.PythonFile(self._sink, mode="w"), self._schema, options=_OPTIONS)
        writer.write_batch(batch)
        data = self._sink.take()
        writer.close()
        self._sink.take()  # its end-of-stream marker: close() writes the file's own
        if not self._with_schema:
            data = data[_messages_end(data, 1) :]
        self._with_schema = False
        self._f.write(data)
        self._f.flush()
        self._written = True
        return data

    def close(self) -> None:
        if self._f.closed:
            return
        if self._written:
            self._f.write(END_OF_STREAM)  # outside every step's range, sealed with the file
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


# ---------------------------------------------------------------- reading


def trajectory_path(run_path: Path, rank: int) -> Path:
    """This rank's trajectory: the Arrow stream, or a JSON-lines file of a store written before it."""
    base = Path(run_path) / "trajectory" / f"rank-{rank:05d}"
    arrow = base.with_name(base.name + SUFFIX)
    if safeio.present(arrow):  # whatever is there (a FIFO, a link): the reader refuses it, named
        return arrow
    legacy = base.with_name(base.name + LEGACY_SUFFIX)
    return legacy if safeio.present(legacy) else arrow


def is_arrow(path: Path) -> bool:
    return Path(path).suffix == SUFFIX


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


_STEP_MESSAGES = {1: ["record batch"], 2: ["dictionary", "record batch"]}
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


def _frame_steps(steps: list[bytes]) -> tuple[int, bytes, np.ndarray]:
    """Each step's messages read one by one: the layout, the steps' messages after any schema message joined
    (what the stream reader decodes), and per step the bytes its buffers declare they decompress to. A
    schema message (the file's first step) is checked to be one of ours; a step's messages must be its
    layout's; the headers' sizes are read and bounded (_message_buffers)."""
    layout = None
    parts: list[bytes] = []  # each step's messages after any schema message, joined below
    plain = np.zeros(len(steps))  # per step: bytes of the buffers stored uncompressed
    buffers = []  # per message with LZ4 buffers: (step, where its body starts in the joined bytes, its
    # length, its buffers' (offset, length) pairs)
    at = 0  # where the step's part starts in the joined bytes
    for i, data in enumerate(steps):
        reader = pa.BufferReader(data)
        messages, version, body, end = [], None, 0, 0
        while reader.tell() < len(data):
            if data[reader.tell() : reader.tell() + len(END_OF_STREAM)] == END_OF_STREAM:
                break
            m = ipc.read_message(reader)
            if m is None:
                break
            end = reader.tell()
            if m.type == "schema" and version is None and not messages:
                version, body = _check_schema(m), end
                continue
            messages.append((m, end))
        kinds = [m.type for m, _ in messages]
        step_layout = 2 if kinds[:1] == ["dictionary"] else 1  # told by the step's own bytes
        expected = _STEP_MESSAGES[step_layout]
        if kinds != expected or version not in (None, step_layout):
            raise ValueError(f"messages {kinds} where a step's {expected} belong")
        if layout is None:
            layout = step_layout
        elif step_layout != layout:
            raise ValueError("steps of both layouts in one block")
        for m, m_end in messages:
            uncompressed, pairs = _message_buffers(m)
            plain[i] += uncompressed
            if pairs is not None and len(pairs):
                size = m.body.size
                buffers.append((i, at + m_end - body - size, size, pairs))
        parts.append(data[body:end] if body or end != len(data) else data)
        at += end - body
    joined = b"".join(parts)
    return layout, joined, plain + _declared_sizes(joined, buffers, len(steps))


# the Arrow IPC flatbuffers' field numbers (format/Message.fbs) that the framing reads
_MESSAGE_FIELDS = 4  # Message: version, header_type, header, bodyLength
_HEADER_TYPE, _HEADER, _BODY_LENGTH = 1, 2, 3
_DICTIONARY, _RECORD_BATCH = 2, 3  # MessageHeader: Schema = 1, DictionaryBatch = 2, RecordBatch = 3
_BATCH_FIELDS = 4  # RecordBatch: length, nodes, buffers, compression
_BUFFERS, _COMPRESSION = 2, 3


def _frame_block(steps: list[bytes]) -> tuple[int, bytes, np.ndarray] | None:
    """_frame_steps for a block of steps as the writer writes them, every step's headers read at once (numpy
    over the joined bytes: the Python loop over a step's messages and buffers is most of what a small step
    costs): each step exactly its layout's messages, each with the continuation marker, an LZ4-compressed
    body and its buffers' list, reads inside its own header. The same layout, joined bytes and declared
    sizes as _frame_steps gives; None for a block with anything else in it (a schema message, another
    codec, a header out of the ordinary), which _frame_steps then reads, and refuses if it is malformed."""
    n = len(steps)
    size = np.fromiter(map(len, steps), dtype=np.int64, count=n)
    stop = np.cumsum(size)
    joined = b"".join(steps)
    raw = np.frombuffer(joined, dtype=np.uint8)
    first = _headers(raw, stop - size, stop)
    if first is None:
        return None
    kinds = first[0]
    layout = 2 if (kinds == _DICTIONARY).all() else 1 if (kinds == _RECORD_BATCH).all() else None
    if layout is None:
        return None
    messages = [first]
    if layout == 2:
        second = _headers(raw, first[3], stop)
        if second is None or (second[0] != _RECORD_BATCH).any():
            return None
        messages.append(second)
    if (messages[-1][3] != stop).any():  # nothing after the step's record batch
        return None
    # per buffer: its step, where its message's body starts and how long it is, its offset and length there
    columns: list[list[np.ndarray]] = [[], [], [], [], []]
    for kind, meta_start, meta_end, body_end, header in messages:
        buffers = _buffer_list(raw, kind, meta_start, meta_end, header)
        if buffers is None:
            return None
        count, offset, length = buffers
        for out, x in zip(columns, (np.arange(n), meta_end, body_end - meta_end)):
            out.append(np.repeat(x, count))
        columns[3].append(offset)
        columns[4].append(length)
    step, start, body, offset, length = (np.concatenate(c) for c in columns)
    return layout, joined, _declared(raw, step, start, body, offset, length, n)


def _le(raw: np.ndarray, at: np.ndarray, dtype: str) -> np.ndarray:
    """The little-endian values of `dtype` at byte positions `at` (checked to lie inside `raw`). Where every
    position is a multiple of the width (the writer aligns its headers and buffers to 8 bytes), one gather
    from `raw` seen as that type; else byte by byte."""
    width = np.dtype(dtype).itemsize
    if width == 1:
        return raw[at].astype(np.int64)
    if len(at) > 8 and not (at & (width - 1)).any():
        return raw[: len(raw) - len(raw) % width].view(dtype)[at // width].astype(np.int64)
    return raw[at[:, None] + np.arange(width)].view(dtype).reshape(-1).astype(np.int64)


def _table_fields(raw, table, lo, hi, k: int) -> np.ndarray | None:
    """_fb_fields for many tables at once: (tables, k) positions of fields 0..k-1, -1 for an absent one; None
    where a read would leave the table's header [lo, hi)."""
    if ((table < lo) | (table + 4 > hi)).any():
        return None
    vtable = table - _le(raw, table, "<i4")
    if ((vtable < lo) | (vtable + 2 > hi)).any():
        return None
    have = np.minimum(np.maximum((_le(raw, vtable, "<u2") - 4) // 2, 0), k)
    if (vtable + 4 + 2 * have > hi).any():
        return None
    present = np.arange(k) < have[:, None]
    at = np.zeros(present.shape, dtype=np.int64)
    at[present] = _le(raw, (vtable[:, None] + 4 + 2 * np.arange(k))[present], "<u2")
    return np.where(present & (at > 0), table[:, None] + at, -1)


def _value(raw, at, hi, dtype: str) -> np.ndarray | None:
    """The field at each of `at` (0 where absent, -1), or None where one would leave its header."""
    out = np.zeros(len(at), dtype=np.int64)
    present = at >= 0
    if present.any():
        p = at[present]
        if (p + np.dtype(dtype).itemsize > hi[present]).any():
            return None
        out[present] = _le(raw, p, dtype)
    return out


def _headers(raw, at, stop):
    """The message starting at each of `at` (one a step, the step ending at `stop`): (header type, where its
    flatbuffer starts and ends, where its body ends, where its header table lies), or None."""
    if (at + 8 > stop).any():
        return None
    marker, length = _le(raw, at, "<i4"), _le(raw, at + 4, "<i4")
    lo, hi = at + 8, at + 8 + length
    if (marker != -1).any() or (length < 4).any() or (hi > stop).any():
        return None
    fields = _table_fields(raw, lo + _le(raw, lo, "<u4"), lo, hi, _MESSAGE_FIELDS)
    if fields is None or (fields[:, _HEADER] < 0).any():
        return None
    kind = _value(raw, fields[:, _HEADER_TYPE], hi, "u1")
    body = _value(raw, fields[:, _BODY_LENGTH], hi, "<i8")
    header = _value(raw, fields[:, _HEADER], hi, "<u4")
    if kind is None or body is None or header is None or (body < 0).any():
        return None
    if (hi + body > stop).any():
        return None
    return kind, lo, hi, hi + body, fields[:, _HEADER] + header


def _buffer_list(raw, kind, lo, hi, header):
    """_message_buffers for one message of each step: (buffers per message, their offsets and lengths in the
    body), or None for a message with no LZ4 buffer list, or a dictionary other than the step's own."""
    batch = header
    if kind[0] == _DICTIONARY:  # DictionaryBatch: id, data, isDelta
        fields = _table_fields(raw, header, lo, hi, 3)
        if fields is None or (fields[:, 1] < 0).any():
            return None
        ids, data, delta = (
            _value(raw, fields[:, 0], hi, "<i8"),
            _value(raw, fields[:, 1], hi, "<u4"),
            _value(raw, fields[:, 2], hi, "u1"),
        )
        if ids is None or data is None or delta is None or ids.any() or delta.any():
            return None
        batch = fields[:, 1] + data
    fields = _table_fields(raw, batch, lo, hi, _BATCH_FIELDS)
    if fields is None or (fields[:, _BUFFERS] < 0).any() or (fields[:, _COMPRESSION] < 0).any():
        return None
    compression = _value(raw, fields[:, _COMPRESSION], hi, "<u4")
    vector = _value(raw, fields[:, _BUFFERS], hi, "<u4")
    if compression is None or vector is None:
        return None
    codec = _table_fields(raw, fields[:, _COMPRESSION] + compression, lo, hi, 1)
    if codec is None:
        return None
    codec = _value(raw, codec[:, 0], hi, "u1")  # BodyCompression.codec: 0 = LZ4_FRAME
    if codec is None or codec.any():
        return None
    vector += fields[:, _BUFFERS]
    count = _value(raw, vector, hi, "<u4")
    if count is None or (vector + 4 + 16 * count > hi).any():
        return None
    first = np.repeat(vector + 4 - 16 * (np.cumsum(count) - count), count) + 16 * np.arange(
        count.sum()
    )
    return count, _le(raw, first, "<i8"), _le(raw, first + 8, "<i8")


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


# an LZ4 frame expands at most ~255-fold (a match length grows by 255 per byte); a compressed buffer that says it
# holds more is forged, and Arrow would allocate the size it says before decompressing
_LZ4_MAX_EXPANSION = 256
_REQUIRED = (
    "step",
    "digest",
    "device_digest",
)  # every record has them; readers index and hash them


def _check_schema(message) -> int:
    """The layout version whose schema the message holds; ValueError for any other schema."""
    schema = ipc.read_schema(message)
    for version, ours in _SCHEMAS.items():
        if schema.equals(ours):
            return version
    raise ValueError(f"the stream's schema is not a trajectory's (columns {schema.names[:6]})")


def _step_expansion(n):
    """The most bytes a step of `n` bytes may decompress to. A step's records compress ~4-fold (digests and
    statistics hardly compress; measured by bench/trajectory_codec.py), the best case of a real step
    (`tests/test_untrusted_store.py` measures the runs it writes) stays below STEP_EXPANSION-fold; an LZ4 bomb's
    ~255-fold is refused."""
    return STEP_EXPANSION * n + (1 << 20)


STEP_EXPANSION = 32
# A step's records take their shapes from its dictionary, so a few bytes on disk can name one long shape for
# every record (24 KB decoding to 160 MB): the dimensions a step's records hold in all are bounded by an
# average of SHAPE_DIMS_PER_RECORD a record (a model's tensors have 0-4), plus SHAPE_DIMS_SLACK for a few
# long ones.
SHAPE_DIMS_PER_RECORD = 16
SHAPE_DIMS_SLACK = 4096


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


def _message_buffers(message) -> tuple[int, np.ndarray | None]:
    """What a message's buffers decompress to, read from its flatbuffer header (Message.header: RecordBatch,
    or DictionaryBatch whose .data is one; RecordBatch.buffers, .compression): (bytes stored as they are, the
    (offset, length) in its body of each LZ4-compressed buffer, or None). A dictionary message must replace
    dictionary 0 (the shape's), not add to it: a step holds the whole of its dictionary."""
    meta, body = message.metadata, message.body
    if meta is None or body is None:
        return 0, None
    fb = memoryview(meta)
    (header,) = _fb_fields(fb, _u32(fb, 0), (2,))
    if header is None:
        return 0, None
    batch = header + _u32(fb, header)
    if message.type == "dictionary":  # DictionaryBatch: id (0), data (1), isDelta (2)
        at, data, delta = _fb_fields(fb, batch, (0, 1, 2))
        if (at is not None and struct.unpack_from("<q", fb, at)[0] != 0) or (
            delta is not None and fb[delta]
        ):
            raise ValueError("a dictionary message other than the step's shape dictionary")
        if data is None:
            return 0, None
        batch = data + _u32(fb, data)
    vec, compression = _fb_fields(fb, batch, (2, 3))  # RecordBatch: buffers (2), compression (3)
    if compression is None:  # no BodyCompression: the buffers are stored as they are
        return body.size, None
    (codec_at,) = _fb_fields(fb, compression + _u32(fb, compression), (0,))
    if (
        codec_at is not None and fb[codec_at] != 0
    ):  # BodyCompression.codec: 0 = LZ4_FRAME (the default), 1 = ZSTD
        # the bound below is LZ4's; zstd expands much further (a column of zeros), so its sizes cannot be
        # bounded this way: the trajectory is written with LZ4, another codec is not ours
        raise ValueError("a step compressed with zstd; disttrace's trajectory is LZ4")
    if vec is None:
        return 0, None
    vec += _u32(fb, vec)
    n = _u32(fb, vec)
    if vec + 4 + 16 * n > len(fb):
        raise ValueError("a malformed message header")
    return 0, np.frombuffer(fb, dtype="<i8", count=2 * n, offset=vec + 4).reshape(n, 2)


def _u32(fb: memoryview, at: int) -> int:
    if at < 0:  # struct would count a negative offset from the end
        raise ValueError("a malformed message header")
    return struct.unpack_from("<I", fb, at)[0]


def _fb_fields(fb: memoryview, table: int, which: tuple[int, ...]) -> list[int | None]:
    """Where fields `which` (increasing) of the flatbuffer table at `table` lie, None for an absent one."""
    if table < 0:
        raise ValueError("a malformed message header")
    vtable = table - struct.unpack_from("<i", fb, table)[0]
    if vtable < 0:
        raise ValueError("a malformed message header")
    vsize = struct.unpack_from("<H", fb, vtable)[0]
    have = min(max((vsize - 4) // 2, 0), which[-1] + 1)
    at = struct.unpack_from(f"<{have}H", fb, vtable + 4)
    return [table + at[i] if i < have and at[i] else None for i in which]


def _declared_sizes(joined: bytes, buffers: list, n_steps: int) -> np.ndarray:
    """Per step, the bytes its LZ4 buffers say they decompress to (each buffer's 8-byte length prefix, all
    read at once), ValueError for a buffer that claims more than LZ4 can expand its bytes to. A buffer that
    is empty or lies outside its message's body counts nothing: Arrow refuses it without allocating."""
    if not buffers:
        return np.zeros(n_steps)
    if len(buffers) <= 2:  # one step's messages: a loop costs less than a dozen numpy calls
        out = np.zeros(n_steps)
        for i, start, body, pairs in buffers:
            for offset, length in pairs.tolist():
                if length < 8 or offset < 0 or offset + 8 > body:
                    continue  # empty, or out of the body: Arrow refuses it without allocating
                size = struct.unpack_from("<q", joined, start + offset)[0]
                if size != -1 and not 0 <= size <= _LZ4_MAX_EXPANSION * length:
                    raise ValueError(
                        f"a compressed buffer of {length} bytes says it holds {size} bytes"
                    )
                out[i] += length if size == -1 else size
        return out
    counts = [len(p) for *_, p in buffers]
    step, start, body = (
        np.repeat(np.array([b[k] for b in buffers], dtype=np.int64), counts) for k in range(3)
    )
    pairs = np.concatenate([p for *_, p in buffers])
    raw = np.frombuffer(joined, dtype=np.uint8)
    return _declared(raw, step, start, body, pairs[:, 0], pairs[:, 1], n_steps)


def _declared(raw, step, start, body, offset, length, n_steps: int) -> np.ndarray:
    """_declared_sizes over arrays, one entry a buffer: its step, where its message's body starts in `raw`
    and how long it is, the buffer's offset and length in that body."""
    inside = (length >= 8) & (offset >= 0) & (offset <= body - 8)
    step, at, length = step[inside], (start + offset)[inside], length[inside]
    size = _le(raw, at, "<i8")
    # size <= 256 * length without overflow: ceil(size / 256) <= length
    bad = (size != -1) & (
        (size < 0) | (size // _LZ4_MAX_EXPANSION + (size % _LZ4_MAX_EXPANSION > 0) > length)
    )
    if bad.any():
        j = int(np.nonzero(bad)[0][0])
        raise ValueError(
            f"a compressed buffer of {int(length[j])} bytes says it holds {int(size[j])} bytes"
        )
    counted = np.where(size == -1, length, size).astype(
        np.float64
    )  # exact below 2^53, far past any bound
    return np.bincount(step, weights=counted, minlength=n_steps)


def _check_required(batch: pa.RecordBatch) -> None:
    for name in _REQUIRED:
        if batch.column(name).null_count:
            raise ValueError(f"a record without '{name}'")


def read_range(path: Path, offset: int, length: int, root: Path | None = None) -> bytes:
    """One step's bytes (store/safeio.py: a regular file inside `root`, by default its run directory)."""
    path = Path(path)
    return safeio.read_range(path, path.parent.parent if root is None else root, offset, length)


def scan(
    path: Path, torn: list | None = None, root: Path | None = None
) -> Iterator[tuple[int, int, pa.RecordBatch]]:
    """(offset, length, batch) of every step in the file, in order, without the step index. A step's range
    runs from the end of the one before (the first step's holds the schema message) to the end of its record
    batch; a v2 step's dictionary message comes before its batch. A torn final step is reported through `torn`
    and left out. The file is mapped, not read: only the steps being decoded are copied, up to SCAN_BYTES of
    them decoded together (decode_steps)."""
    path = Path(path)
    data = safeio.mapped(path, path.parent.parent if root is None else root)
    reader = pa.BufferReader(pa.py_buffer(data) if data else data)
    start, first = 0, None  # first: where the step's first message after any schema lies
    pending: list[
        tuple[int, int, int, int]
    ] = []  # framed steps not yet decoded: start, length, first, end

    def flush():
        if not pending:
            return
        batch, starts = decode_steps(
            path, [(data[a:b], f"bytes {a}..{b}") for _, _, a, b in pending]
        )
        ends = np.append(starts[1:], batch.num_rows)
        for (offset, length, _, _), i, j in zip(pending, starts.tolist(), ends.tolist()):
            yield offset, length, batch.slice(i, j - i)
        pending.clear()

    def cut(pos: int):
        if torn is not None:
            torn.append(
                f"{path}: the last step's bytes (from offset {start}) are torn (incomplete write), ignored"
            )
            return
        raise BadInput(path, f"bytes from offset {pos} are not an Arrow message")

    while reader.tell() < len(data):
        pos = reader.tell()
        if (
            data[pos : pos + len(END_OF_STREAM)] == END_OF_STREAM
        ):  # at close; a restarted job appends after it
            if first is not None:
                yield from flush()
                raise BadInput(
                    path,
                    f"bytes {first}..{pos}: a dictionary message without its step's record batch",
                )
            reader.seek(pos + len(END_OF_STREAM))
            start = reader.tell()
            continue
        try:
            msg = ipc.read_message(reader)
        except (pa.ArrowException, OSError, ValueError, EOFError):
            yield from flush()
            return cut(pos)
        if msg is None:
            break
        if msg.type == "schema" and first is None:
            try:
                _check_schema(msg)
            except (
                pa.ArrowException,
                ValueError,
                OSError,
            ) as e:  # a forged header: OSError from flatbuffers
                raise BadInput(path, f"bytes {pos}..{reader.tell()}: {e}") from None
            continue
        if first is None:
            first = pos
        if msg.type == "dictionary":
            continue
        end = reader.tell()
        if end - first > safeio.LIMITS["step"]:
            yield from flush()
            raise BadInput(path, f"bytes {first}..{end}: a step larger than a step may be")
        pending.append((start, end - start, first, end))
        if sum(b - a for _, _, a, b in pending) >= SCAN_BYTES:
            yield from flush()
        start, first = end, None
    yield from flush()
    if (
        first is not None
    ):  # a dictionary message and no record batch after it: the write stopped in between
        cut(first)


SCAN_BYTES = 1 << 20  # steps decoded together by scan (~15,000 records)


def unindexed_tail(path: Path, end: int, root: Path | None = None) -> int:
    """Bytes after `end` (the last indexed step) other than the end-of-stream marker: a step whose write a
    crash interrupted (its index line is written only after its bytes)."""
    path = Path(path)
    size = safeio.size(path, path.parent.parent if root is None else root)
    if size <= end:
        return 0
    if (
        size - end == len(END_OF_STREAM)
        and read_range(path, end, len(END_OF_STREAM), root) == END_OF_STREAM
    ):
        return 0
    return size - end


def step_of(batch: pa.RecordBatch) -> int | None:
    return int(batch.column(0)[0].as_py()) if batch.num_rows else None


def to_records(batch: pa.RecordBatch) -> list[dict]:
    """The batch as the recorder's dicts (TrajectoryRecord: optional fields absent when not recorded)."""
    cols = {name: batch.column(i).to_pylist() for i, name in enumerate(FIELDS)}
    out = []
    for i in range(batch.num_rows):
        digest = cols["digest"][i].hex()
        r = {
            "step": cols["step"][i],
            "micro_batch": cols["micro_batch"][i],
            "phase": cols["phase"][i],
            "rank": cols["rank"][i],
            "index": cols["index"][i],
            "tensor": cols["tensor"][i],
            "dtype": cols["dtype"][i],
            "shape": cols["shape"][i],
            "numel": cols["numel"][i],
            "digest": _DEVICE_PREFIX + digest if cols["device_digest"][i] else digest,
            "sum": cols["sum"][i],
            "norm": cols["norm"][i],
        }
        sk = cols["sketch"][i] or cols["sketch64"][i]
        if sk is not None:
            r["sketch"] = sk
        r["nonfinite"] = cols["nonfinite"][i]
        for k in ("samples", "tokens"):
            if cols[k][i] is not None:
                r[k] = cols[k][i]
        if cols["shard_offset"][i] is not None:
            r["shard"] = {
                "offset": cols["shard_offset"][i],
                "logical_shape": cols["shard_shape"][i],
            }
        out.append(r)
    return out


def records_of_range(
    path: Path,
    offset: int,
    length: int,
    step: int | None = None,
    root: Path | None = None,
    phases: tuple[str, ...] | None = None,
) -> list[dict]:
    """One step's records, read by seeking to its byte range (from the step index); with `phases`, only
    those phases' records (the step is checked whole all the same; only what is asked for is converted to
    dicts, a few records of thousands for a reader of the clip scalars)."""
    data = read_range(path, offset, length, root)
    if not is_arrow(path):
        try:
            recs = [orjson.loads(line) for line in data.splitlines() if line.strip()]
        except orjson.JSONDecodeError:
            raise BadInput(
                path,
                f"step {step}: a record in bytes {offset}..{offset + length} is not valid JSON "
                "(the file does not match its step index)",
            ) from None
        from disttrace.store.records import checked_json_records

        recs = checked_json_records(
            recs, f"{path} (step {step}, bytes {offset}..{offset + length})"
        )
        return recs if phases is None else [r for r in recs if r.get("phase") in phases]
    batch = decode_step(path, data, f"step {step} (bytes {offset}..{offset + length})")
    if phases is not None:
        batch = batch.filter(
            pc.is_in(batch.column("phase"), value_set=pa.array(phases, pa.string()))
        )
    return to_records(batch)
