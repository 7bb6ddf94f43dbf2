"""Instrument your own training script; it writes the same run store as disttrace's own runs, so `diff`,
`check`, `show`, `trace`, `verify` and `gate` read it.

    import disttrace.api as disttrace
    run = disttrace.attach(ddp_model, optimizer, config={"lr": 1e-3, "batch": 8},   # every rank
                           loader=loader, forward=True)   # optional: the loader's batches; block outputs
    for step ...:
        for micro_batch ...:                      # x from `loader` (watched in place) or run.watch_loader(loader)
            run.batch(x)                          # optional: the data record (default: the forward's input)
            loss = run.loss(loss_fn(ddp_model(x), y))   # the loss record; returns the loss to backprop
            loss.backward()
        torch.nn.utils.clip_grad_norm_(...)       # recorded as the clip phase while attached
        optimizer.step()                          # reduce and optimizer records, then the next step
    run.close()                                   # marks the run complete

Phases, as in the harness's runs: each forward of the model between two optimizer steps is a micro-batch;
`data` (the batch a watched loader handed out, with its DistributedSampler's sample ids; run.batch; or the
forward's first tensor input), `forward` (the outputs a tensor-parallel style declares Replicate;
forward=True adds each top-level block's, or given module paths),
`loss` (run.loss), `backward` (the local gradient
before the reduce: DDP's comm hook, installed here, or the end of each backward pass when there is no
DDP), `reduce` (the gradients as the step begins: after DDP's all-reduce, or the script's own),
`clip` (when torch.nn.utils.clip_grad_norm_ runs: gradients after clipping, total norm, clip coefficient,
lr), `optimizer` (parameters, optimizer state, every param group's lr).

At attach every rank digests every parameter and the digests are gathered: the replica map
(`replicas.json`) comes from the engine (DDP: reduced gradients, parameters and optimizer state agree over
its group; FSDP2: data differs over its mesh; DTensor: placements) and, without one, from which copies
are identical now (they must stay identical after every optimizer step). Run it under `disttrace run --
CMD` / `disttrace inject ... -- CMD`: the run directory (and the fault) come from DISTTRACE_RUN_DIR.

The package holds one concern a module: comm (the collectives attach runs), engine (what attach sees of
the model), replicas (the replica map and topology it infers), manifest, faults (the fault's context and
build_fault), points (the hook points installed in torch), steps (the step cycle), loader (loader watching),
run (AttachedRun, the user's calls) and start (attach() and the run directory).
"""

from disttrace.run.attach.comm import _broadcast, _gather, _rank_world, initialized_dist
from disttrace.run.attach.engine import (
    ENGINES,
    Engine,
    detect_engine,
    local_view,
    replicated_outputs,
    unwrap_optimizer,
)
from disttrace.run.attach.faults import FaultContext, build_fault
from disttrace.run.attach.loader import (
    WatchedLoader,
    _planned_sample_ids,
    batch_inputs,
    first_tensor,
)
from disttrace.run.attach.manifest import (
    SOURCE,
    build_manifest,
    evaluation_section,
    manifest_id_of,
)
from disttrace.run.attach.replicas import attached_layout, infer_replicas, mesh_doc, topology_doc
from disttrace.run.attach.run import AttachedRun
from disttrace.run.attach.start import RUN_DIR_ENV, attach
from disttrace.run.attach.steps import observed_batch

__all__ = [
    "ENGINES",
    "RUN_DIR_ENV",
    "SOURCE",
    "AttachedRun",
    "Engine",
    "FaultContext",
    "WatchedLoader",
    "batch_inputs",
    "_broadcast",
    "initialized_dist",
    "first_tensor",
    "_gather",
    "_planned_sample_ids",
    "_rank_world",
    "attach",
    "attached_layout",
    "build_fault",
    "build_manifest",
    "detect_engine",
    "evaluation_section",
    "infer_replicas",
    "local_view",
    "manifest_id_of",
    "mesh_doc",
    "observed_batch",
    "replicated_outputs",
    "topology_doc",
    "unwrap_optimizer",
]
