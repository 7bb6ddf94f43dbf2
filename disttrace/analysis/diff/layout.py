"""The layout two stores' records show, against the layouts their locks state: a lock is its writer's word,
and diff's choice of mode follows it only where the records do not contradict it. Two runs whose locks
state different layouts are compared numerically (another layout rounds differently); if their records
show one layout (the same ranks, and at each rank's first recorded step the same records: micro-batches,
phases, tensors, shapes, dtypes and shards), a stated difference would loosen the comparison from bit for
bit to the numeric bound, under which a bit-level fault (one low mantissa bit of a gradient) is not seen.
Such a pair is compared bit for bit, with a warning that says why and how to ask for the numeric mode.

Only between two runs of the harness's own trainer: its strategies that record alike also compute alike bit
for bit (ZeRO-2 and ZeRO-3 on FSDP2, GPipe and 1F1B, measured equal bit for bit), and those that round
differently record differently (ZeRO-1 keeps each rank's shard of the optimizer state; tensor and pipeline
parallelism shard or split the records). An attached engine need not: DeepSpeed's ZeRO-1 and ZeRO-2 record
the same pieces, yet stage 2 reduce-scatters the gradients where stage 1 all-reduces them, and the sums
round differently; such a pair keeps the numeric mode its locks state."""

from __future__ import annotations

from disttrace.config.identity import harness_manifest
from disttrace.store.rundir import Run


def _shown(run: Run) -> dict[int, list[tuple]] | None:
    """Each rank's first recorded step as the records' places (None where a rank has no step)."""
    out = {}
    for rank in run.ranks():
        entries = run.step_index(rank).records
        if not entries:
            return None
        out[rank] = sorted(
            (
                int(r.get("micro_batch") or 0),
                str(r.get("phase")),
                int(r.get("index") or 0),
                str(r.get("tensor")),
                tuple(r.get("shape") or ()),
                str(r.get("dtype")),
                repr(r.get("shard")),
            )
            for r in run.records_of_step(rank, entries[0])
        )
    return out or None


def same_shown(a: Run, b: Run) -> bool:
    """Whether the two stores' records show one layout, for two runs of the harness's trainer (the module
    docstring); False for any other pair."""
    if not all(harness_manifest(run.manifest_doc) for run in (a, b)):
        return False
    shown_a = _shown(a)
    return shown_a is not None and shown_a == _shown(b)
