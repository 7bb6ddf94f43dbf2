"""Where a trajectory's bytes go: for one rank's Arrow stream of a run, the bytes per record each column
costs (the stream rewritten without it, LZ4 as stored), and what one batch for all steps or no compression
would store. The baseline is the same stream rewritten by pyarrow in the same run.

    python bench/trajectory_columns.py RUN [--rank 0]

Guides the bytes-per-record target (issue 14): a step's batch must decode on its own (no dictionaries), so
repeated strings (tensor names, phases, dtypes, shapes) are paid every step.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def stored(batches, schema, compression="lz4") -> int:
    sink = io.BytesIO()
    with ipc.new_stream(sink, schema, options=ipc.IpcWriteOptions(compression=compression)) as w:
        for b in batches:
            w.write_batch(b)
    return len(sink.getvalue())


def main():
    from disttrace.store.rundir import rank_file
    from disttrace.store.trajectory import SUFFIX

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    path = args.run / rank_file("trajectory", args.rank, SUFFIX)
    data = path.read_bytes()
    reader = ipc.open_stream(data)  # a bench on your own run: pyarrow's reader, not the hardened one
    batches, schema = list(reader), reader.schema
    n = sum(b.num_rows for b in batches)
    base = stored(batches, schema)
    print(f"{path}: {n} records in {len(batches)} steps, {len(data) / n:.1f} bytes per record "
          f"(rewritten: {base / n:.1f})")
    for name in schema.names:
        i = schema.get_field_index(name)
        print(f"  {name:14s} {(base - stored([b.remove_column(i) for b in batches], schema.remove(i))) / n:6.1f}")
    print(f"  one batch for all steps: {stored([pa.concat_batches(batches)], schema) / n:.1f}; "
          f"uncompressed: {stored(batches, schema, None) / n:.1f} bytes per record")


if __name__ == "__main__":
    main()
