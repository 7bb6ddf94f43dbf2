"""Per-step wall times, kept on every run whether it records evidence or not (`record.enabled = false` is
the unrecorded baseline a benchmark compares with, and it still needs its step times).

One line per step in `steps/rank-NNNNN.jsonl`: {"step", "start", "end", "seconds"}. A file of its own
(not the trajectory's step index) so it exists when nothing else is recorded. The clock listens first at
`step_start` and last at `step_end`: the recorder's, the trace's and the checkpoint's work are inside.
"""

from __future__ import annotations

import time
from pathlib import Path

from disttrace.run.job.hooks import HookBus
from disttrace.store.rundir import rank_file
from disttrace.store.writers import JsonlWriter

STEP_TIMES = "steps"  # the run-store folder


class StepClock:
    FIRST, LAST = -1000, 1000  # hook orders: around every other listener

    def __init__(self, run_dir: Path, rank: int):
        self.out = JsonlWriter(Path(run_dir) / rank_file(STEP_TIMES, rank))
        self._start = 0.0
        self._t0 = 0.0

    def attach(self, bus: HookBus) -> StepClock:
        bus.on("step_start", self._step_start, self.FIRST)
        bus.on("step_end", self._step_end, self.LAST)
        return self

    def _step_start(self, bus, p):
        self._start = time.time()
        self._t0 = (
            time.perf_counter()
        )  # the duration from a monotonic clock; start/end for timelines

    def _step_end(self, bus, p):
        seconds = time.perf_counter() - self._t0
        self.out.write(
            {"step": bus.step, "start": self._start, "end": time.time(), "seconds": seconds}
        )
        self.out.flush()

    def close(self):
        self.out.close()
