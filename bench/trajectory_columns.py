"""Where a trajectory's bytes go: for one rank's Arrow stream of a run, the bytes per record each column
costs (the stream rewritten without it, LZ4 as stored), and what one batch for all steps or no compression
would store. The baseline is the same stream rewritten by pyarrow in the same run, one stream per step as
the writer does (a step's bytes carry its own dictionary; the schema message counts once, in the first).

    python bench/trajectory_columns.py RUN [--rank 0]

Guides the bytes-per-record target: a step's batch must decode on its own, so whatever repeats
across steps (tensor names, the shape dictionary, each column's Arrow metadata and LZ4 frame) is paid every
step. Reads either layout (v1: store/trajectory.py's SCHEMA; v2: SCHEMA_V2) as the file holds it.
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
    """Bytes of a stream holding these batches, each written by a stream of its own (as TrajectoryWriter
    does) with the schema message counted once and one end-of-stream marker."""
    total = 0
    for i, b in enumerate(batches):
        sink = io.BytesIO()
        w = ipc.new_stream(
            sink, schema, options=ipc.IpcWriteOptions(compression=compression, use_threads=False)
        )
        w.write_batch(b)
        data = sink.getvalue()
        if i:
            r = pa.BufferReader(data)
            ipc.read_message(r)
            data = data[r.tell() :]
        total += len(data)
    return total + 8


def plain(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Dictionary columns decoded (pyarrow cannot unify dictionaries of lists across batches)."""
    cols = [
        c.dictionary.take(c.indices) if pa.types.is_dictionary(c.type) else c for c in batch.columns
    ]
    return pa.RecordBatch.from_arrays(cols, names=batch.schema.names)


def main():
    from disttrace.store.rundir import rank_file
    from disttrace.store.trajectory import SUFFIX

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run", type=Path)
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    path = args.run / rank_file("trajectory", args.rank, SUFFIX)
    data = path.read_bytes()
    reader = ipc.open_stream(
        data
    )  # a bench on your own run: pyarrow's reader, not the hardened one
    batches, schema = list(reader), reader.schema
    n = sum(b.num_rows for b in batches)
    base = stored(batches, schema)
    print(
        f"{path}: {n} records in {len(batches)} steps, {len(data) / n:.1f} bytes per record "
        f"(rewritten: {base / n:.1f})"
    )
    for name in schema.names:
        i = schema.get_field_index(name)
        print(
            f"  {name:14s} {(base - stored([b.remove_column(i) for b in batches], schema.remove(i))) / n:6.1f}"
        )
    one = pa.concat_batches([plain(b) for b in batches])
    print(
        f"  one batch for all steps: {stored([one], one.schema) / n:.1f}; "
        f"uncompressed: {stored(batches, schema, None) / n:.1f} bytes per record"
    )


if __name__ == "__main__":
    main()
