"""Faults inside an attached run: the fault checked against what the script offers (the checks are
run/faults/base.py's `Fault.attached` and `attached_capabilities`, beside the harness's; a refusal comes before
the first step, exit 2), and what the fault sees of the run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrace.run.attach.engine import Engine


@dataclass(frozen=True)
class FaultGroup:
    """The engine's data-parallel process group: the collective a fault issues itself runs on it (None
    without DDP: the default group)."""

    group: Any = None


@dataclass(frozen=True)
class FaultContext:
    """What a fault may see of an attached run: the fields of the worker's Context (run/job/worker.py) the
    faults read. An attached rank is its own data-parallel coordinate."""

    run_dir: Path
    manifest: dict
    rank: int
    dp_rank: int
    strategy: FaultGroup


def build_fault(spec: dict, engine: Engine, caps: set[str], manifest: dict, names: list[str]):
    """Check a fault against what this script offers (run/faults/base.py's `Fault.attached`, beside the harness's
    `Fault.spec`); raise BadInput (the run is refused, exit 2) if it needs a point the script does not have.
    Returns the Fault instance."""
    from disttrace.run import faults

    cls = faults.get(spec["name"])
    if engine.kind == "DeepSpeed":
        from disttrace.run import deepspeed

        deepspeed.check_fault(cls.name, engine.zero_stage)
    params = dict(spec.get("params") or {})
    record = cls.attached(spec["step"], spec["rank"], params, manifest, engine.kind, caps, names)
    return faults.build(record)
