"""A rank's trajectory file read (the format: store/trajectory.py): where it lies, one step by its byte range
(from the step index), every step by a scan without the index, the bytes a crash left after the last indexed
step, and a batch as the recorder's dicts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

from disttrace.errors import BadInput
from disttrace.store import safeio
from disttrace.store.trajectory import _DEVICE_PREFIX, END_OF_STREAM, FIELDS, LEGACY_SUFFIX, SUFFIX
from disttrace.store.trajectory_decode import decode_step, decode_steps
from disttrace.store.trajectory_frames import _check_schema


def trajectory_path(run_path: Path, rank: int) -> Path:
    """This rank's trajectory: the Arrow stream, or a JSON-lines file of a store written before it."""
    base = Path(run_path) / "trajectory" / f"rank-{rank:05d}"
    arrow = base.with_name(base.name + SUFFIX)
    if safeio.present(arrow):  # whatever is there (a FIFO, a link): the reader refuses it, named
        return arrow
    legacy = base.with_name(base.name + LEGACY_SUFFIX)
    return legacy if safeio.present(legacy) else arrow


def is_arrow(path: Path) -> bool:
    return Path(path).suffix == SUFFIX


def read_range(path: Path, offset: int, length: int, root: Path | None = None) -> bytes:
    """One step's bytes (store/safeio.py: a regular file inside `root`, by default its run directory)."""
    path = Path(path)
    return safeio.read_range(path, path.parent.parent if root is None else root, offset, length)


def scan(
    path: Path, torn: list | None = None, root: Path | None = None
) -> Iterator[tuple[int, int, pa.RecordBatch]]:
    """(offset, length, batch) of every step in the file, in order, without the step index. A step's range
    runs from the end of the one before (the first step's holds the schema message) to the end of its record
    batch; a v2 step's dictionary message comes before its batch. A torn final step is reported through `torn`
    and left out. The file is mapped, not read: only the steps being decoded are copied, up to SCAN_BYTES of
    them decoded together (decode_steps)."""
    path = Path(path)
    data = safeio.mapped(path, path.parent.parent if root is None else root)
    reader = pa.BufferReader(pa.py_buffer(data) if data else data)
    start, first = 0, None  # first: where the step's first message after any schema lies
    pending: list[
        tuple[int, int, int, int]
    ] = []  # framed steps not yet decoded: start, length, first, end

    def flush():
        if not pending:
            return
        batch, starts = decode_steps(
            path, [(data[a:b], f"bytes {a}..{b}") for _, _, a, b in pending]
        )
        ends = np.append(starts[1:], batch.num_rows)
        for (offset, length, _, _), i, j in zip(pending, starts.tolist(), ends.tolist()):
            yield offset, length, batch.slice(i, j - i)
        pending.clear()

    def cut(pos: int):
        if torn is not None:
            torn.append(
                f"{path}: the last step's bytes (from offset {start}) are torn (incomplete write), ignored"
            )
            return
        raise BadInput(path, f"bytes from offset {pos} are not an Arrow message")

    while reader.tell() < len(data):
        pos = reader.tell()
        if (
            data[pos : pos + len(END_OF_STREAM)] == END_OF_STREAM
        ):  # at close; a restarted job appends after it
            if first is not None:
                yield from flush()
                raise BadInput(
                    path,
                    f"bytes {first}..{pos}: a dictionary message without its step's record batch",
                )
            reader.seek(pos + len(END_OF_STREAM))
            start = reader.tell()
            continue
        try:
            msg = ipc.read_message(reader)
        except (pa.ArrowException, OSError, ValueError, EOFError):
            yield from flush()
            return cut(pos)
        if msg is None:
            break
        if msg.type == "schema" and first is None:
            try:
                _check_schema(msg)
            except (
                pa.ArrowException,
                ValueError,
                OSError,
            ) as e:  # a forged header: OSError from flatbuffers
                raise BadInput(path, f"bytes {pos}..{reader.tell()}: {e}") from None
            continue
        if first is None:
            first = pos
        if msg.type == "dictionary":
            continue
        end = reader.tell()
        if end - first > safeio.LIMITS["step"]:
            yield from flush()
            raise BadInput(path, f"bytes {first}..{end}: a step larger than a step may be")
        pending.append((start, end - start, first, end))
        if sum(b - a for _, _, a, b in pending) >= SCAN_BYTES:
            yield from flush()
        start, first = end, None
    yield from flush()
    if (
        first is not None
    ):  # a dictionary message and no record batch after it: the write stopped in between
        cut(first)


SCAN_BYTES = 1 << 20  # steps decoded together by scan (~15,000 records)


def unindexed_tail(path: Path, end: int, root: Path | None = None) -> int:
    """Bytes after `end` (the last indexed step) other than the end-of-stream marker: a step whose write a
    crash interrupted (its index line is written only after its bytes)."""
    path = Path(path)
    size = safeio.size(path, path.parent.parent if root is None else root)
    if size <= end:
        return 0
    if (
        size - end == len(END_OF_STREAM)
        and read_range(path, end, len(END_OF_STREAM), root) == END_OF_STREAM
    ):
        return 0
    return size - end


def step_of(batch: pa.RecordBatch) -> int | None:
    return int(batch.column(0)[0].as_py()) if batch.num_rows else None


def to_records(batch: pa.RecordBatch) -> list[dict]:
    """The batch as the recorder's dicts (TrajectoryRecord: optional fields absent when not recorded)."""
    cols = {name: batch.column(i).to_pylist() for i, name in enumerate(FIELDS)}
    out = []
    for i in range(batch.num_rows):
        digest = cols["digest"][i].hex()
        r = {
            "step": cols["step"][i],
            "micro_batch": cols["micro_batch"][i],
            "phase": cols["phase"][i],
            "rank": cols["rank"][i],
            "index": cols["index"][i],
            "tensor": cols["tensor"][i],
            "dtype": cols["dtype"][i],
            "shape": cols["shape"][i],
            "numel": cols["numel"][i],
            "digest": _DEVICE_PREFIX + digest if cols["device_digest"][i] else digest,
            "sum": cols["sum"][i],
            "norm": cols["norm"][i],
        }
        sk = cols["sketch"][i] or cols["sketch64"][i]
        if sk is not None:
            r["sketch"] = sk
        r["nonfinite"] = cols["nonfinite"][i]
        for k in ("samples", "tokens"):
            if cols[k][i] is not None:
                r[k] = cols[k][i]
        if cols["shard_offset"][i] is not None:
            r["shard"] = {
                "offset": cols["shard_offset"][i],
                "logical_shape": cols["shard_shape"][i],
            }
        out.append(r)
    return out


def records_of_range(
    path: Path,
    offset: int,
    length: int,
    step: int | None = None,
    root: Path | None = None,
    phases: tuple[str, ...] | None = None,
) -> list[dict]:
    """One step's records, read by seeking to its byte range (from the step index); with `phases`, only
    those phases' records (the step is checked whole all the same; only what is asked for is converted to
    dicts, a few records of thousands for a reader of the clip scalars)."""
    data = read_range(path, offset, length, root)
    if not is_arrow(path):
        try:
            recs = [orjson.loads(line) for line in data.splitlines() if line.strip()]
        except orjson.JSONDecodeError:
            raise BadInput(
                path,
                f"step {step}: a record in bytes {offset}..{offset + length} is not valid JSON "
                "(the file does not match its step index)",
            ) from None
        from disttrace.store.records import checked_json_records

        recs = checked_json_records(
            recs, f"{path} (step {step}, bytes {offset}..{offset + length})"
        )
        return recs if phases is None else [r for r in recs if r.get("phase") in phases]
    batch = decode_step(path, data, f"step {step} (bytes {offset}..{offset + length})")
    if phases is not None:
        batch = batch.filter(
            pc.is_in(batch.column("phase"), value_set=pa.array(phases, pa.string()))
        )
    return to_records(batch)
