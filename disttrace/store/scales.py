"""The magnitudes side file, ``trajectory/rank-N.scales.bin`` (written by run/record/scales.py, read by
analysis/magnitudes.py; docs/format.md, "The magnitudes"): per step, each parameter's accumulated
``||X|| ||dY||`` at each `backward` and `reduce` of the step, and the step's clip scalars where the rank saw
them, as columns a reader takes in one pass (no document to parse per step).

One frame a step, appended and flushed at the step's end, little-endian:

    magic b"DTS1" | step u32 | n u32 | groups u16 | width u8 (4 or 8) | flags u8 (bit 0: clip scalars)
    [grad_norm f64 | clip_coef f64]                     if flags bit 0
    groups x (phase u8 | 3 zero bytes | micro-batch u32 | count u32)   counts sum to n
    n x index u32
    n x magnitude (float32 where width is 4, float64 where 8)

A frame cut short at the end of the file (the process died while writing it) is left out; anything else
that is not a frame (a frame whose length runs past the next frame's start among them) is refused. A step written twice (a resumed run) keeps its last frame. A store written
before this file existed holds ``rank-N.scales.jsonl`` (one JSON document a step); it reads into the same
columns.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from disttrace.errors import BadInput
from disttrace.store import safeio

SUFFIX = ".scales.bin"
LEGACY_SUFFIX = ".scales.jsonl"
PHASES = ("backward", "reduce")  # a frame's phase codes
MAGIC = b"DTS1"
_HEAD = struct.Struct("<4sIIHBB")
_CLIP = struct.Struct("<dd")
_GROUP = np.dtype([("phase", "u1"), ("pad", "V3"), ("mb", "<u4"), ("count", "<u4")])
_WIDTH = {4: np.dtype("<f4"), 8: np.dtype("<f8")}


def encode(
    step: int,
    groups: list[tuple[str, int, np.ndarray, np.ndarray]],
    clip: tuple[float, float] | None,
) -> bytes:
    """One step's frame: `groups` are (phase, micro-batch, indices, magnitudes) in the order they were
    taken; the magnitudes' dtype (float32 or float64) is kept as it is; `clip` the step's (grad_norm,
    clip_coef) where the rank saw them."""
    wide = any(np.asarray(v).dtype == np.float64 for *_, v in groups)
    width = 8 if wide else 4
    head = np.zeros(len(groups), dtype=_GROUP)
    for g, (phase, mb, idx, _) in zip(head, groups):
        g["phase"], g["mb"], g["count"] = PHASES.index(phase), mb, len(idx)
    index = [np.asarray(i, dtype="<u4") for _, _, i, _ in groups]
    value = [np.asarray(v, dtype=_WIDTH[width]) for *_, v in groups]
    n = int(head["count"].sum())
    parts = [_HEAD.pack(MAGIC, step, n, len(groups), width, 1 if clip is not None else 0)]
    if clip is not None:
        parts.append(_CLIP.pack(*clip))
    parts += [head.tobytes(), *(i.tobytes() for i in index), *(v.tobytes() for v in value)]
    return b"".join(parts)


@dataclass
class Scales:
    """One rank's magnitudes as columns, a row per (step, phase, micro-batch, parameter index), each step's
    rows together in the order written; `clip`: step -> (grad_norm, clip_coef) where the frame holds them."""

    step: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    phase: np.ndarray = field(default_factory=lambda: np.empty(0, np.int8))  # index into PHASES
    mb: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    index: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    m: np.ndarray = field(default_factory=lambda: np.empty(0, np.float64))
    clip: dict[int, tuple[float, float]] = field(default_factory=dict)

    def table(self, step: int) -> dict[str, dict[int, dict[int, float]]]:
        """The step's rows as {phase: {micro-batch: {index: magnitude}}} (for a reader that wants one step)."""
        out: dict[str, dict[int, dict[int, float]]] = {}
        at = np.flatnonzero(self.step == step)
        rows = zip(
            self.phase[at].tolist(),
            self.mb[at].tolist(),
            self.index[at].tolist(),
            self.m[at].tolist(),
        )
        for ph, mb, i, v in rows:
            out.setdefault(PHASES[ph], {}).setdefault(mb, {})[i] = v
        return out


def path_of(run_path: Path, rank: int) -> Path | None:
    """The rank's magnitudes file (the binary one, else a JSON-lines one of an older store), None if neither."""
    for suffix in (SUFFIX, LEGACY_SUFFIX):
        p = Path(run_path) / f"trajectory/rank-{rank:05d}{suffix}"
        if p.is_file():
            return p
    return None


def read(path: Path | str, root: Path | str | None = None) -> Scales:
    """A rank's magnitudes file as columns (refused with BadInput where it is not one)."""
    path = Path(path)
    root = path.parent.parent if root is None else root
    data = safeio.read_bytes(path, root, "jsonl")  # inside its run, bounded
    frames = _legacy(path, data) if path.name.endswith(LEGACY_SUFFIX) else _frames(path, data)
    last: dict[int, int] = {}  # a step written twice keeps its last frame, in its first one's place
    for k, f in enumerate(frames):
        last[f[0]] = k
    kept = [frames[k] for k in last.values()]
    out = Scales(clip={f[0]: f[5] for f in kept if f[5] is not None})
    if kept:
        out.step = np.concatenate([np.full(len(f[3]), f[0], np.int64) for f in kept])
        out.phase, out.mb, out.index, out.m = (
            np.concatenate([f[j] for f in kept]).astype(t, copy=False)
            for j, t in ((1, np.int8), (2, np.int64), (3, np.int64), (4, np.float64))
        )
    if len(out.m) and not (np.isfinite(out.m).all() and (out.m >= 0).all()):
        raise BadInput(path, "a magnitude is not a finite number >= 0", field="m")
    return out


def _frames(path: Path, data: bytes) -> list[tuple]:
    """(step, phase, mb, index, m, clip) per frame; a frame cut short at the end is left out."""
    out, at, end = [], 0, len(data)
    view = memoryview(data)
    while end - at >= _HEAD.size:
        magic, step, n, groups, width, flags = _HEAD.unpack_from(data, at)
        if magic != MAGIC or width not in _WIDTH or flags & ~1:
            raise BadInput(path, f"bytes {at}.. are not a magnitudes frame", field="m")
        size = _HEAD.size + (_CLIP.size if flags else 0) + groups * _GROUP.itemsize
        size += n * (4 + width)
        if at + size > end:
            if data.find(MAGIC, at + _HEAD.size) >= 0:  # a frame after it: damage, not a torn end
                raise BadInput(path, f"the frame at byte {at} runs past the next one", field="m")
            break  # torn: the last frame, cut short when the process died
        p = at + _HEAD.size
        clip = None
        if flags:
            clip = _CLIP.unpack_from(data, p)
            p += _CLIP.size
        head = np.frombuffer(view[p : p + groups * _GROUP.itemsize], dtype=_GROUP)
        p += groups * _GROUP.itemsize
        counts = head["count"].astype(np.int64)
        if int(counts.sum()) != n or (head["phase"] >= len(PHASES)).any():
            raise BadInput(path, f"frame at byte {at}: its groups do not add up", field="m")
        index = np.frombuffer(view[p : p + 4 * n], dtype="<u4")
        p += 4 * n
        m = np.frombuffer(view[p : p + width * n], dtype=_WIDTH[width])
        phase, mb = np.repeat(head["phase"], counts), np.repeat(head["mb"], counts)
        out.append((int(step), phase, mb, index, m, clip))
        at += size
    return out


def _legacy(path: Path, data: bytes) -> list[tuple]:
    """The JSON-lines file an older store holds, as frames (no clip scalars: read from the trajectory)."""
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # torn last line: written when the process died
    out = []
    for n, line in enumerate(lines, 1):
        try:
            doc = orjson.loads(line)
            step, m = int(doc["step"]), doc["m"]
            groups = [
                (PHASES.index(str(ph)), int(mb), idx)
                for ph, mbs in m.items()
                for mb, idx in mbs.items()
            ]
            counts = [len(idx) for *_, idx in groups]
            index = np.fromiter((int(i) for *_, idx in groups for i in idx), np.int64, sum(counts))
            value = np.fromiter(
                (float(v) for *_, idx in groups for v in idx.values()), np.float64, sum(counts)
            )
        except (
            orjson.JSONDecodeError,
            KeyError,
            TypeError,
            ValueError,
            AttributeError,
            OverflowError,
        ):
            raise BadInput(path, f"line {n} is not a magnitudes line", field="m") from None
        if not (np.isfinite(value).all() and (value >= 0).all()):
            raise BadInput(path, f"line {n}: a magnitude is not a finite number >= 0", field="m")
        phase = np.repeat(np.array([g[0] for g in groups], np.int8), counts)
        mb = np.repeat(np.array([g[1] for g in groups], np.int64), counts)
        out.append((step, phase, mb, index, value, None))
    return out
