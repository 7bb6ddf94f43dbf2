"""The layout store/blockdecode.py's kernels read and write (a v2 step's field nodes and buffers, the output
buffers of the arena, why a block declines), shared by the C kernels (disttrace/native/blockdecode.c, which
compiles the same numbers in and exports them as LAYOUT, checked against these at import), store/blockdecode.py
and the tests that craft blocks. Plain numbers: importing it does not import pyarrow's writer.
"""

from __future__ import annotations

import numpy as np

from disttrace.store.trajectory_frames import SHAPE_DIMS_PER_RECORD, SHAPE_DIMS_SLACK

# the record batch's field nodes (format/Schema: a node per field, children after their parent) and buffers
# (validity first, then offsets or data; children after), in SCHEMA_V2's order
_NODES = 22
_BUFFERS = 43
_DICT_NODES, _DICT_BUFFERS = (
    2,
    4,
)  # list<int64>: its validity and offsets, the child's validity and data
_NB = _DICT_BUFFERS + _BUFFERS  # buffers a step: the dictionary's, then the batch's
_NN = _DICT_NODES + _NODES
# the batch's buffers (offset by _DICT_BUFFERS in a step's row) and nodes (by _DICT_NODES)
_FIXED = (  # (node, validity buffer, data buffer, width, output column)
    (0, 0, 1, 4, 0),  # step
    (1, 2, 3, 4, 1),  # micro_batch
    (3, 6, 7, 4, 3),  # rank
    (4, 8, 9, 4, 4),  # index
    (8, 17, 18, 16, 9),  # digest
    (10, 21, 22, 8, 11),  # sum
    (11, 23, 24, 8, 12),  # norm
    (16, 31, 32, 8, 15),  # nonfinite
    (19, 37, 38, 8, 17),  # tokens
)
# output buffers, each a slice of one arena: per SCHEMA column, its validity then its data, offsets or child
OUT = {
    name: i
    for i, name in enumerate(
        (
            "step",
            "step.v",
            "micro_batch",
            "micro_batch.v",
            "rank",
            "rank.v",
            "index",
            "index.v",
            "digest",
            "digest.v",
            "sum",
            "sum.v",
            "norm",
            "norm.v",
            "nonfinite",
            "nonfinite.v",
            "tokens",
            "tokens.v",
            "phase.o",
            "phase.s",
            "tensor.o",
            "tensor.s",
            "dtype.o",
            "dtype.s",
            "shape.o",
            "shape.values",
            "numel",
            "device_digest",
            "sketch.v",
            "sketch.child.v",
            "sketch.child",
            "sketch64.v",
            "sketch64.child.v",
            "sketch64.child",
            "samples.v",
            "samples.o",
            "samples.child",
            "shard.v",
            "shard.o",
            "shard_offset.child",
            "shard_shape.child",
        )
    )
}
_N_OUT = len(OUT)
_O = OUT  # short, for the kernel's constants below
_O_FIXED = np.array([[_O[n], _O[n + ".v"]] for n in (
    "step", "micro_batch", "rank", "index", "digest", "sum", "norm", "nonfinite", "tokens"
)], dtype=np.int64)  # fmt: skip
_O_PHASE_O, _O_PHASE_S = _O["phase.o"], _O["phase.s"]
_O_TENSOR_O, _O_TENSOR_S = _O["tensor.o"], _O["tensor.s"]
_O_DTYPE_O, _O_DTYPE_S = _O["dtype.o"], _O["dtype.s"]
_O_SHAPE_O, _O_SHAPE_V, _O_NUMEL = _O["shape.o"], _O["shape.values"], _O["numel"]
_O_DEV = _O["device_digest"]
_O_SK_V, _O_SK_CV, _O_SK_C = _O["sketch.v"], _O["sketch.child.v"], _O["sketch.child"]
_O_SK64_V, _O_SK64_CV, _O_SK64_C = _O["sketch64.v"], _O["sketch64.child.v"], _O["sketch64.child"]
_O_SA_V, _O_SA_O, _O_SA_C = _O["samples.v"], _O["samples.o"], _O["samples.child"]
_O_SH_V, _O_SH_O, _O_SH_OFF, _O_SH_SHAPE = (
    _O["shard.v"],
    _O["shard.o"],
    _O["shard_offset.child"],
    _O["shard_shape.child"],
)
_FIXED_ARR = np.array(_FIXED, dtype=np.int64)

# why a block declined (the tests read it; the pyarrow path then decides)
DECLINED = {
    1: "a message header not the writer's",
    2: "a buffer outside its message's body",
    3: "a buffer's declared size out of bounds",
    4: "an LZ4 frame not as the writer writes it",
    5: "field nodes inconsistent with the batch",
    6: "a buffer shorter than its column needs",
    7: "a validity bitmap whose nulls are not its node's count",
    8: "offsets out of order or out of range",
    9: "a value the writer never writes",
    10: "a dictionary index out of range",
    11: "a shape whose product may overflow int64",
    12: "a step larger than a step's records expand to",
    13: "more output than 32-bit offsets hold",
    14: "shapes holding more dimensions than a step's records may (the pyarrow path refuses it)",
}

_LZ4_BLOCK = 1 << 16
_MAX_OFFSET = (1 << 31) - 1
_SHAPE_DIMS_PER_RECORD, _SHAPE_DIMS_SLACK = SHAPE_DIMS_PER_RECORD, SHAPE_DIMS_SLACK

# what the C build compiles in (disttrace/native/blockdecode.c, LAYOUT): store/blockdecode.py takes the C
# kernels only where the two agree (a build from another checkout's layout is not used)
LAYOUT = {
    "nodes": _NODES,
    "buffers": _BUFFERS,
    "dict_nodes": _DICT_NODES,
    "dict_buffers": _DICT_BUFFERS,
    "n_out": _N_OUT,
    "totals": 7,
    "lz4_block": _LZ4_BLOCK,
    "max_offset": _MAX_OFFSET,
    "shape_dims_per_record": _SHAPE_DIMS_PER_RECORD,
    "shape_dims_slack": _SHAPE_DIMS_SLACK,
    "out": (
        _O_PHASE_O, _O_PHASE_S, _O_TENSOR_O, _O_TENSOR_S, _O_DTYPE_O, _O_DTYPE_S, _O_SHAPE_O, _O_SHAPE_V,
        _O_NUMEL, _O_DEV, _O_SK_V, _O_SK_CV, _O_SK_C, _O_SK64_V, _O_SK64_CV, _O_SK64_C, _O_SA_V, _O_SA_O,
        _O_SA_C, _O_SH_V, _O_SH_O, _O_SH_OFF, _O_SH_SHAPE,
    ),
}  # fmt: skip
