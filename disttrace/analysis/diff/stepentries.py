"""One rank's step index as diff's sides keep it (analysis/diff/side.py): the fields diff reads, in arrays,
and the questions diff asks of them by step."""

from __future__ import annotations

import re
from array import array
from collections.abc import Mapping

import numpy as np
import xxhash

from disttrace.analysis.paged import Paged
from disttrace.store import seal

_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX = re.compile(r"[0-9a-f]*")


class StepEntries(Mapping):
    """One rank's step index as a side keeps it: the fields diff reads (offset, length, records, the digest of
    digests, the step's xxh3, its sha256 where no xxh3 was written) in arrays, ~64 bytes a step. The lines as
    parsed are ~1 KB a step (the chain and the times are checked on reading and not needed after): held for
    every rank, they were what a diff's memory grew by with the number of steps.

    Readers ask for what they read, by step (`span`, `records`, `same_digest`, `hash_match`): nothing is built
    per call but the answer. As a Mapping, step -> the entry as a dict of those fields (`line`).

    An index of more than SPILL_STEPS steps is written out to a temporary file (analysis/paged.py) in pages of
    PAGE steps, and the last two pages read are held: what a side holds of every rank's index is
    then a few KB a rank whatever the number of steps (a diff reads a rank's steps in order, a block at a
    time)."""

    SPILL_STEPS = 256
    PAGE = 64

    __slots__ = ("_first", "_steps", "_n", "_cols", "_odd")

    def __init__(self, entries: dict[int, dict]):
        steps = sorted(entries)
        n = len(steps)
        contiguous = n > 0 and steps[-1] - steps[0] == n - 1
        self._first = steps[0] if contiguous else None
        self._steps = None if contiguous else np.array(steps, dtype=np.int64)
        # what the arrays cannot hold exactly, by (row, field): a record count that is not a count (-1 in the
        # array), a digest or xxh3 that is not 32 lowercase hex digits, a sha256 (lines without an xxh3)
        self._odd: dict[tuple[int, str], object] = {}
        lines = [entries[s] for s in steps]
        if not self._plain(lines):
            self._fill(lines)

    def _plain(self, lines: list[dict]) -> bool:
        """The arrays of lines as the writer writes them (each record count an int >= 0, each digest and xxh3
        32 lowercase hex digits), filled column by column: one check and one conversion a field for all the
        lines instead of a few calls a line. False (nothing set) for anything else, which _fill takes."""
        n = len(lines)
        counts = [e.get("records") for e in lines]
        digests = [e.get("digest") for e in lines]
        xxh3s = [e.get("xxh3") for e in lines]
        if set(map(type, counts)) - {int} or (n and min(counts) < 0):
            return False
        for col in (digests, xxh3s):
            if set(map(type, col)) - {str} or set(map(len, col)) - {32}:
                return False
        hexes = "".join(digests) + "".join(xxh3s)
        if not _HEX.fullmatch(hexes):
            return False
        blob = bytes.fromhex(hexes)
        self._hold(
            array("q", [e["offset"] for e in lines]),
            array("q", [e["length"] for e in lines]),
            array("q", counts),
            blob[: 16 * n],
            blob[16 * n :],
        )
        return True

    def _fill(self, lines: list[dict]) -> None:
        """The arrays line by line, each field that they cannot hold exactly kept in _odd."""
        n = len(lines)
        offsets, lengths, counts = [], [], []
        digest, xxh3 = bytearray(16 * n), bytearray(16 * n)
        for row, e in enumerate(lines):
            offsets.append(e["offset"])
            lengths.append(e["length"])
            records = e.get("records")
            if isinstance(records, int) and not isinstance(records, bool) and records >= 0:
                counts.append(records)
            else:
                counts.append(-1)
                if records is not None:
                    self._odd[row, "records"] = records
            for key, blob in (("digest", digest), ("xxh3", xxh3)):
                v = e.get(key)
                if isinstance(v, str) and _HEX32.fullmatch(v):
                    blob[16 * row : 16 * row + 16] = bytes.fromhex(v)
                else:
                    self._odd[row, key] = v
            if e.get("xxh3") is None and e.get("sha256") is not None:
                self._odd[row, "sha256"] = e["sha256"]
        self._hold(
            array("q", offsets), array("q", lengths), array("q", counts), bytes(digest), bytes(xxh3)
        )

    def _hold(self, offsets: array, lengths: array, counts: array, digest: bytes, xxh3: bytes):
        """The columns kept: offset, length, records (Python arrays, not numpy: as compact, and one element
        is read ~5x faster; diff reads one at a time), digest and xxh3 (16 bytes a row), paged past
        SPILL_STEPS rows."""
        self._n = len(offsets)
        self._cols = Paged(
            [offsets, lengths, counts, digest, xxh3], self._n, self.SPILL_STEPS, self.PAGE
        )

    def _page(self, row: int):
        """The columns of the page holding the row (offset, length, records, digest, xxh3), and the row's
        place in it."""
        return self._cols.page(row)

    def _row(self, step) -> int | None:
        if not isinstance(step, int):
            return None
        if self._first is not None:
            row = step - self._first
            return row if 0 <= row < self._n else None
        if self._steps is None:
            return None
        row = int(np.searchsorted(self._steps, step))
        return row if row < len(self._steps) and self._steps[row] == step else None

    def _held(self, step) -> int:
        row = self._row(step)
        if row is None:
            raise KeyError(step)
        return row

    def span(self, step: int) -> tuple[int, int]:
        """The step's byte range in the trajectory: (offset, length)."""
        p, at = self._page(self._held(step))
        return p[0][at], p[1][at]

    def _count(self, row: int):
        p, at = self._page(row)
        n = p[2][at]
        return n if n >= 0 else self._odd.get((row, "records"))

    def records(self, step: int):
        """The step's record count as its line states it (None: not stated, or no such step)."""
        row = self._row(step)
        return None if row is None else self._count(row)

    def _hash(self, row: int, key: str):
        """A 16-byte hash of the row (digest or xxh3), or what the line held instead (kept as it was)."""
        if self._odd and (row, key) in self._odd:
            return self._odd[row, key]
        p, at = self._page(row)
        return p[3 if key == "digest" else 4][16 * at : 16 * at + 16]

    def same_digest(self, step: int, other: StepEntries) -> bool:
        """Both hold the step, their lines state a digest of digests and a record count, and both are equal:
        the step is skipped if its bytes are the same too. A digest held as bytes (lowercase hex on the line)
        never equals one kept as it was (any other value), as their lines' strings never did."""
        row, o_row = self._row(step), other._row(step)
        if row is None or o_row is None:
            return False
        if (
            not self._odd and not other._odd
        ):  # every field as the arrays hold it: compare them there
            p, at = self._page(row)
            o, o_at = other._page(o_row)
            return (
                p[2][at] == o[2][o_at]
                and p[3][16 * at : 16 * at + 16] == o[3][16 * o_at : 16 * o_at + 16]
            )
        mine, theirs = self._hash(row, "digest"), other._hash(o_row, "digest")
        return (
            mine is not None
            and isinstance(mine, bytes) == isinstance(theirs, bytes)
            and mine == theirs
            and self._count(row) == other._count(o_row)
        )

    def hash_match(self, step: int, data: bytes) -> bool | None:
        """Whether `data` (the step's bytes) hash to the line's xxh3 (or sha256); None: it holds neither."""
        row = self._held(step)
        p, at = self._page(row)
        return seal.step_data_match_hashes(
            data,
            p[1][at],
            self._hash(row, "xxh3"),
            self._odd.get((row, "sha256")) if self._odd else None,
        )

    def hash_matches(self, steps: list[int], datas: list[bytes]) -> list[bool | None]:
        """hash_match of each step with its bytes, in one pass (a block's steps: the per-call lookups were a
        good part of what reading a small step costs)."""
        if self._odd:
            return [self.hash_match(s, d) for s, d in zip(steps, datas)]
        out: list[bool | None] = []
        digest = xxhash.xxh3_128_digest
        for step, data in zip(steps, datas):
            p, at = self._page(self._held(step))
            out.append(len(data) == p[1][at] and digest(data) == p[4][16 * at : 16 * at + 16])
        return out

    def line(self, step: int) -> dict:
        """The step's entry as a dict of the fields kept: step, offset, length, records, digest, xxh3 (hex, or
        what the line held), sha256."""
        row = self._held(step)
        p, i = self._page(row)
        records, odd, at = p[2][i], self._odd, 16 * i
        return {
            "step": step,
            "offset": p[0][i],
            "length": p[1][i],
            "records": records if records >= 0 else odd.get((row, "records")),
            "digest": odd[row, "digest"] if (row, "digest") in odd else p[3][at : at + 16].hex(),
            "xxh3": odd[row, "xxh3"] if (row, "xxh3") in odd else p[4][at : at + 16].hex(),
            "sha256": odd.get((row, "sha256")),
        }

    def __getitem__(self, step: int) -> dict:
        return self.line(step)

    def __iter__(self):
        if self._first is not None:
            return iter(range(self._first, self._first + self._n))
        return iter(self._steps.tolist() if self._steps is not None else ())

    def __len__(self) -> int:
        return self._n

    def __contains__(self, step) -> bool:
        return self._row(step) is not None
