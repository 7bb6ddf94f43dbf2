"""The trajectory's own format limits (store/trajectory.py), against pyarrow's reader as the oracle."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from disttrace.errors import BadInput
from disttrace.store import trajectory


def _records(n: int) -> list[dict]:
    return [{"step": 1, "micro_batch": 0, "phase": "optimizer", "rank": 0, "index": i, "tensor": f"w{i}",
             "dtype": "float32", "shape": [4], "numel": 4, "digest": f"{i:032x}", "sum": 0.0, "norm": 0.0,
             "sketch": [0.0] * 4, "nonfinite": 0} for i in range(n)]


def test_a_large_step_of_constant_columns_decodes(tmp_path):
    """5,000 records whose null float64 sketches are 160 KB of zeros: LZ4 compresses them near its limit,
    and the reader's check of declared sizes must still let our own writer's step through."""
    w = trajectory.TrajectoryWriter(tmp_path / "rank-00000.arrows")
    data = w.write_step(_records(5000))
    w.close()
    ours = trajectory.decode_step(tmp_path, data, "step 1")
    theirs = ipc.open_stream(data).read_next_batch()
    assert ours.equals(theirs) and ours.num_rows == 5000


def test_a_zstd_step_is_refused():
    batch = pa.RecordBatch.from_arrays(trajectory._columns(_records(1000)), schema=trajectory.SCHEMA)
    sink = pa.BufferOutputStream()
    w = ipc.new_stream(sink, trajectory.SCHEMA, options=ipc.IpcWriteOptions(compression="zstd"))
    w.write_batch(batch)
    w.close()
    data = sink.getvalue().to_pybytes()
    assert ipc.open_stream(data).read_next_batch().num_rows == 1000  # a valid Arrow stream
    with pytest.raises(BadInput, match="zstd"):
        trajectory.decode_step(Path("x.arrows"), data, "step 1")
