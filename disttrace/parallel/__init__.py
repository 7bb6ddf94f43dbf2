"""Strategies: how a plain model is made parallel, each on torch.distributed's own engine.

A strategy owns the wrapped model and the optimizer and exposes the few things the training loop needs:
`micro_batch(last)` (a context: accumulate locally or synchronise), `backward(loss, bus, last)` (emits the
`backward` and `reduce` hook points), `step(bus)` (emits `before_optimizer` and `optimizer`) and the
state for checkpoints. The loop never asks which strategy it has.
"""

from .ddp import DataParallel


def build_strategy(manifest: dict, model, mesh, bus):
    par = manifest["parallelism"]
    if par["tp"] == 1 and par["pp"] == 1 and par["zero_stage"] == 0 and par["architecture"] == "allreduce":
        return DataParallel(manifest, model, mesh, bus)
    raise NotImplementedError(f"no strategy for parallelism {par}")  # freeze refuses these earlier
