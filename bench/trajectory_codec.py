"""The trajectory's compression choice (store/trajectory.py): bytes per record and time to decode one step,
for no compression, LZ4 and zstd, on the same records (decoded by pyarrow's own stream reader, so the
codec is all that differs; disttrace's reader adds its schema and size checks to every codec alike) (bench/diff_speed.py's 1,000-record steps), in one run.

    .venv/bin/python bench/trajectory_codec.py [--steps 100] [--records 1000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from diff_speed import step_records  # noqa: E402

from disttrace.store import trajectory, trajectory_write  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--records", type=int, default=1000)
    args = ap.parse_args()
    batches = [
        pa.RecordBatch.from_arrays(
            trajectory_write._columns(step_records(s, 0, args.records)), schema=trajectory.SCHEMA
        )
        for s in range(1, args.steps + 1)
    ]
    n = args.steps * args.records
    for codec in (None, "lz4", "zstd"):
        steps = []
        for b in batches:  # each step's bytes on their own, as the step index addresses them
            sink = pa.BufferOutputStream()
            w = ipc.new_stream(
                sink,
                trajectory.SCHEMA,
                options=ipc.IpcWriteOptions(compression=codec, use_threads=False),
            )
            w.write_batch(b)
            w.close()
            steps.append(sink.getvalue().to_pybytes())
        size = sum(len(x) for x in steps)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for x in steps:  # the codec's own cost: pyarrow's reader, the same for all three
                ipc.open_stream(x, options=ipc.IpcReadOptions(use_threads=False)).read_next_batch()
            best = min(best, (time.perf_counter() - t) / len(steps))
        print(
            f"{codec or 'none':>5}: {size / n:6.1f} bytes per record (schema and end marker included per step), "
            f"{best * 1e3:6.3f} ms to decode a {args.records}-record step (best of 3)"
        )


if __name__ == "__main__":
    main()
