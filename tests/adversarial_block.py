"""Crafted blocks aimed at each size, length, offset and index the compiled block decoder (store/blockdecode.py,
the C kernels) reads from a step's bytes: a real step of the writer's, its header fields and buffers
rewritten to extreme values (0, -1, 2^31 - 1, 2^32, 2^61, 2^62, 2^63 - 1: the ones whose products wrap
int64) and its LZ4 frames replaced by frames that break the format's rules. Each case's outcome is held to
the pyarrow path's: the kernel declines, or gives the batch the pyarrow path gives; never a crash (or an
AddressSanitizer report, in a build with it), or a batch where the pyarrow path refuses.

`python tests/adversarial_block.py DIR [FIRST]` runs the cases from FIRST on, a line per case (START before
it, flushed, so that a crash names its case); tests/test_block_adversarial.py runs it.
"""

from __future__ import annotations

import random
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).parent))

from test_block_compiled import _outcome, _random_steps, _same  # noqa: E402
from test_block_decode import _steps  # noqa: E402
from test_trajectory_format import write_v2  # noqa: E402

from disttrace.store import blockdecode as b  # noqa: E402
from disttrace.store import trajectory_decode  # noqa: E402

_LZ4 = pa.Codec("lz4")
_FRAME_HEADER = bytes([0x04, 0x22, 0x4D, 0x18, 0x60, 0x40, 0x82])


def _get(data, at: int) -> int:
    return int.from_bytes(data[at : at + 8], "little", signed=True)


def _put(data: bytearray, at: int, value: int) -> None:
    data[at : at + 8] = (value % (1 << 64)).to_bytes(8, "little")


@dataclass
class Msg:
    """One message: its header (the writer's, its varying values editable) and its buffers, each None
    (empty), ("plain", bytes) (emitted stored as it is) or ("raw", bytes) (emitted exactly: the 8-byte
    declared size and an LZ4 frame, as crafted)."""

    m: int  # 0: the dictionary, 1: the record batch
    header: bytearray
    buffers: list = field(default_factory=list)
    body: int | None = None  # a body length to declare instead of the real one

    def node(self, k: int, length: int | None = None, nulls: int | None = None) -> None:
        q = b._POS[self.m, 3] + 16 * k
        if length is not None:
            _put(self.header, q, length)
        if nulls is not None:
            _put(self.header, q + 8, nulls)

    def node_of(self, k: int) -> tuple[int, int]:
        q = b._POS[self.m, 3] + 16 * k
        return _get(self.header, q), _get(self.header, q + 8)

    def length(self, value: int) -> None:
        _put(self.header, b._POS[self.m, 2], value)

    def emit(self, descriptors: dict | None = None) -> bytes:
        body = bytearray()
        header = bytearray(self.header)
        for k, buf in enumerate(self.buffers):
            q = b._POS[self.m, 4] + 16 * k
            if buf is None:
                _put(header, q, len(body))
                _put(header, q + 8, 0)
                continue
            kind, data = buf
            raw = (b"\xff" * 8 + data) if kind == "plain" else data
            _put(header, q, len(body))
            _put(header, q + 8, len(raw))
            body += raw + b"\0" * (-len(raw) % 8)
        for k, (off, ln) in (descriptors or {}).items():
            q = b._POS[self.m, 4] + 16 * k
            _put(header, q, off)
            _put(header, q + 8, ln)
        _put(header, b._POS[self.m, 1], len(body) if self.body is None else self.body)
        return bytes(header + body)


def _parse(step: bytes, m: int, at: int) -> tuple[Msg, int]:
    size = int(b._POS[m, 0])
    header = bytearray(step[at : at + size])
    body = _get(header, b._POS[m, 1])
    start = at + size
    msg = Msg(m, header)
    for k in range(b._DICT_BUFFERS if m == 0 else b._BUFFERS):
        q = b._POS[m, 4] + 16 * k
        off, ln = _get(header, q), _get(header, q + 8)
        if ln == 0:
            msg.buffers.append(None)
            continue
        d = _get(step, start + off)
        data = step[start + off + 8 : start + off + ln]
        if d != -1:
            data = _LZ4.decompress(data, decompressed_size=d).to_pybytes()
        msg.buffers.append(("plain", data))
    return msg, start + body


def parse(step: bytes) -> tuple[bytes, Msg, Msg]:
    """A step as (its schema message or b"", its dictionary, its record batch)."""
    skip = len(b._SCHEMA_MESSAGE)
    prefix = step[:skip] if step[:skip] == b._SCHEMA_MESSAGE else b""
    d, at = _parse(step, 0, len(prefix))
    r, end = _parse(step, 1, at)
    assert end == len(step)
    return prefix, d, r


def good_block(tmp: Path) -> list[bytes]:
    path = tmp / "rank-00000.arrows"
    rng = random.Random(11)
    return [d for d, _ in _steps(path, write_v2(path, _random_steps(rng, 3)))[1:]]


# ---------------------------------------------------------------- LZ4 frames as crafted


def frame(*blocks: bytes, end: bool = True) -> bytes:
    out = bytearray(_FRAME_HEADER)
    for blk in blocks:
        out += len(blk).to_bytes(4, "little") + blk
    if end:
        out += b"\0\0\0\0"
    return bytes(out)


def _ext(n: int) -> bytes:  # an LZ4 length's extension bytes for n (what is above 15)
    return b"\xff" * (n // 255) + bytes([n % 255])


def bomb_block() -> bytes:
    """A 64 KiB block from ~270 bytes: a literal, a match of offset 1 repeating it, five last literals."""
    ml = (1 << 16) - 1 - 5
    return bytes([0x1F]) + b"A" + b"\x01\x00" + _ext(ml - 4 - 15) + bytes([0x50]) + b"BBBBB"


def raw_buffer(declared: int, frame_bytes: bytes) -> tuple[str, bytes]:
    return ("raw", (declared % (1 << 64)).to_bytes(8, "little") + frame_bytes)


# ---------------------------------------------------------------- the cases

_EXTREMES = (0, -1, (1 << 31) - 1, 1 << 32, 1 << 61, 1 << 62, (1 << 63) - 1)
_CHILD = (13, 15, 18, 21)
_VALIDITY = (0, 2, 6, 8, 17, 21, 23, 25, 26, 28, 29, 31, 33, 37, 39)  # the batch's nullable bitmaps


def cases(good: list[bytes]):
    """(name, block) pairs: the first step of a good block rewritten, the rest as written."""

    def with_first(fn, at=0):
        prefix, d, r = parse(good[at])
        out = fn(d, r)
        step = prefix + (out if isinstance(out, bytes) else d.emit() + r.emit())
        return [*good[:at], step, *good[at + 1 :]]

    yield "reemitted, every buffer stored", with_first(lambda d, r: None)

    # the batch's length and every node's: products of length and a width wrap int64
    for L in _EXTREMES:

        def lengths(d, r, L=L):  # no nulls anywhere (no bitmap to size), the sketches' children 4 L
            r.length(L)
            for k in range(b._NODES):
                r.node(k, nulls=0)
                if k in (13, 15):
                    r.node(k, length=(4 * L + (1 << 63)) % (1 << 64) - (1 << 63))
                elif k not in _CHILD:
                    r.node(k, length=L)
            for k in _VALIDITY:
                r.buffers[k] = None

        yield f"batch length {L}", with_first(lengths)

    # the dictionary's length (4 (dn + 1) wraps at 2^62 - 1) and its values' count (8 dv wraps at 2^61)
    for dn in (0, -1, (1 << 31) - 1, (1 << 62) - 1, (1 << 63) - 1):

        def dict_length(d, r, dn=dn):
            d.length(dn)
            d.node(0, length=dn)

        yield f"dictionary length {dn}", with_first(dict_length)
    for dv in (1 << 61, (1 << 62) + 1, (1 << 63) - 1):

        def dict_values(d, r, dv=dv):  # and an entry's offsets past the values there are
            d.node(1, length=dv)
            n = d.node_of(0)[0]
            d.buffers[1] = ("plain", b"".join(i.to_bytes(4, "little") for i in [0] * n + [1 << 20]))

        yield f"dictionary values {dv}, an entry past them", with_first(dict_values)

    # samples' and shard's child counts (8 cl wraps at 2^61), their offsets past the values there are
    for k, vb in ((17, 33), (20, 39)):
        for cl in (1 << 61, (1 << 62) + 1):

            def lists(d, r, k=k, vb=vb, cl=cl):
                n = r.node_of(0)[0]
                r.node(k + 1, length=cl)
                r.node(k, nulls=0)
                r.buffers[vb] = None
                r.buffers[vb + 1] = (
                    "plain",
                    b"".join(
                        i.to_bytes(4, "little") for i in range(0, 2 * (n + 1) * 4096, 2 * 4096)
                    ),
                )

            yield f"list node {k} child count {cl}, offsets past its values", with_first(lists)
            yield f"list node {k} child count {cl}, the last step", with_first(lists, len(good) - 1)

    # a string view's size and the tensor's offsets past their data (controls: checked)
    def tensor_past(d, r):
        n = r.node_of(0)[0]
        r.buffers[11] = (
            "plain",
            b"".join(i.to_bytes(4, "little") for i in range(0, 1000 * (n + 1), 1000)),
        )

    yield "tensor offsets past its data", with_first(tensor_past)
    for x in (-1, 32767, -32768):

        def index(d, r, x=x):
            n = r.node_of(0)[0]
            r.buffers[16] = ("plain", (x % (1 << 16)).to_bytes(2, "little") * n)

        yield f"shape index {x}", with_first(index)

    # the body's length, a buffer's offset and length
    for body in (-1, -8, 1 << 32, (1 << 63) - 8):

        def body_len(d, r, body=body):
            r.body = body

        yield f"body length {body}", with_first(body_len)
    for off, ln in ((-8, 16), ((1 << 63) - 8, 16), (0, (1 << 63) - 1), (8, -8), (1 << 32, 16)):
        yield (
            f"buffer at {off} of {ln}",
            with_first(lambda d, r, off=off, ln=ln: d.emit() + r.emit({1: (off, ln)})),
        )

    # a buffer's declared size: (d + 255) >> 8 wraps near 2^63, and two such sizes sum to a small one
    bomb = frame(*[bomb_block()] * 512)  # 32 MiB from ~140 KiB
    for declared in (0, -2, 1 << 32, (1 << 63) - 1, (1 << 63) - 8):
        yield (
            f"declared size {declared}",
            with_first(
                lambda d, r, declared=declared: _set(
                    r, 1, raw_buffer(declared, frame(bomb_block()))
                )
            ),
        )

    def two_wrapping(d, r):  # two buffers of 2^63 - 8 declared: their sum wraps to -16
        r.buffers[1] = raw_buffer((1 << 63) - 8, bomb)
        r.buffers[3] = raw_buffer((1 << 63) - 8, frame(bomb_block()))

    yield "two declared sizes that wrap, a 32 MiB frame", with_first(two_wrapping)

    # LZ4 frames that break the format's rules, for the step's first data buffer (its 4 n bytes)
    def lz4(name, *blocks, end=True, declared=None):
        def fn(d, r):
            size = len(r.buffers[1][1])
            r.buffers[1] = raw_buffer(
                size if declared is None else declared, frame(*blocks, end=end)
            )

        return name, with_first(fn)

    # controls: the same bytes in other valid frames decode as pyarrow reads them
    def stored_frame(d, r):
        data = r.buffers[1][1]
        r.buffers[1] = (
            "raw",
            len(data).to_bytes(8, "little")
            + _FRAME_HEADER
            + ((1 << 31) | len(data)).to_bytes(4, "little")
            + data
            + b"\0\0\0\0",
        )

    yield "a frame of one stored block", with_first(stored_frame)

    def literal_frame(d, r):
        data = r.buffers[1][1]
        r.buffers[1] = raw_buffer(len(data), frame(bytes([0xF0]) + _ext(len(data) - 15) + data))

    yield "a frame of literals only", with_first(literal_frame)

    tail = bytes([0x50]) + b"BBBBB"
    yield lz4("match offset 0", bytes([0x14]) + b"A" + b"\0\0" + tail)
    yield lz4("match offset past the output", bytes([0x14]) + b"A" + b"\x02\x00" + tail)
    yield lz4("match offset 65535", bytes([0x14]) + b"A" + b"\xff\xff" + tail)
    yield lz4("match into the previous block", bomb_block(), bytes([0x04]) + b"\x10\x00" + tail)
    yield lz4("literal run of 255s to the end", bytes([0xF0]) + b"\xff" * 200)
    yield lz4("literal run past the input", bytes([0xF0]) + b"\xff" * 3 + b"\x10" + b"A" * 5)
    yield lz4("match run of 255s to the end", bytes([0x1F]) + b"A\x01\x00" + b"\xff" * 200)
    yield lz4("a frame header alone", end=False)
    yield (
        "stored block size 0",
        with_first(
            lambda d, r: _set(
                r, 1, raw_buffer(8, _FRAME_HEADER + (1 << 31).to_bytes(4, "little") + b"\0" * 4)
            )
        ),
    )
    yield (
        "block size 2^32 - 1",
        with_first(
            lambda d, r: _set(r, 1, raw_buffer(8, _FRAME_HEADER + b"\xff\xff\xff\xff" + b"\0" * 4))
        ),
    )
    yield lz4("no end mark", bytes([0x50]) + b"BBBBB", end=False)
    yield lz4("bomb past the declared size", *[bomb_block()] * 4, declared=8)


def _set(r: Msg, k: int, buf) -> None:
    r.buffers[k] = buf


def run(tmp: Path, first: int = 0) -> int:
    """Each case from `first` on: a line naming it and its outcome; the count of bugs found."""
    good = good_block(tmp)
    bugs = 0
    for i, (name, block) in enumerate(cases(good)):
        if i < first:
            continue
        print(f"START {i} {name}", flush=True)
        try:
            status = b.kernel_status(block)
            got = b.decode(block)
        except Exception:
            print(f"BUG {i} {name}: the kernel raised\n{traceback.format_exc()}", flush=True)
            bugs += 1
            continue
        want = _outcome(trajectory_decode._decode_block, block)
        if got is None:
            verdict = f"declined ({b.DECLINED.get(status, status)})"
        elif not isinstance(want, tuple):
            verdict = f"BUG: a batch where the pyarrow path refuses: {want}"
        elif not (_same(got[0], want[0]) and got[1].tolist() == want[1].tolist()):
            verdict = "BUG: a batch other than the pyarrow path's"
        else:
            verdict = "decoded as the pyarrow path"
        bugs += verdict.startswith("BUG")
        pyarrow = "decodes" if isinstance(want, tuple) else f"refuses: {str(want)[:80]}"
        print(f"DONE {i} {name}: {verdict}; pyarrow {pyarrow}", flush=True)
    return bugs


if __name__ == "__main__":
    sys.exit(1 if run(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0) else 0)
