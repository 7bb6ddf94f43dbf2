"""The vocabulary of the run store, defined once: phases and their order, path kinds, event names.

Writers (the job) and readers (analysis, views, `watch`) import these names instead of spelling strings,
so a renamed event or a new phase is one edit here. No torch (docs/design.md, "Architecture").
"""

from __future__ import annotations

from enum import StrEnum

# the order that defines "first" (docs/design.md, "Order"): data < forward < ... < checkpoint
PHASES = ("data", "forward", "loss", "backward", "reduce", "clip", "optimizer", "checkpoint")
PHASE_ORDER = {p: i for i, p in enumerate(PHASES)}
# Inside a phase records are ordered by index, and "first" follows the order of computation there too: the
# clip's scalars (the global norm, the coefficient; run/parallel/common.py's SCALAR_INDEX onwards) are
# computed before the gradients they scale, so a clipped gradient's index is its parameter's plus this
# base, after every scalar (a rank that clips by a wrong norm is named at the norm, not at its first
# gradient). Stores written before it hold clipped gradients at their parameter's index: readers that map
# a record to its parameter (clip_param_index) take both.
CLIP_GRAD_BASE = 2_000_000


def clip_param_index(index: int) -> int:
    """The parameter index of a `clip` record's gradient, whichever writer's convention it was stored with."""
    return index - CLIP_GRAD_BASE if index >= CLIP_GRAD_BASE else index


PATH_KINDS = ("reference", "fault", "recovered", "replay")


class Event(StrEnum):
    """The `event` field of a line of events.jsonl. A StrEnum: it is written and compared as its string."""

    CREATED = "created"  # the run directory was prepared (path)
    LAUNCHED = "launched"  # a node's launcher started its ranks (nnodes, node_rank, endpoint)
    CHECKPOINT_SAVED = "checkpoint_saved"  # a checkpoint was published (step, path)
    FAULT_FIRED = (
        "fault_fired"  # the fault acted, with its proof (coordinates, digests before and after)
    )
    FAULT_REFUSED = "fault_refused"  # an attached run could not offer the fault's hook point
    RESUMED = "resumed"  # the run resumed from a checkpoint (step, checkpoint, with_optimizer)
    ENGINE_FACTS = (
        "engine_facts"  # what the engine reported of itself (DDP's buckets), when it changed
    )
    RANK_FAILED = "rank_failed"  # a rank raised (rank, error, where)
    JOB_FAILED = "job_failed"  # the launcher saw the job fail (reason, failures)
    LIVE_CHECK_FAILED = "live_check_failed"  # the live replica check stopped the job
    ATTACHED = "attached"  # a user's script attached (engine, world size, manifest id)
    COLLECTIVE_TRACE_EMPTY = (
        "collective_trace_empty"  # the Flight Recorder ring was off: no trace, said so
    )
    ATTACH_NOTE = "attach_note"  # an attached run could not install something (a hook) and says why


FAILURE_EVENTS = (Event.RANK_FAILED, Event.JOB_FAILED, Event.LIVE_CHECK_FAILED)

# the lock's `source` of a run a user's own script wrote through disttrace.api (attach)
ATTACHED_SOURCE = "disttrace.api"
# the lock's source of a run recorded with no attach call (run/zerocode/recording.py); readers treat it as attached
ZERO_CODE_SOURCE = "zero-code"
ATTACHED_SOURCES = (ATTACHED_SOURCE, ZERO_CODE_SOURCE)


# ---------------------------------------------------------------- typed lines of the run store
#
# Defined once, used by the writer (the job builds its line with the model) and by the readers (each line
# read is validated by the same model, and a bad one is one line naming the file, line and field). Records
# that flow in their millions (the trajectory) are columns on disk: store/trajectory.py holds their Arrow
# schema; `TrajectoryRecord` below is the shape of one of them as a dict (what the recorder buffers and the
# record path reads), for type checkers and readers of this file.

from typing import Any, TypedDict  # noqa: E402

from pydantic import (  # noqa: E402
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from disttrace.errors import BadInput  # noqa: E402

Number = StrictInt | StrictFloat


class TrajectoryRecord(TypedDict, total=False):
    """One digest of one tensor at one coordinate (docs/design.md, "Order")."""

    step: int  # from 1
    micro_batch: int  # reduce / clip / optimizer carry the last micro-batch's index
    phase: str  # one of PHASES
    rank: int  # global rank
    index: int  # registration order in the plain model (scalars from 1,000,000, checkpoint files from 2**20)
    tensor: str  # the parameter's name in the plain model (optimizer state: "name:key")
    dtype: str
    shape: list[int]  # this rank's local shape
    numel: int
    digest: str  # xxh3-128 of the raw bytes, hex
    sum: float | None  # float64 statistics (None when not finite)
    norm: float | None
    sketch: list[float]  # random projections, additive over shards
    nonfinite: int
    shard: dict  # {"offset": [...], "logical_shape": [...]} for a DTensor shard
    samples: list[int]  # data phase: the sample ids of the batch


class _Line(BaseModel):
    # other writers (an older or newer disttrace) may add fields: keep them, readers take what they know
    model_config = ConfigDict(extra="allow", defer_build=True)
    _read: Any = PrivateAttr(default=None)  # the object a reader validated, as it was in the file

    @classmethod
    def parse_line(cls, obj: Any, path, lineno: int):
        """Validate one line read from `path`; BadInput naming the line and the first bad field."""
        try:
            out = cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or "line"
            raise BadInput(
                path, f"line {lineno}: '{field}' {err['msg'].lower()}", field=field
            ) from None
        out._read = obj
        return out

    def as_read(self) -> dict:
        """The line as the store holds it: every key, in the file's order (a document that echoes a store's
        line, and a hash taken over it, need its bytes, not the model's dump); a line built here: `line()`."""
        return self._read if self._read is not None else self.line()

    def line(self) -> dict:
        """The dict a writer puts on disk (fields in declaration order, unset optionals left out)."""
        return self.model_dump(exclude_none=True)

    def doc(self) -> dict:
        """What the writer stated, for a document written with sorted keys (run.json, topology, replicas):
        a field it passed as None is written as null, one it left out (a default) is left out."""
        return self.model_dump(exclude_unset=True, by_alias=True)

    def to_dict(self) -> dict:
        """The `--json` document of a result that is also a line on disk (the gate's verdict)."""
        return self.line()

    def to_json(self) -> str:
        from disttrace.jsondoc import dumps

        return dumps(self.to_dict())


# a count, offset, size or step: below 2^63, as every reader holds it (an int64 array, Arrow's int64): a line
# stating 2^63 records was taken by the model and overflowed the reader's array (an internal error)
INT64_END = 1 << 63
NonNegative = Field(ge=0, lt=INT64_END)


class JsonRecord(_Line):
    """One record of a JSON-lines trajectory (the format before Arrow), as its writer always wrote it. Strict:
    the record path reads these fields as they are, so a string where a number belongs would fail deep in diff
    instead of here, naming the line."""

    model_config = ConfigDict(extra="allow", strict=True)

    step: int
    micro_batch: int
    phase: str
    rank: int
    index: int
    tensor: str
    dtype: str
    shape: list[int]
    numel: int
    digest: str
    sum: float | None = None
    norm: float | None = None
    nonfinite: int = 0
    sketch: list[float] | None = None
    shard: dict | None = None
    samples: list[int] | None = None


def checked_json_records(objs, path) -> list[dict]:
    """The JSON-lines records `objs` (dicts as read), each validated as a `JsonRecord` and handed on as read."""
    for n, obj in enumerate(objs, 1):
        JsonRecord.parse_line(obj, path, n)
    return objs


class StepIndexEntry(_Line):
    """One line of `trajectory/rank-N.steps.jsonl`: where a step's records lie and what they add up to."""

    step: StrictInt = NonNegative
    offset: StrictInt = NonNegative  # byte offset of the step's first record in the trajectory file
    length: StrictInt = NonNegative  # bytes of the step's records
    records: StrictInt = NonNegative
    digest: str | None = None  # digest of the records' digests: equal steps are skipped unread
    time: dict = Field(default_factory=dict)  # start, collective_issue, end (and pipeline spans)
    sha256: str | None = None  # the step's raw bytes, what `verify` checks (store/seal.py)
    xxh3: str | None = None  # the same bytes, what diff checks on every step it reads or skips
    chain: str | None = None  # sha256 chained to the previous step's (store/seal.py)
    sketch: StrictInt | None = (
        None  # the version of the records' sketches (trajectory.SKETCH_VERSION); absent: 1
    )
