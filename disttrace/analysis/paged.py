"""Columns of a reader's per-step tables (a rank's step index) that do not grow its memory with the steps: a
table of more than `spill` rows is written to a temporary file (one a process) in pages, and the last two pages
read are held. The readers read a rank's steps in order, a block at a time, so a page is read back about once."""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from array import array


class Paged:
    """Rows of fixed-width columns: each an `array('q')` (8 bytes a row) or a bytes blob of `w` bytes a row.
    `page(row)` gives (the columns of the page that holds the row, the row's place in it): the whole table
    where it is held, else a page read back. Safe from a second thread (a read-ahead's): the pages held are one
    tuple, replaced whole; two threads racing at most read a page twice."""

    __slots__ = ("_n", "_widths", "_whole", "_spill", "_at", "_size", "_p0", "_p1")

    def __init__(self, columns: list, n: int, spill: int, page: int):
        self._n = n
        # (bytes a row, whether an array('q')) of each column
        self._widths = [
            (8, True) if isinstance(c, array) else (len(c) // n if n else 0, False) for c in columns
        ]
        self._p0 = self._p1 = None
        self._size = page
        if n > spill:
            self._whole, self._spill = None, _Spill.current()
            self._at = self._spill.write(columns, self._widths, n, page)
        else:
            self._whole, self._spill, self._at = tuple(columns), None, 0

    def __len__(self) -> int:
        return self._n

    @property
    def held(self) -> bool:
        """Whether the whole table is in memory (no pages written out)."""
        return self._whole is not None

    def page(self, row: int) -> tuple[tuple, int]:
        if self._whole is not None:
            return self._whole, row
        no, at = divmod(row, self._size)
        got = self._p0
        if got is None or got[0] != no:
            got = self._p1
            if got is None or got[0] != no:
                first = no * self._size
                n = min(self._size, self._n - first)
                got = (no, self._spill.read(self._at, first, n, self._widths))
            self._p0, self._p1 = got, self._p0
        return got[1], at


class _Spill:
    """The temporary file of this process's paged tables, each page's columns one after another, read back with
    pread. One a process while any table holds it (closed with the last); a forked process writes its own (a
    file shared with its parent would take both processes' pages at the same offsets)."""

    _live: weakref.ref | None = None
    _making = threading.Lock()

    def __init__(self):
        self._file = tempfile.TemporaryFile(prefix="disttrace-paged-")
        self._fd = self._file.fileno()
        self._end = 0
        self._writing = threading.Lock()
        self._pid = os.getpid()

    @classmethod
    def current(cls) -> _Spill:
        with cls._making:
            got = cls._live() if cls._live is not None else None
            if got is None or got._pid != os.getpid():
                got = cls()
                cls._live = weakref.ref(got)
            return got

    def write(self, columns: list, widths: list[tuple[int, bool]], n: int, page: int) -> int:
        """The table's rows in pages of `page` rows; where they begin in the file."""
        parts = []
        for a in range(0, n, page):
            z = min(a + page, n)
            for c, (w, is_array) in zip(columns, widths):
                parts.append(c[a:z].tobytes() if is_array else bytes(c[w * a : w * z]))
        data = b"".join(parts)
        with self._writing:
            at, self._end = self._end, self._end + len(data)
        os.pwrite(self._fd, data, at)
        return at

    def read(self, at: int, first: int, n: int, widths: list[tuple[int, bool]]) -> tuple:
        """The page of n rows from row `first` (a multiple of the page size) of the table written at `at`."""
        row = sum(w for w, _ in widths)
        data = os.pread(self._fd, row * n, at + row * first)
        if len(data) != row * n:  # this process's own file: short only if the disk failed it
            raise OSError(f"paged table: {len(data)} of {row * n} bytes read back")
        out, i = [], 0
        for w, is_array in widths:
            out.append(array("q", data[i : i + w * n]) if is_array else data[i : i + w * n])
            i += w * n
        return tuple(out)
