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
import pyarrow.ipc as ipc

from disttrace.errors import BadInput
from disttrace.store import safeio

SUFFIX = ".arrows"  # Arrow's extension for the IPC stream format
LEGACY_SUFFIX = ".jsonl"
# LZ4 frames per column buffer. Measured on 1,000-record steps (`python bench/trajectory_codec.py`): zstd
# 42 bytes a record and 0.72 ms to decode a step, LZ4 56 bytes and 0.12 ms, uncompressed 212 bytes and
# 0.04 ms; decoding is what a numeric diff of every record pays, so LZ4
COMPRESSION = "lz4"
END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what the stream writer appends at close

# dtypes whose sketch is computed in float32 (run/digest.py) and therefore stored in float32: storing it in
# float64 would keep digits the computation never had (tolerance.sketch_rounding counts the storage rounding)
SKETCH_FLOAT32 = ("float32", "float16", "bfloat16")
SKETCH_K = 4

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
        ),  # the digest is the device checksum (run/digest.py), not xxh3 of the bytes
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
        batch = pa.RecordBatch.from_arrays(self._encode(records), schema=self._schema)
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


def decode_step(path: Path, data: bytes, where: str) -> pa.RecordBatch:
    """SCHEMA's record batch from one step's bytes: a schema message first (the file's first step) is checked
    to be one of ours and skipped, our own schema used instead; then a v2 step's shape dictionary and its
    record batch, or a v1 step's record batch, and nothing else. Anything else (a torn, edited or foreign
    message) is bad input naming the file and step."""
    try:
        reader = pa.BufferReader(data)
        messages, version, body = [], None, 0
        while reader.tell() < len(data):
            if data[reader.tell() : reader.tell() + len(END_OF_STREAM)] == END_OF_STREAM:
                break
            m = ipc.read_message(reader)
            if m is None:
                break
            if m.type == "schema" and version is None and not messages:
                version, body = _check_schema(m), reader.tell()
                continue
            messages.append(m)
        kinds = [m.type for m in messages]
        layout = 2 if kinds[:1] == ["dictionary"] else 1  # told by the step's own bytes
        expected = _STEP_MESSAGES[layout]
        if kinds != expected or version not in (None, layout):
            raise ValueError(f"messages {kinds} where a step's {expected} belong")
        # before decoding: a forged size would be allocated whole, and many honest-looking ones (an LZ4 bomb:
        # each buffer within LZ4's own expansion) would still add up to far more than a step of ours holds
        declared = sum(_check_compressed_sizes(m) for m in messages)
        if declared > _step_expansion(len(data)):
            raise ValueError(
                f"buffers that expand {len(data)} bytes to {declared}, more than a step's records do"
            )
        stream = ipc.open_stream(_SCHEMA_MESSAGES[layout] + data[body:], options=_READ)
        batch = stream.read_next_batch()
        batch.validate(full=True)  # offsets, views and dictionary indices inside their buffers
        if layout == 2:
            batch = _from_v2(batch)
        _check_required(batch)
    except (
        pa.ArrowException,
        ValueError,
        OSError,
        EOFError,
        StopIteration,
        IndexError,
        struct.error,
    ) as e:
        raise BadInput(
            path,
            f"{where}: not a trajectory record batch ({(str(e) or type(e).__name__).splitlines()[0][:120]})",
        ) from None
    return batch


_STEP_MESSAGES = {1: ["record batch"], 2: ["dictionary", "record batch"]}


def _from_v2(b: pa.RecordBatch) -> pa.RecordBatch:
    """A v2 batch as SCHEMA's: phase and dtype as plain strings, shape from its dictionary, numel computed, the
    shard split into offset and logical shape."""
    (
        step,
        micro_batch,
        phase,
        rank,
        index,
        tensor,
        dtype,
        shape,
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
    ) = b.columns
    numel = pa.array([_product(s) for s in shape.dictionary.to_pylist()], pa.int64()).take(
        shape.indices
    )
    return pa.RecordBatch.from_arrays(
        [
            step,
            micro_batch,
            phase.cast(pa.string()),
            rank,
            index,
            tensor,
            dtype.cast(pa.string()),
            shape.dictionary.take(shape.indices),
            numel,
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


def _product(shape: list | None) -> int | None:
    if shape is None:
        return None
    n = math.prod(shape)
    if not -(2**63) <= n < 2**63:
        raise ValueError(f"a shape whose product overflows int64 ({shape[:8]})")
    return n


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


def _step_expansion(n: int) -> int:
    """The most bytes a step of `n` bytes may decompress to. A step's records compress ~4-fold (digests and
    statistics hardly compress; measured by bench/trajectory_codec.py), the best case of a real step
    (`tests/test_untrusted_store.py` measures the runs it writes) stays below STEP_EXPANSION-fold; an LZ4 bomb's
    ~255-fold is refused."""
    return STEP_EXPANSION * n + (1 << 20)


STEP_EXPANSION = 32


def _check_compressed_sizes(message) -> int:
    """Each LZ4-compressed buffer's uncompressed-length prefix against what its bytes can expand to, read
    from the message's flatbuffer header (Message.header: RecordBatch, or DictionaryBatch whose .data is one;
    RecordBatch.buffers, .compression). A dictionary message must replace dictionary 0 (the shape's), not
    add to it: a step holds the whole of its dictionary. Returns the bytes its buffers decompress to."""
    meta, body = message.metadata, message.body
    if meta is None or body is None:
        return 0
    fb, body = memoryview(meta), memoryview(body)
    header = _fb_field(fb, struct.unpack_from("<I", fb, 0)[0], 2)
    if header is None:
        return 0
    batch = header + struct.unpack_from("<I", fb, header)[0]
    if message.type == "dictionary":  # DictionaryBatch: id (0), data (1), isDelta (2)
        at = _fb_field(fb, batch, 0)
        delta = _fb_field(fb, batch, 2)
        if (at is not None and struct.unpack_from("<q", fb, at)[0] != 0) or (
            delta is not None and fb[delta]
        ):
            raise ValueError("a dictionary message other than the step's shape dictionary")
        data = _fb_field(fb, batch, 1)
        if data is None:
            return 0
        batch = data + struct.unpack_from("<I", fb, data)[0]
    compression = _fb_field(fb, batch, 3)
    if compression is None:  # no BodyCompression: the buffers are stored as they are
        return len(body)
    table = compression + struct.unpack_from("<I", fb, compression)[0]
    codec_at = _fb_field(fb, table, 0)
    if (
        codec_at is not None and fb[codec_at] != 0
    ):  # BodyCompression.codec: 0 = LZ4_FRAME (the default), 1 = ZSTD
        # the bound below is LZ4's; zstd expands much further (a column of zeros), so its sizes cannot be
        # bounded this way: the trajectory is written with LZ4, another codec is not ours
        raise ValueError("a step compressed with zstd; disttrace's trajectory is LZ4")
    vec = _fb_field(fb, batch, 2)
    if vec is None:
        return 0
    vec += struct.unpack_from("<I", fb, vec)[0]
    total = 0
    for i in range(struct.unpack_from("<I", fb, vec)[0]):
        offset, length = struct.unpack_from("<qq", fb, vec + 4 + 16 * i)
        if length < 8 or offset < 0 or offset + 8 > len(body):
            continue  # empty, or out of the body: Arrow refuses it without allocating
        size = struct.unpack_from("<q", body, offset)[0]
        if size != -1 and not 0 <= size <= _LZ4_MAX_EXPANSION * length:
            raise ValueError(f"a compressed buffer of {length} bytes says it holds {size} bytes")
        total += length if size == -1 else size
    return total


def _fb_field(fb: memoryview, table: int, i: int) -> int | None:
    """Where field `i` of the flatbuffer table at `table` lies, or None when absent."""
    vtable = table - struct.unpack_from("<i", fb, table)[0]
    if table < 0 or vtable < 0:  # struct would count a negative offset from the end
        raise ValueError("a malformed message header")
    vsize = struct.unpack_from("<H", fb, vtable)[0]
    if 4 + 2 * i + 2 > vsize:
        return None
    at = struct.unpack_from("<H", fb, vtable + 4 + 2 * i)[0]
    return table + at if at else None


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
    and left out. The file is mapped, not read: only the step being decoded is copied."""
    path = Path(path)
    data = safeio.mapped(path, path.parent.parent if root is None else root)
    reader = pa.BufferReader(pa.py_buffer(data) if data else data)
    start, first = 0, None  # first: where the step's first message after any schema lies

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
            raise BadInput(path, f"bytes {first}..{end}: a step larger than a step may be")
        yield start, end - start, decode_step(path, data[first:end], f"bytes {first}..{end}")
        start, first = end, None
    if (
        first is not None
    ):  # a dictionary message and no record batch after it: the write stopped in between
        cut(first)


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
    path: Path, offset: int, length: int, step: int | None = None, root: Path | None = None
) -> list[dict]:
    """One step's records, read by seeking to its byte range (from the step index)."""
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

        return checked_json_records(
            recs, f"{path} (step {step}, bytes {offset}..{offset + length})"
        )
    return to_records(decode_step(path, data, f"step {step} (bytes {offset}..{offset + length})"))
