"""Reading the next blocks of a diff in a second thread while this one compares the current block.

A numeric diff of small steps spends about half its time reading, hash-checking and decoding (safeio's reads,
xxh3, Arrow's LZ4 decompression and validation, all of which release the GIL) and the other half comparing
(numpy over whole columns, which releases it in its loops). On two cores the two halves overlap: the wall time
falls towards the larger half; the CPU time stays what it was (docs/benchmarks.md has both).

What is read ahead is only what the comparison will certainly read (a diff that propagates over every later
step reads every block), in the order it would read it, and each job's result, or what it raised, is handed
back in that order: whatever the comparison sees, and the first refusal it meets, are those of reading one
block after another.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

DEPTH = 2  # jobs in flight: each holds a block's decoded columns of both sides (a few MB)


_enabled = True  # off in the processes of `diff --jobs N`: they already use the cores


# records a rank-step below which a block decoded by the C kernels is read in the comparing thread: the
# reading is then mostly Python (the decode itself ~25 us a step of 150 records), which the GIL serialises with
# the comparison, so a second thread only adds its contention (at 150 records a step, 12% more CPU and no wall
# time gained; at 1,000, where the decode is ~170 us a step outside the GIL, 0.8-0.9x the wall time alone;
# docs/benchmarks.md, "The block decoder in C")
NATIVE_MIN_RECORDS = 400


def worth_it(records_per_rank_step: float | None = None, native: bool = False) -> bool:
    """A second thread pays where there is a second core this process may run on and nothing else of this diff
    uses it: the thread costs about 15% more CPU time for its wall-time gain (docs/benchmarks.md); with the
    C decoder (`native`) only for steps of NATIVE_MIN_RECORDS records a rank or more."""
    if not _enabled:
        return False
    if native and records_per_rank_step is not None and records_per_rank_step < NATIVE_MIN_RECORDS:
        return False
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (cpus or 1) > 1


def disable() -> None:
    """No second thread in this process (a process pool's initializer)."""
    global _enabled
    _enabled = False


@contextmanager
def disabled():
    """No second thread in this process while the block runs."""
    global _enabled
    was, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = was


class ReadAhead:
    """`jobs` yields (key, fn): fn() runs in a second thread, up to DEPTH jobs ahead of the one taken; take(key)
    hands back the next job's result (its key must be the one asked for) or raises what it raised."""

    def __init__(self, jobs: Iterator[tuple[Any, Callable[[], Any]]]):
        self._jobs = jobs
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="disttrace-read")
        self._pending: deque[tuple[Any, Future]] = deque()
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < DEPTH:
            job = next(self._jobs, None)
            if job is None:
                return
            key, fn = job
            self._pending.append((key, self._pool.submit(fn)))

    def take(self, key) -> Any:
        if not self._pending or self._pending[0][0] != key:
            raise RuntimeError(
                f"read ahead out of order: {key!r} asked for"
            )  # a bug here, not input
        _, fut = self._pending.popleft()
        try:
            return fut.result()
        finally:
            self._fill()

    def close(self) -> None:
        """Wait for the jobs in flight (nothing of theirs outlives the comparison) and stop the thread."""
        for _, fut in self._pending:
            fut.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)
