"""The lines of events.jsonl, typed: what happened in a run and when, one model a kind of event, each
line read back validated by its kind's model (`parse_event`)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import (
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
)

from disttrace.store.records import Event, Number, _Line


class EventLine(_Line):
    """A line of events.jsonl: what happened and when. Each kind below states the fields its writer adds, in
    the order they are written; a writer builds its line with its kind's model (`store.writers.event`), a
    reader validates each line by the model of its `event` (`parse_event`). The fields are optional: a store
    from another version may leave some out; a field that is there must be of its type."""

    KIND: ClassVar[str | None] = None
    event: StrictStr
    time: Number | None = None  # set when the line is written

    def __init__(self, **data: Any):
        if self.KIND is not None:
            data.setdefault("event", self.KIND)
        super().__init__(**data)

    def line(self) -> dict:
        """What the writer stated, in declaration order: a field it passed as None is written as null, one it
        left out is left out (the bytes of the dict literals these models replaced)."""
        rest = self.model_dump(exclude_unset=True, exclude={"event", "time"})
        return {"event": self.event, "time": self.time, **rest}


class Created(EventLine):
    KIND = Event.CREATED
    path: StrictStr | None = None
    pid: StrictInt | None = None


class Launched(EventLine):
    KIND = Event.LAUNCHED
    nnodes: StrictInt | None = None
    node_rank: StrictInt | None = None
    nproc_per_node: StrictInt | None = None
    endpoint: StrictStr | None = None


class CheckpointSaved(EventLine):
    KIND = Event.CHECKPOINT_SAVED
    step: StrictInt | None = None
    path: StrictStr | None = None  # relative to the run directory


class Resumed(EventLine):
    KIND = Event.RESUMED
    step: StrictInt | None = None
    checkpoint: StrictStr | None = None
    with_optimizer: StrictBool | None = None


class BadInputNote(_Line):
    """What a rank that refused its input recorded: the launcher raises the same BadInput (exit 2)."""

    where: Any = None
    field: Any = None
    reason: Any = None


class RankFailed(EventLine):
    KIND = Event.RANK_FAILED
    rank: StrictInt | None = None
    error: StrictStr | None = None
    where: StrictStr | None = None  # the traceback's last lines
    bad_input: BadInputNote | None = None
    disk_full: StrictBool | None = None  # it stopped on a full disk (ENOSPC or a quota's EDQUOT)


class JobFailed(EventLine):
    KIND = Event.JOB_FAILED
    failures: dict[str, StrictInt | None] | None = (
        None  # global rank -> exit code (negative: signal)
    )
    first_failed_rank: StrictInt | None = None
    reason: StrictStr | None = None


class LiveCheckFailed(EventLine):
    KIND = Event.LIVE_CHECK_FAILED
    step: StrictInt | None = None
    phase: StrictStr | None = None
    group: list[StrictInt] | None = None
    digests: dict[str, Any] | None = None  # rank -> the digests it saw


class EngineFacts(EventLine):
    """What the engine reported of itself (the keys are the strategy's: DDP's `ddp_bucket_sizes`)."""

    KIND = Event.ENGINE_FACTS
    step: StrictInt | None = None


class Attached(EventLine):
    KIND = Event.ATTACHED
    engine: StrictStr | None = None
    world_size: StrictInt | None = None
    manifest_id: StrictStr | None = None
    replica_rules: StrictInt | None = None


class FaultRefused(EventLine):
    KIND = Event.FAULT_REFUSED
    fault: StrictStr | None = None
    where: Any = None
    field: StrictStr | None = None
    reason: StrictStr | None = None


class CollectiveTraceEmpty(EventLine):
    KIND = Event.COLLECTIVE_TRACE_EMPTY
    reason: StrictStr | None = None


class AttachNote(EventLine):
    KIND = Event.ATTACH_NOTE
    note: StrictStr | None = None


class FaultEvent(EventLine):
    """The `fault_fired` line of events.jsonl: which fault acted where, and the proof that it changed what
    it names (digests before and after; bit flips add tensor, element, bit, before, after)."""

    KIND = Event.FAULT_FIRED
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

    @property
    def phase(self) -> str | None:
        """The phase the fault acted in, when it says (a detail it adds: kept an extra, in its place)."""
        return (self.model_extra or {}).get("phase")

    def line(self) -> dict:
        """Unset optionals and details of None left out, as the fault's line has always been written."""
        rest = self.model_dump(exclude_none=True, exclude={"event", "time"})
        return {"event": self.event, "time": self.time, **rest}


EVENT_LINES: dict[str, type[EventLine]] = {
    cls.KIND: cls
    for cls in (
        Created,
        Launched,
        CheckpointSaved,
        Resumed,
        RankFailed,
        JobFailed,
        LiveCheckFailed,
        EngineFacts,
        Attached,
        FaultRefused,
        CollectiveTraceEmpty,
        AttachNote,
        FaultEvent,
    )
}


def parse_event(obj: Any, path, lineno: int) -> EventLine:
    """One line of events.jsonl validated by its kind's model (a kind this version does not know: the
    common fields only); BadInput naming the line and field."""
    kind = obj.get("event") if isinstance(obj, dict) else None
    # a kind that is not a string (a list, an object: unhashable) is validated by the common model, which
    # refuses it naming the field
    model = EVENT_LINES.get(kind, EventLine) if isinstance(kind, str) else EventLine
    return model.parse_line(obj, path, lineno)
