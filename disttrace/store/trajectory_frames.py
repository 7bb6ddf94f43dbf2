"""A trajectory step's Arrow IPC messages read before anything is decoded (the format: store/trajectory.py):
its layout, that its messages are the ones a step holds, and what its LZ4 buffers declare they decompress to,
held to the bounds below, since a forged size would be allocated whole. `_frame_block` reads a whole block's
headers at once (numpy over the joined bytes); `_frame_steps` reads them message by message."""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from disttrace.store.trajectory import _SCHEMAS, END_OF_STREAM

_STEP_MESSAGES = {1: ["record batch"], 2: ["dictionary", "record batch"]}


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


# an LZ4 frame expands at most ~255-fold (a match length grows by 255 per byte); a compressed buffer that says it
# holds more is forged, and Arrow would allocate the size it says before decompressing
_LZ4_MAX_EXPANSION = 256


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
