"""The trajectory on disk: one Arrow IPC stream per rank, `trajectory/rank-NNNNN.arrows`, one record batch per
step (docs/design.md, "Run store").

Why columnar. A JSON line spent ~355 bytes on one record (field names, hex digests, floats as text), and a
reader parsed every field of every record. A column of 16-byte digests, float64 sums and norms and a
float32 sketch compresses to ~50 bytes a record (LZ4 per column buffer; step, rank, phase and index runs
cost almost nothing), and diff reads whole columns into numpy without building a dict per record.

Why one batch per step, self-contained. The step index (`rank-NNNNN.steps.jsonl`) keeps each step's byte
offset and length, the sha256 chain seals those bytes (store/seal.py), and diff seeks to one step without
reading the others. So a step's bytes must decode on their own: the one dictionary-encoded column (shape)
has its dictionary re-sent in every step's bytes, just before the step's record batch (a stream may replace
a dictionary; every Arrow reader reads it so). The first step's bytes also hold the stream's schema message;
readers decode with the schemas below, never with a schema read from the store, so a forged header cannot
change what a column means.

Two layouts on disk, one for readers. Every reader gets `SCHEMA`'s batch (analysis, diff, `to_records`).
Version 1 (the first Arrow layout, still read) is `SCHEMA` itself. Version 2 (`SCHEMA_V2`, the one
written) stores the same records in fewer bytes: at ~180 records a step each column's Arrow metadata and
LZ4 frame cost ~0.5 byte a record and a string or list column's int32 offsets ~4 (LZ4 cannot shorten an
increasing sequence), so phase and dtype are string views (names of up to 12 bytes sit inside the 16-byte
view, and equal views compress to nothing), shape is a per-step dictionary of the distinct shapes, numel
(the product of the shape, always) is not stored, and the shard's offset and logical shape share one list.
A step's layout is told by its own bytes: a v2 step starts with its dictionary message, a v1 step with its
record batch. A writer appending to a v1 stream (a job restarted into a run directory an older disttrace
wrote) keeps writing v1, so the file stays one stream.

Any Arrow reader reads the file as it is (`pyarrow.ipc.open_stream`, `polars.read_ipc_stream`, DuckDB over
the Arrow table): `disttrace show RUN records --jsonl` exports it as JSON lines. A crash mid-step leaves a
torn final message: reported and left out, as a torn JSON line is. JSON-lines trajectories
(`rank-NNNNN.jsonl`, one record a line, the format before Arrow) are still read.

Here: the schemas and the constants of the format. The writer is store/trajectory_write.py; a step's messages
are framed and bounded by store/trajectory_frames.py and decoded by store/trajectory_decode.py; reading a file
(a step by its range, a scan, the recorder's dicts) is store/trajectory_read.py.
"""

from __future__ import annotations

import pyarrow as pa

SUFFIX = ".arrows"  # Arrow's extension for the IPC stream format


LEGACY_SUFFIX = ".jsonl"


# LZ4 frames per column buffer. Measured on 1,000-record steps (`python bench/trajectory_codec.py`): zstd
# 42 bytes a record and 0.72 ms to decode a step, LZ4 56 bytes and 0.12 ms, uncompressed 212 bytes and
# 0.04 ms; decoding is what a numeric diff of every record pays, so LZ4
COMPRESSION = "lz4"


END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # what the stream writer appends at close


# dtypes whose sketch is computed in float32 (run/record/digest.py) and therefore stored in float32: storing it in
# float64 would keep digits the computation never had (tolerance.sketch_rounding counts the storage rounding)
SKETCH_FLOAT32 = ("float32", "float16", "bfloat16")


SKETCH_K = 4


# the sketch's definition (run/record/digest.py): 1, K leading factors per projection (stores before 2026-12-01,
# whose step index lines have no `sketch`); 2, one leading factor shared by the K projections. Sketches of
# two versions are other projections of the tensor but the first (v_0's factors are a_{0,d} on every axis in
# both): diff compares every projection within one version, the first between 1 and 2
SKETCH_VERSION = 2


def shared_projections(a: set, b: set) -> int:
    """How many leading sketch projections two runs' records have the same vectors for, given the sets of
    sketch versions their step indexes state (None: a version not known): all within one version, the
    first between versions 1 and 2, none otherwise (and all where a side states none: it has no records)."""
    both = a | b
    if not a or not b or (len(both) == 1 and None not in both):
        return SKETCH_K
    return 1 if both <= {1, 2} else 0


# digest kinds: xxh3-128 of the raw bytes (32 hex characters), or the device checksum ("dev:" + 32 hex)
_DEVICE_PREFIX = "dev:"


_ints = pa.list_(pa.int64())


SCHEMA = pa.schema(
    [
        ("step", pa.uint32()),
        ("micro_batch", pa.uint32()),
        ("phase", pa.string()),
        ("rank", pa.uint32()),
        ("index", pa.uint32()),
        ("tensor", pa.string()),
        ("dtype", pa.string()),
        ("shape", _ints),
        ("numel", pa.int64()),
        ("digest", pa.binary(16)),
        (
            "device_digest",
            pa.bool_(),
        ),  # the digest is the device checksum (run/record/digest.py), not xxh3 of the bytes
        ("sum", pa.float64()),  # null: not finite
        ("norm", pa.float64()),
        (
            "sketch",
            pa.list_(pa.float32(), SKETCH_K),
        ),  # float32-computed sketches (SKETCH_FLOAT32 dtypes)
        ("sketch64", pa.list_(pa.float64(), SKETCH_K)),  # float64 and integer tensors' sketches
        ("nonfinite", pa.int64()),
        ("samples", _ints),  # data phase: the batch's sample ids
        ("tokens", pa.int64()),  # loss phase: the tokens the loss is a mean over
        (
            "shard_offset",
            _ints,
        ),  # a DTensor shard: where this rank's piece sits in the logical tensor
        ("shard_shape", _ints),
    ]
)


FIELDS = tuple(SCHEMA.names)


# what is written now (docstring, "Two layouts"); bench/trajectory_columns.py measures what each column costs
_SHAPE_INDEX = (
    pa.int16()
)  # distinct shapes in one step: 32,767 at most (a model's tensors share a few dozen)


SCHEMA_V2 = pa.schema(
    [
        ("step", pa.uint32()),
        ("micro_batch", pa.uint32()),
        ("phase", pa.string_view()),
        ("rank", pa.uint32()),
        ("index", pa.uint32()),
        (
            "tensor",
            pa.string(),
        ),  # mostly longer than a view's 12 inline bytes: a view would cost 16 bytes a row
        ("dtype", pa.string_view()),
        ("shape", pa.dictionary(_SHAPE_INDEX, _ints)),  # numel is the product of the shape
        ("digest", pa.binary(16)),
        ("device_digest", pa.bool_()),
        ("sum", pa.float64()),
        ("norm", pa.float64()),
        ("sketch", pa.list_(pa.float32(), SKETCH_K)),
        ("sketch64", pa.list_(pa.float64(), SKETCH_K)),
        ("nonfinite", pa.int64()),
        ("samples", _ints),
        ("tokens", pa.int64()),
        ("shard", _ints),  # a DTensor shard: its offset, then the logical shape (as many of each)
    ]
)


_SCHEMAS = {1: SCHEMA, 2: SCHEMA_V2}


_SCHEMA_MESSAGES = {v: schema.serialize().to_pybytes() for v, schema in _SCHEMAS.items()}
