"""Saving and loading recovery checkpoints inside the job: DCP for the tensors, then the INDEX.json that
`disttrace.store.checkpoints` writes and verifies. Publication is atomic (see that module)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from disttrace.run.job.hooks import BeforeCheckpoint, Checkpoint
from disttrace.store.checkpoints import step_dir, verify, write_index
from disttrace.store.writers import writing


def save(
    strategy,
    run_dir: Path,
    step: int,
    manifest_id: str,
    world_size: int,
    rank: int,
    bus,
    extra: dict,
):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    final = step_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    state = bus.emit(BeforeCheckpoint(state=strategy.state_dict(), step=step)).state
    # per-rank entries (RNG) get per-rank keys: DCP writes replicated keys once, these it must keep apart
    state[f"rng/rank-{rank:05d}"] = torch.get_rng_state()
    state["progress"] = {"step": step, **extra}
    if rank == 0:
        partial.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    # a full disk inside DCP surfaces as its CheckpointException (another rank's OSError within), which
    # names no file: the checkpoint being written is named instead
    with writing(partial):
        dcp.save(state, checkpoint_id=str(partial))
    dist.barrier()
    if rank == 0:
        contents = sorted(k for k in state if not k.startswith("rng/"))
        with writing(partial):
            write_index(partial, step, manifest_id, world_size, contents)
        os.replace(partial, final)
    dist.barrier()
    bus.emit(Checkpoint(path=final, step=step))
    return final


@dataclass(frozen=True)
class Loaded:
    """Where a loaded checkpoint leaves the run: the step it was saved after, and whether it held the
    optimizer's state (its `progress` item, a mapping in DCP's state, holds the step and what the saver
    added, `extra`)."""

    step: int
    with_optimizer: bool
    extra: dict


def load(strategy, ckpt: Path, rank: int, manifest_id: str) -> Loaded:
    """Load a verified checkpoint into the strategy; returns where it leaves the run."""
    import torch

    from disttrace.run.job import safeload

    index = verify(ckpt, manifest_id)
    with_optim = "optim" in index.get("contents", [])
    # a template with the checkpoint's structure; DCP fills it in place
    state = strategy.empty_state(with_optim)
    state[f"rng/rank-{rank:05d}"] = torch.get_rng_state()
    state["progress"] = {"step": 0}
    safeload.load(
        state, ckpt
    )  # never DCP's plain pickle.load: the checkpoint may come from elsewhere
    strategy.load_state_dict(state)
    torch.set_rng_state(state[f"rng/rank-{rank:05d}"])
    saved = dict(state["progress"])  # DCP's state is a mapping: the item is one too
    return Loaded(step=int(saved.pop("step")), with_optimizer=with_optim, extra=saved)
