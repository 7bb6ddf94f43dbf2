"""The vocabulary of the run store, defined once: phases and their order, path kinds, event names.

Writers (the job) and readers (analysis, views, `watch`) import these names instead of spelling strings,
so a renamed event or a new phase is one edit here. No torch (docs/design.md, "Architecture").
"""

from __future__ import annotations

from enum import StrEnum

# the order that defines "first" (docs/design.md, "Order"): data < forward < ... < checkpoint
PHASES = ("data", "forward", "loss", "backward", "reduce", "clip", "optimizer", "checkpoint")
PHASE_ORDER = {p: i for i, p in enumerate(PHASES)}
PATH_KINDS = ("reference", "fault", "recovered")


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


# ---------------------------------------------------------------- typed lines of the run store
#
# Defined once, used by the writer (the job builds its line with the model) and by the readers (each line
# read is validated by the same model, and a bad one is one line naming the file, line and field). Records
# that flow in their millions (the trajectory) are columns on disk: store/trajectory.py holds their Arrow
# schema; `TrajectoryRecord` below is the shape of one of them as a dict (what the recorder buffers and the
# record path reads), for type checkers and readers of this file.

from typing import Any, TypedDict  # noqa: E402

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError  # noqa: E402

from disttrace.errors import BadInput  # noqa: E402


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
    model_config = ConfigDict(extra="allow")

    @classmethod
    def parse_line(cls, obj: Any, path, lineno: int):
        """Validate one line read from `path`; BadInput naming the line and the first bad field."""
        try:
            return cls.model_validate(obj)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(x) for x in err["loc"]) or "line"
            raise BadInput(
                path, f"line {lineno}: '{field}' {err['msg'].lower()}", field=field
            ) from None

    def line(self) -> dict:
        """The dict a writer puts on disk (fields in declaration order, unset optionals left out)."""
        return self.model_dump(exclude_none=True)

    def to_dict(self) -> dict:
        """The `--json` document of a result that is also a line on disk (the gate's verdict)."""
        return self.line()

    def to_json(self) -> str:
        from disttrace.jsondoc import dumps

        return dumps(self.to_dict())


NonNegative = Field(ge=0)


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


class FaultEvent(_Line):
    """The `fault_fired` line of events.jsonl: which fault acted where, and the proof that it changed what
    it names (digests before and after; bit flips add tensor, element, bit, before, after)."""

    event: str = Event.FAULT_FIRED
    fault: str
    step: StrictInt
    micro_batch: StrictInt = 0
    rank: StrictInt
    point: str | None = None  # the hook point it acted at (always written by the job)
    params: dict = Field(default_factory=dict)
    digest_before: Any | None = None
    digest_after: Any | None = None
    changed: bool | None = None


class Check(_Line):
    """One check of the gate. passed None: not applicable (it neither passes nor fails, unless the policy
    requires every check); required False: advisory under the policy."""

    name: str
    passed: bool | None
    reason: str
    required: bool = True

    def line(self) -> dict:
        return self.model_dump()  # passed None (n/a) is written, not left out


class Verdict(_Line):
    """verdict.json, written by the gate: the decision, each check, and the policy it applied (and from whom)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    passed: bool = Field(alias="pass")
    run: str
    reference: str | None = None
    policy: dict = Field(default_factory=dict)
    checks: list[Check]
    flags: list[str] = Field(default_factory=list)
    eval: dict | None = None
    reference_eval: dict | None = None
    time: float
    replay: dict | None = None  # `gate --replay K`: the seed, the steps drawn, each re-execution
    trust: dict | None = (
        None  # what the verdict recomputed and what it took on trust (docs/trust.md)
    )

    def line(self) -> dict:
        return self.model_dump(
            by_alias=True
        )  # "pass" on disk and in --json, as the CLI contract says
