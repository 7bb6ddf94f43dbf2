"""Faults inside an attached run: which hook points the script offers, the fault checked against them
(refused before the first step, exit 2), and what the fault sees of the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrace.errors import BadInput
from disttrace.run.attach.engine import Engine


@dataclass(frozen=True)
class FaultGroup:
    """The engine's data-parallel process group: the collective a fault issues itself runs on it (None
    without DDP: the default group)."""

    group: Any = None


@dataclass(frozen=True)
class FaultContext:
    """What a fault may see of an attached run: the fields of the worker's Context (run/worker.py) the
    faults read. An attached rank is its own data-parallel coordinate."""

    run_dir: Path
    manifest: dict
    rank: int
    dp_rank: int
    strategy: FaultGroup


def capabilities(engine: Engine, comm_hook: bool) -> set[str]:
    """The hook points an attached run offers (faults.capabilities' vocabulary)."""
    if engine.kind == "FSDP2":
        return set()  # FSDP2 reduce-scatters inside its own post-backward
    if engine.kind == "DeepSpeed":
        return {"backward"}  # a hook on each parameter; DeepSpeed's collectives are its own
    caps = {"backward"}
    if engine.kind == "DDP" and comm_hook:
        caps.add("collective_hook")
    return caps


def build_fault(spec: dict, engine: Engine, caps: set[str], manifest: dict, names: list[str]):
    """Check a fault against what this script offers; raise BadInput (the run is refused, exit 2) if it
    needs a point the script does not have. Returns the Fault instance."""
    from disttrace.run import faults

    cls = faults.get(spec["name"])
    where = "--fault"
    if engine.kind == "DeepSpeed":
        from disttrace.integrations import deepspeed

        deepspeed.check_fault(cls.name, engine.zero_stage)
    world = manifest["parallelism"]["world_size"]
    step, rank = spec["step"], spec["rank"]
    cls.coordinates(step, rank, world=world)
    if cls.point == "data":
        raise BadInput(
            where,
            f"'{cls.name}' needs the data point to fetch another rank's shard, which an "
            "attached script does not offer",
        )
    own_hook = (
        ", its own DDP comm hook"
        if engine.kind == "DDP" and "backward" in caps and "collective_hook" not in caps
        else ""
    )
    cls.offered(
        manifest["parallelism"]["dp"], caps, "this script", f"this script ({engine.kind}{own_hook})"
    )
    merged = cls.parameters(dict(spec.get("params") or {}))
    pseudo = {
        **manifest,
        "checkpoint": {"interval": 1},
        "training": {**manifest["training"], "max_grad_norm": 1.0, "steps": max(step, 1)},
    }
    accum = manifest["training"].get("grad_accum_steps")
    try:
        cls.check(step, merged, pseudo)
    except (KeyError, TypeError):
        raise BadInput(
            where,
            f"'{cls.name}' needs the accumulation count: pass config={{'grad_accum_steps': N}} "
            "to attach",
        ) from None
    if accum is None and (
        "micro_batch" in merged and merged["micro_batch"] < 0 or cls.name == "late-microbatch"
    ):
        raise BadInput(
            where,
            f"'{cls.name}' needs the accumulation count: pass config={{'grad_accum_steps': N}} "
            "to attach",
        )
    if (
        "tensor" in merged
        and merged["tensor"] not in names
        and not (str(merged["tensor"]).isdigit() and int(merged["tensor"]) < len(names))
    ):
        raise BadInput(
            "--param tensor",
            f"this model has no tensor '{merged['tensor']}'; it has: "
            f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
        )
    return faults.build({"name": cls.name, "step": step, "rank": rank, "params": merged})
