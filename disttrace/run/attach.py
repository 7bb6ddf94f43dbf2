"""Instrument your own training script in a few lines; it writes the same run store, so `disttrace diff`,
`check`, `show` and `trace` work on it.

    import disttrace.api as disttrace
    run = disttrace.attach(ddp_model, optimizer, out="runs", name="my-experiment", seed=0)
    for step, (x, y) in enumerate(loader, 1):
        ...                       # forward, loss, loss.backward() as before
        run.loss(loss)            # optional: the loss record
        optimizer.step()          # gradients and parameters are recorded by optimizer hooks
    run.close()                   # marks the run complete

What is recorded: per optimizer step, the (reduced) gradients just before `optimizer.step()` (`reduce`
phase), the parameters and optimizer state just after it (`optimizer` phase), the loss if given, and every
collective (the same dispatch-mode tracer as disttrace's own runs). Requires torch.distributed to be
initialised (any backend) or runs single-process as rank 0.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import orjson
import torch

from disttrace.run.collectives import CollectiveTracer
from disttrace.run.hooks import HookBus
from disttrace.run.parallel.common import optimizer_state_list
from disttrace.run.recorder import Recorder
from disttrace.store import seal
from disttrace.store.rundir import LOCK, mark_complete, write_json_atomic


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_path(path: str | None) -> str:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return path
    box = [path]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class AttachedRun:
    def __init__(self, model, optimizer, run_dir: Path, rank: int):
        self.run_dir, self.rank = run_dir, rank
        inner = getattr(model, "module", model)  # DDP wraps the user's module
        self.named = [(i, n, p) for i, (n, p) in enumerate(inner.named_parameters())]
        self.optimizer = optimizer
        self.bus = HookBus(rank)
        self.recorder = Recorder(run_dir, rank).attach(self.bus)
        self.tracer = CollectiveTracer(run_dir, rank)
        self.tracer.__enter__()
        self.step = 1
        self.bus.step, self.bus.micro_batch = 1, 0
        self.bus.emit("step_start")
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]

    def loss(self, loss: torch.Tensor) -> None:
        self.bus.emit("loss", loss=loss.detach(), tokens=0)

    def _before_step(self, _opt, _args, _kwargs):
        self.bus.emit("reduce", grads=[(i, n, p.grad) for i, n, p in self.named if p.grad is not None])

    def _after_step(self, _opt, _args, _kwargs):
        self.bus.emit("optimizer", params=self.named, state=optimizer_state_list(self.optimizer, self.named))
        self.bus.emit("step_end")
        self.step += 1
        self.tracer.step = self.bus.step = self.step
        self.bus.emit("step_start")

    def close(self) -> None:
        import torch.distributed as dist

        for h in self._handles:
            h.remove()
        self.tracer.__exit__(None, None, None)
        self.tracer.close()
        self.recorder.close()
        # each rank hashes the files it wrote; the gather is also the barrier (disttrace.store.seal)
        parts = [seal.rank_part(self.run_dir, self.rank, self.recorder.chain.last, self.recorder.chain.steps)]
        if dist.is_available() and dist.is_initialized():
            mine, parts = parts[0], [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        if self.rank == 0:
            mark_complete(self.run_dir, {"steps": self.step - 1, "source": "disttrace.api",
                                         "seal": seal.build_seal(self.run_dir, parts)})


def attach(model, optimizer, out: str | Path = "runs", name: str = "user-script", seed: int = 0,
           edition: str = "user", config: dict | None = None) -> AttachedRun:
    """Attach the recorder to a model and its optimizer; every rank calls it (it is collective)."""
    rank, world = _rank_world()
    inner = getattr(model, "module", model)
    manifest = {
        "experiment": {"name": name, "edition": edition, "seed": seed, "description": "recorded by disttrace.api"},
        "parallelism": {"dp": world, "tp": 1, "pp": 1, "zero_stage": 0, "world_size": world,
                        "architecture": "allreduce"},
        "model": {"parameters": sum(p.numel() for p in inner.parameters()),
                  "tensors": [n for n, _ in inner.named_parameters()]},
        "training": {"optimizer": type(optimizer).__name__, **(config or {})},
    }
    manifest_id = hashlib.sha256(orjson.dumps(manifest, option=orjson.OPT_SORT_KEYS)).hexdigest()
    path = None
    if rank == 0:
        from disttrace.store.rundir import new_run_dir

        path = str(new_run_dir(out, manifest_id, "reference"))
        write_json_atomic(Path(path) / LOCK, {"manifest": manifest, "manifest_id": manifest_id,
                                              "source": "disttrace.api", "overrides": [], "resolved": {}})
        write_json_atomic(Path(path) / "run.json", {"path": "reference", "fault": None, "resume": None,
                                                    "created": time.time(), "pid": os.getpid()})
    run_dir = Path(_broadcast_path(path))
    return AttachedRun(model, optimizer, run_dir, rank)
