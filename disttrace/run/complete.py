"""The end of a run, the same for our trainer and an attached script: every rank hashes the files it wrote
(they may sit on another node's disk) and all-gathers its part, which is also the barrier; global rank 0
seals them all into COMPLETE (store/seal.py), written last: without it a run is incomplete."""

from __future__ import annotations

from pathlib import Path

from disttrace.store import seal
from disttrace.store.rundir import mark_complete


def seal_and_complete(run_dir: Path, rank: int, recorder, dist, fields: dict) -> None:
    """`recorder`: the run's Recorder (None when nothing was recorded); `dist`: torch.distributed when the
    job has a process group, else None; `fields`: what COMPLETE says besides the seal (steps, world size...)."""
    mine = seal.rank_part(run_dir, rank, recorder.chain.last if recorder else None,
                          recorder.chain.steps if recorder else 0)
    parts = [mine]
    if dist is not None and dist.is_initialized():
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    if rank == 0:
        mark_complete(run_dir, {**fields, "seal": seal.build_seal(run_dir, parts)})
