"""The Flight Recorder's collective trace as compressed frames: `collectives/rank-N.frames`.

Each copy of the ring (run/record/flightrec.py's dump: every few steps, at the end, or from a signal handler as the
process dies) is one frame, written with one os.write: a header (MAGIC, the bytes of its JSON lines, the
bytes stored, their CRC-32) and its JSON lines, one CollectiveLine each, compressed with zstd. The lines
repeat their keys, groups, ops and shapes: compressed, the trace of a tp=2 run is 17.5 times smaller (2.9
bytes a trajectory record, from 50.9; bench/store_size.py, docs/benchmarks.md), where the JSON lines were
the largest part of a run directory without checkpoints. A reader yields the lines as the JSON-lines file
held them, so what it makes of them is the same. The dispatch-mode tracer (run/record/collectives.py) keeps
writing `rank-N.jsonl`, a line flushed before each op runs; a store written before frames existed holds
`rank-N.jsonl` too, and reads as it did.

A frame cut short at the end of the file (the process died mid-write) is left out and reported as torn;
one cut short with a frame after it, a header that is not one, or bytes that do not decompress to the
stated length and CRC are damage, refused (BadInput)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import orjson
import pyarrow as pa

from disttrace.errors import BadInput
from disttrace.store import safeio

SUFFIX = ".frames"
MAGIC = b"DTC1"
_HEAD = struct.Struct("<4sIII")  # MAGIC, bytes of JSON lines, bytes stored, CRC-32 of the lines
CODEC = "zstd"
# the JSON lines of one frame at most: a ring of 2,000 entries is about 300 KB of them
MAX_FRAME = 64 << 20


def encode(lines: bytes) -> bytes:
    """One frame of `lines` (JSON lines, each ending in a newline)."""
    stored = pa.Codec(CODEC).compress(lines, asbytes=True)
    return _HEAD.pack(MAGIC, len(lines), len(stored), zlib.crc32(lines)) + stored


def records(
    path: Path | str, torn: list | None = None, root: Path | str | None = None
) -> Iterator[dict]:
    """Every JSON line of every frame, as an object, in the order written (a torn last frame reported
    through `torn`, not raised; without `torn`, refused)."""
    path = Path(path)
    data = safeio.read_bytes(path, path.parent.parent if root is None else root, "jsonl")
    n = 0
    for lines in frames(path, data, torn):
        for raw in lines.split(b"\n"):
            if not raw:
                continue
            n += 1
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                raise BadInput(path, f"line {n} is not valid JSON") from None
            if not isinstance(obj, dict):
                raise BadInput(path, f"line {n} is not a JSON object")
            yield obj


def last_frame(path: Path | str, root: Path | str | None = None) -> bytes:
    """The JSON lines of the last whole frame (b"" if none): what a live monitor reads of a rank's trace.
    Only the headers of the others are read; anything after the last whole frame is passed over."""
    path = Path(path)
    with safeio.open_file(path, path.parent.parent if root is None else root) as f:
        end = f.seek(0, 2)
        at, last = 0, None
        while at + _HEAD.size <= end:
            f.seek(at)
            magic, size, stored, crc = _HEAD.unpack(f.read(_HEAD.size))
            if magic != MAGIC or size > MAX_FRAME or at + _HEAD.size + stored > end:
                break
            last = (at, size, stored, crc)
            at += _HEAD.size + stored
        if last is None:
            return b""
        f.seek(last[0] + _HEAD.size)
        return _decode(path, last[0], f.read(last[2]), last[1], last[3])


def frames(path: Path, data: bytes, torn: list | None = None) -> Iterator[bytes]:
    """The JSON lines of each frame of `data` (the file at `path`), in order."""
    at, end = 0, len(data)
    while at < end:
        if end - at < _HEAD.size:
            _torn(path, data, at, torn)
            return
        magic, size, stored, crc = _HEAD.unpack_from(data, at)
        if magic != MAGIC or size > MAX_FRAME:
            raise BadInput(path, f"bytes {at}.. are not a collective-trace frame")
        if at + _HEAD.size + stored > end:
            _torn(path, data, at, torn)
            return
        yield _decode(path, at, data[at + _HEAD.size : at + _HEAD.size + stored], size, crc)
        at += _HEAD.size + stored


def _torn(path: Path, data: bytes, at: int, torn: list | None) -> None:
    if data.find(MAGIC, at + 1) >= 0:  # a frame after it: damage, not a torn end
        raise BadInput(path, f"the frame at byte {at} runs past the next one")
    if (
        torn is None
    ):  # as a torn last line of a JSON-lines file: refused where no one asked to hear of it
        raise BadInput(path, f"the frame at byte {at} is torn (incomplete write)")
    torn.append(f"{path}: the frame at byte {at} is torn (incomplete write), ignored")


def _decode(path: Path, at: int, stored: bytes, size: int, crc: int) -> bytes:
    try:
        data = pa.Codec(CODEC).decompress(stored, decompressed_size=size, asbytes=True)
    except (pa.ArrowException, OSError, ValueError):
        data = None
    if data is None or len(data) != size or zlib.crc32(data) != crc:
        raise BadInput(path, f"the frame at byte {at} does not decompress to the lines it states")
    return data
