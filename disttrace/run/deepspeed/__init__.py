"""disttrace for a DeepSpeed engine (install with `pip install disttrace[deepspeed]`): the same call as for a
torch model, on what `deepspeed.initialize` returned.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    run = disttrace.api.attach(engine, optimizer, config={"grad_accum_steps": 2, "micro_batch_size": 4})
    for step ...:
        for micro_batch ...:
            loss = run.loss(loss_fn(engine(x), y))   # optional: the loss record
            engine.backward(loss)
            engine.step()                            # DeepSpeed steps at its accumulation boundary
    run.close()

Phases, with the meaning they have elsewhere, read where DeepSpeed keeps them (ZeRO stages 0 to 3):

- `backward`: this micro-batch's local gradient as autograd hands it to DeepSpeed (a hook on each
  parameter, before DeepSpeed accumulates, reduces or partitions it); the loss already carries DeepSpeed's
  1/accumulation scaling. It is the same quantity at every stage (stage 0 would otherwise show the
  accumulated `.grad`, stage 2 nothing: it frees each micro-batch's gradient once reduced).
- `reduce`: the reduced, averaged gradient at the accumulation boundary, before clipping: the whole
  gradient under stage 0; under ZeRO 1-3 the partition this rank owns, as shards of each logical tensor.
- `clip`: DeepSpeed's global gradient norm (`grad_norm`), the coefficient it scales by (`clip_coef`,
  min(1, clip / (norm + 1e-6)), DeepSpeed's formula at every stage) and the learning rate.
- `optimizer`: after DeepSpeed's step, the fp32 master parameters and the optimizer state (exp_avg, ...)
  this rank holds: whole under stage 0, else its partition, each piece a shard with its offset in the
  logical tensor so diff combines them as it combines FSDP2's.

DeepSpeed partitions the flattened parameters, so a rank's piece of a tensor is a range of its flattened
elements; it is recorded as the few boxes that range is made of (a partial row, whole rows, a partial row)
with their offsets. ZeRO-3 parameters are recorded by their logical names and shapes (`ds_shape`), and the
manifest counts `ds_numel`, not the empty placeholders the module holds.

The replica map comes from DeepSpeed's data-parallel group: data differs there, the clip scalars agree, and
under stage 0 (every rank holds everything) reduced gradients, parameters and optimizer state agree.

Here: recognising the engine, its replica map and the faults it admits; `pieces` reads where DeepSpeed
keeps each rank's piece, `run` is the attached run (`DeepSpeedRun`).
"""

from __future__ import annotations

import sys

from disttrace.errors import BadInput
from disttrace.run.attach import Engine, initialized_dist
from disttrace.run.deepspeed.pieces import (
    BOXES,
    SHARD_ATTR,
    flat_boxes,
    logical_shape,
    pieces,
)
from disttrace.run.deepspeed.run import DeepSpeedRun
from disttrace.run.parallel.common import SCALARS_AGREE
from disttrace.store.documents import ReplicaRule, Replicas

KIND = "DeepSpeed"
# the faults whose hook point an attached DeepSpeed engine offers (the rest are refused, exit 2)
FAULTS = frozenset({"bitflip-grad", "bitflip-param", "grad-scale", "lr-skew", "kill-rank"})


def is_engine(model) -> bool:
    """A DeepSpeedEngine (deepspeed imported by the script: never imported here for a plain model)."""
    ds = sys.modules.get("deepspeed.runtime.engine")
    return ds is not None and isinstance(model, ds.DeepSpeedEngine)


def detect(engine) -> Engine:
    dist = initialized_dist()
    group = getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group
    ranks = dist.get_process_group_ranks(group) if dist else [0]
    return Engine(
        KIND, engine.module, engine, sorted(ranks), zero_stage=engine.zero_optimization_stage()
    )


def replicas(views: list[dict]) -> Replicas:
    """replicas.json from DeepSpeed's data-parallel group (each rank's `ddp_group` in its view)."""
    from disttrace.run.attach.engine import views_of

    views = views_of(views)
    world = len(views)
    dp = [list(g) for g in sorted({tuple(v.ddp_group) for v in views})]
    stage = views[0].zero_stage or 0
    rules = [
        ReplicaRule(phase="data", dim="dp", relation="differ"),
        SCALARS_AGREE.model_copy(update={"dim": "dp"}),
    ]
    if stage == 0:
        rules += [
            ReplicaRule(phase="reduce", dim="dp", relation="agree"),
            ReplicaRule(phase="optimizer", dim="dp", relation="agree"),
        ]
        note = "reduced gradients, clip scalars, parameters and optimizer state agree"
    else:
        rules.append(
            ReplicaRule(
                phase="optimizer", dim="dp", relation="agree", tensors=["param_groups.*.lr"]
            )
        )
        note = (
            f"ZeRO-{stage} partitions gradients"
            + (", parameters" if stage == 3 else "")
            + " and optimizer state there: only the clip scalars and learning rates agree"
        )
    return Replicas(
        groups={"world": [list(range(world))], "dp": dp},
        rules=rules,
        inferred={"engine": KIND, "notes": [f"DeepSpeed data parallel over {dp}: {note}"]},
    )


def check_fault(name: str, stage: int) -> None:
    if name not in FAULTS:
        raise BadInput(
            "--fault",
            f"'{name}' needs a hook point an attached DeepSpeed engine (ZeRO-{stage}) does not "
            f"offer; it offers: {', '.join(sorted(FAULTS))}",
        )


# what attach and the tests read from here (the pieces, the run) besides the engine's own
__all__ = [
    "BOXES",
    "FAULTS",
    "KIND",
    "SHARD_ATTR",
    "DeepSpeedRun",
    "check_fault",
    "detect",
    "flat_boxes",
    "is_engine",
    "logical_shape",
    "pieces",
    "replicas",
]
