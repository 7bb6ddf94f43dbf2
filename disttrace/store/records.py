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
    FAULT_FIRED = "fault_fired"  # the fault acted, with its proof (coordinates, digests before and after)
    FAULT_REFUSED = "fault_refused"  # an attached run could not offer the fault's hook point
    RESUMED = "resumed"  # the run resumed from a checkpoint (step, checkpoint, with_optimizer)
    ENGINE_FACTS = "engine_facts"  # what the engine reported of itself (DDP's buckets), when it changed
    RANK_FAILED = "rank_failed"  # a rank raised (rank, error, where)
    JOB_FAILED = "job_failed"  # the launcher saw the job fail (reason, failures)
    LIVE_CHECK_FAILED = "live_check_failed"  # the live replica check stopped the job
    ATTACH_NOTE = "attach_note"  # an attached run could not install something (a hook) and says why


FAILURE_EVENTS = (Event.RANK_FAILED, Event.JOB_FAILED, Event.LIVE_CHECK_FAILED)
