"""Writing a rank's trajectory (the format: store/trajectory.py): one step's records as the columns of its
stream's layout (SCHEMA_V2 for a new stream, SCHEMA where an older disttrace's v1 stream is appended to), each
step one self-contained record batch, written and flushed whole."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

from disttrace.store.trajectory import (
    _DEVICE_PREFIX,
    _SCHEMAS,
    _SHAPE_INDEX,
    COMPRESSION,
    END_OF_STREAM,
    SCHEMA,
    SCHEMA_V2,
    SKETCH_FLOAT32,
    _ints,
)

VERSION = 2  # what a new stream is written in


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
