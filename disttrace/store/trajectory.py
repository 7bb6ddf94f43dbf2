"""The trajectory on disk: one Arrow IPC stream per rank, `trajectory/rank-NNNNN.arrows`, one record batch per
step (docs/design.md, "Run store").

Why columnar. A JSON line spent ~355 bytes on one record (field names, hex digests, floats as text), and a
reader parsed every field of every record. A column of 16-byte digests, float64 sums and norms and a
float32 sketch compresses to ~50 bytes a record (LZ4 per column buffer; step, rank, phase and index runs
cost almost nothing), and diff reads whole columns into numpy without building a dict per record.

Why one batch per step, self-contained. The step index (`rank-NNNNN.steps.jsonl`) keeps each step's byte
offset and length, the sha256 chain seals those bytes (store/seal.py), and diff seeks to one step without
reading the others. So a step's bytes must decode on their own: no dictionary-encoded columns (an Arrow
dictionary lives in earlier messages of the stream); tensor names are plain strings, which zstd compresses
because each name repeats in every phase of the step. The first step's bytes also hold the stream's schema
message; readers decode with `SCHEMA` below, never with a schema read from the store, so a forged header
cannot change what a column means.

Any Arrow reader reads the file as it is (`pyarrow.ipc.open_stream`, `polars.read_ipc_stream`, DuckDB over
the Arrow table): `disttrace show RUN records --jsonl` exports it as JSON lines. A crash mid-step leaves a
torn final message: reported and left out, as a torn JSON line was. Run stores written before this format
(`rank-NNNNN.jsonl`, one record a line) are still read.
"""

from __future__ import annotations

import io
import os
import struct
from pathlib import Path
from typing import Iterator

import orjson
import pyarrow as pa
import pyarrow.ipc as ipc

from disttrace.errors import BadInput

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
SCHEMA = pa.schema([
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
    ("device_digest", pa.bool_()),  # the digest is the device checksum (run/digest.py), not xxh3 of the bytes
    ("sum", pa.float64()),  # null: not finite
    ("norm", pa.float64()),
    ("sketch", pa.list_(pa.float32(), SKETCH_K)),  # float32-computed sketches (SKETCH_FLOAT32 dtypes)
    ("sketch64", pa.list_(pa.float64(), SKETCH_K)),  # float64 and integer tensors' sketches
    ("nonfinite", pa.int64()),
    ("samples", _ints),  # data phase: the batch's sample ids
    ("tokens", pa.int64()),  # loss phase: the tokens the loss is a mean over
    ("shard_offset", _ints),  # a DTensor shard: where this rank's piece sits in the logical tensor
    ("shard_shape", _ints),
])
FIELDS = tuple(SCHEMA.names)


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


def _first_message_end(data: bytes) -> int:
    r = pa.BufferReader(data)
    ipc.read_message(r)
    return r.tell()


_OPTIONS = ipc.IpcWriteOptions(compression=COMPRESSION, use_threads=False)
_READ = ipc.IpcReadOptions(use_threads=False)  # a step is small: a thread pool's hand-off costs more than it saves
_SCHEMA_MESSAGE = SCHEMA.serialize().to_pybytes()


def _columns(records: list[dict]) -> list[pa.Array]:
    """The records of one step as SCHEMA's columns (the recorder's dicts, TrajectoryRecord's shape); a column
    at a time (a comprehension per field), the recorder's hot path."""
    extra = set().union(*records) - _KNOWN
    if extra:
        raise ValueError(f"trajectory record with fields the schema does not hold: {sorted(extra)}")
    cols = {k: [r.get(k) for r in records] for k in _PLAIN}
    digests = [r["digest"] for r in records]
    dev = [d.startswith(_DEVICE_PREFIX) for d in digests]
    cols["digest"] = [bytes.fromhex(d[len(_DEVICE_PREFIX):] if v else d) for d, v in zip(digests, dev)]
    cols["device_digest"] = dev
    in32 = [d in SKETCH_FLOAT32 for d in cols["dtype"]]
    sketches = [r.get("sketch") for r in records]
    cols["sketch"] = [k if f else None for k, f in zip(sketches, in32)]
    cols["sketch64"] = [None if f else k for k, f in zip(sketches, in32)]
    shards = [r.get("shard") for r in records]
    cols["shard_offset"] = [x["offset"] if x else None for x in shards]
    cols["shard_shape"] = [x["logical_shape"] if x else None for x in shards]
    return [pa.array(cols[f.name], f.type) for f in SCHEMA]


_PLAIN = ("step", "micro_batch", "phase", "rank", "index", "tensor", "dtype", "shape", "numel", "sum", "norm",
          "nonfinite", "samples", "tokens")
_KNOWN = frozenset(_PLAIN) | {"digest", "sketch", "shard"}


class TrajectoryWriter:
    """Appends one rank's steps to its Arrow stream; each step is written and flushed whole, so a crash loses
    at most the step being written (a torn final message, which readers report and leave out)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        self._sink = _Chunks()
        self._writer = None
        # appending to an existing stream (a job restarted into its run directory): its schema is there already
        self._skip_schema = self._f.tell() > 0

    @property
    def offset(self) -> int:
        return self._f.tell()

    def write_step(self, records: list[dict]) -> bytes:
        """Write one step's records (already in the order of docs/design.md) as one record batch; returns the
        bytes written, which the step index hashes and chains."""
        batch = pa.RecordBatch.from_arrays(_columns(records), schema=SCHEMA)
        if self._writer is None:
            self._writer = ipc.new_stream(pa.PythonFile(self._sink, mode="w"), SCHEMA, options=_OPTIONS)
        self._writer.write_batch(batch)
        data = self._sink.take()
        if self._skip_schema:
            data = data[_first_message_end(data):]
            self._skip_schema = False
        self._f.write(data)
        self._f.flush()
        return data

    def close(self) -> None:
        if self._f.closed:
            return
        if self._writer is not None:
            self._writer.close()  # the end-of-stream marker: outside every step's range, sealed with the file
            self._f.write(self._sink.take())
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()


# ---------------------------------------------------------------- reading


def trajectory_path(run_path: Path, rank: int) -> Path:
    """This rank's trajectory: the Arrow stream, or a JSON-lines file of a store written before it."""
    base = Path(run_path) / "trajectory" / f"rank-{rank:05d}"
    arrow = base.with_name(base.name + SUFFIX)
    if arrow.exists():
        return arrow
    legacy = base.with_name(base.name + LEGACY_SUFFIX)
    return legacy if legacy.exists() else arrow


def is_arrow(path: Path) -> bool:
    return Path(path).suffix == SUFFIX


def decode_step(path: Path, data: bytes, where: str) -> pa.RecordBatch:
    """The record batch in one step's bytes (a schema message before it, in the first step, is checked to be
    ours, skipped, and our own SCHEMA used instead). Anything else (a torn, edited or foreign message) is bad
    input naming the file and step."""
    try:
        reader = pa.BufferReader(data)
        first = ipc.read_message(reader)
        if first is not None and first.type == "schema":
            _check_schema(first)
            body = data[reader.tell():]
            message = ipc.read_message(pa.BufferReader(body))
        else:
            body, message = data, first
        if message is not None:
            _check_compressed_sizes(message)  # before decoding: a forged size would be allocated whole
        stream = ipc.open_stream(_SCHEMA_MESSAGE + body, options=_READ)
        batch = stream.read_next_batch()
        try:
            stream.read_next_batch()
            raise ValueError("more than one record batch")
        except StopIteration:
            pass
        batch.validate(full=True)  # offsets and lengths inside their buffers: a forged batch is refused here
        _check_required(batch)
    except (pa.ArrowException, ValueError, OSError, EOFError, StopIteration, IndexError, struct.error) as e:
        raise BadInput(path, f"{where}: not a trajectory record batch ({(str(e) or type(e).__name__).splitlines()[0][:120]})") from None
    return batch


# an LZ4 frame expands at most ~255-fold (a match length grows by 255 per byte); a compressed buffer that says it
# holds more is forged, and Arrow would allocate the size it says before decompressing
_LZ4_MAX_EXPANSION = 256
_REQUIRED = ("step", "digest", "device_digest")  # every record has them; readers index and hash them


def _check_schema(message) -> None:
    schema = ipc.read_schema(message)
    if not schema.equals(SCHEMA):
        raise ValueError(f"the stream's schema is not a trajectory's (columns {schema.names[:6]})")


def _check_compressed_sizes(message) -> None:
    """Each LZ4-compressed buffer's uncompressed-length prefix against what its bytes can expand to, read
    from the message's flatbuffer header (Message.header: RecordBatch; RecordBatch.buffers, .compression)."""
    if message.type != "record batch":
        raise ValueError(f"a {message.type} message where a step's record batch belongs")
    meta, body = message.metadata, message.body
    if meta is None or body is None:
        return
    fb, body = memoryview(meta), memoryview(body)
    header = _fb_field(fb, struct.unpack_from("<I", fb, 0)[0], 2)
    if header is None:
        return
    batch = header + struct.unpack_from("<I", fb, header)[0]
    compression = _fb_field(fb, batch, 3)
    if compression is None:  # no BodyCompression: the buffers are stored as they are
        return
    table = compression + struct.unpack_from("<I", fb, compression)[0]
    codec_at = _fb_field(fb, table, 0)
    if codec_at is not None and fb[codec_at] != 0:  # BodyCompression.codec: 0 = LZ4_FRAME (the default), 1 = ZSTD
        # the bound below is LZ4's; zstd expands much further (a column of zeros), so its sizes cannot be
        # bounded this way: the trajectory is written with LZ4, another codec is not ours
        raise ValueError("a step compressed with zstd; disttrace's trajectory is LZ4")
    vec = _fb_field(fb, batch, 2)
    if vec is None:
        return
    vec += struct.unpack_from("<I", fb, vec)[0]
    for i in range(struct.unpack_from("<I", fb, vec)[0]):
        offset, length = struct.unpack_from("<qq", fb, vec + 4 + 16 * i)
        if length < 8 or offset < 0 or offset + 8 > len(body):
            continue  # empty, or out of the body: Arrow refuses it without allocating
        size = struct.unpack_from("<q", body, offset)[0]
        if size != -1 and not 0 <= size <= _LZ4_MAX_EXPANSION * length:
            raise ValueError(f"a compressed buffer of {length} bytes says it holds {size} bytes")


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


def read_range(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def scan(path: Path, torn: list | None = None) -> Iterator[tuple[int, int, pa.RecordBatch]]:
    """(offset, length, batch) of every step in the file, in order, without the step index. A torn final
    message is reported through `torn` and left out."""
    data = Path(path).read_bytes()
    reader = pa.BufferReader(data)
    start = 0
    while reader.tell() < len(data):
        pos = reader.tell()
        if data[pos:pos + len(END_OF_STREAM)] == END_OF_STREAM:  # at close; a restarted job appends after it
            reader.seek(pos + len(END_OF_STREAM))
            start = reader.tell()
            continue
        try:
            msg = ipc.read_message(reader)
        except (pa.ArrowException, OSError, ValueError, EOFError):
            if torn is not None:
                torn.append(f"{path}: the last step's bytes (from offset {pos}) are torn (incomplete write), ignored")
                return
            raise BadInput(path, f"bytes from offset {pos} are not an Arrow message") from None
        if msg is None:
            return
        if msg.type == "schema":
            try:
                _check_schema(msg)
            except (pa.ArrowException, ValueError) as e:
                raise BadInput(path, f"bytes {pos}..{reader.tell()}: {e}") from None
            continue
        end = reader.tell()
        yield start, end - start, decode_step(path, data[pos:end], f"bytes {pos}..{end}")
        start = end


def unindexed_tail(path: Path, end: int) -> int:
    """Bytes after `end` (the last indexed step) other than the end-of-stream marker: a step whose write a
    crash interrupted (its index line is written only after its bytes)."""
    size = Path(path).stat().st_size
    if size <= end:
        return 0
    if size - end == len(END_OF_STREAM) and read_range(path, end, len(END_OF_STREAM)) == END_OF_STREAM:
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
        r = {"step": cols["step"][i], "micro_batch": cols["micro_batch"][i], "phase": cols["phase"][i],
             "rank": cols["rank"][i], "index": cols["index"][i], "tensor": cols["tensor"][i],
             "dtype": cols["dtype"][i], "shape": cols["shape"][i], "numel": cols["numel"][i],
             "digest": _DEVICE_PREFIX + digest if cols["device_digest"][i] else digest,
             "sum": cols["sum"][i], "norm": cols["norm"][i]}
        sk = cols["sketch"][i] or cols["sketch64"][i]
        if sk is not None:
            r["sketch"] = sk
        r["nonfinite"] = cols["nonfinite"][i]
        for k in ("samples", "tokens"):
            if cols[k][i] is not None:
                r[k] = cols[k][i]
        if cols["shard_offset"][i] is not None:
            r["shard"] = {"offset": cols["shard_offset"][i], "logical_shape": cols["shard_shape"][i]}
        out.append(r)
    return out


def records_of_range(path: Path, offset: int, length: int, step: int | None = None) -> list[dict]:
    """One step's records, read by seeking to its byte range (from the step index)."""
    data = read_range(path, offset, length)
    if not is_arrow(path):
        try:
            return [orjson.loads(line) for line in data.splitlines() if line.strip()]
        except orjson.JSONDecodeError:
            raise BadInput(path, f"step {step}: a record in bytes {offset}..{offset + length} is not valid JSON "
                           "(the file does not match its step index)") from None
    return to_records(decode_step(path, data, f"step {step} (bytes {offset}..{offset + length})"))

