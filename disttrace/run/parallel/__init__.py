"""Strategies: how a plain model is made parallel, each on torch.distributed's own engine.

A strategy owns the wrapped model and the optimizer and exposes the few things the training loop needs:
`micro_batch(last)` (a context: accumulate locally or synchronise), `backward(loss, last)` (emits the
`backward` and `reduce` hook points), `step()` (emits `before_optimizer` and `optimizer`), the state for
checkpoints and `replicas()` (which copies must agree across ranks). The loop never asks which it has.

| manifest | strategy | engine |
| --- | --- | --- |
| zero_stage 0 | DataParallel | DistributedDataParallel (+ comm hook) |
| zero_stage 1 | ZeroStage1 | DDP + ZeroRedundancyOptimizer |
| zero_stage 2, 3 | FullyShardedZero | FSDP2 fully_shard (reshard_after_forward False / True) |
| architecture parameter-server | ParameterServer | ours: send/recv to rank 0 (no engine offers one) |
| pp > 1 | PipelineParallel | torch.distributed.pipelining (GPipe, 1F1B), hand-built stages |
| tp > 1 | TensorParallel | DTensor parallelize_module (+ FSDP2 over dp when dp > 1) |
| ep > 1 | ExpertParallel | DDP for the dense part + experts as DTensor shards, tokens by all_to_all |
| cp > 1 | ContextParallel | DDP over dp x cp + the sequence sliced, keys and values all-gathered |
"""

from __future__ import annotations

from disttrace.config.manifest import Manifest


def build_strategy(manifest: Manifest, model, mesh, bus):
    par = manifest.parallelism
    if par.architecture == "parameter-server":
        from disttrace.run.parallel.ps import ParameterServer

        return ParameterServer(manifest, model, mesh, bus)
    if par.pp > 1:
        from disttrace.run.parallel.pp import PipelineParallel

        return PipelineParallel(manifest, model, mesh, bus)
    if par.tp > 1:
        from disttrace.run.parallel.tp import TensorParallel

        return TensorParallel(manifest, model, mesh, bus)
    if par.ep > 1:
        from disttrace.run.parallel.ep import ExpertParallel

        return ExpertParallel(manifest, model, mesh, bus)
    if par.cp > 1:
        from disttrace.run.parallel.cp import ContextParallel

        return ContextParallel(manifest, model, mesh, bus)
    if par.zero_stage in (2, 3):
        from disttrace.run.parallel.fsdp import FullyShardedZero

        return FullyShardedZero(manifest, model, mesh, bus, stage=par.zero_stage)
    if par.zero_stage == 1:
        from disttrace.run.parallel.zero import ZeroStage1

        return ZeroStage1(manifest, model, mesh, bus)
    from disttrace.run.parallel.ddp import DataParallel

    return DataParallel(manifest, model, mesh, bus)
