"""attach(): what every rank does before the run starts (the views gathered, the manifest built, rank 0's
run directory with its lock, env, topology and replica map), then the AttachedRun."""

from __future__ import annotations

import os
import time
from contextvars import ContextVar
from pathlib import Path

import torch

from disttrace.errors import BadInput
from disttrace.run.attach.comm import _broadcast, _gather, _rank_world, initialized_dist
from disttrace.run.attach.engine import (
    Engine,
    detect_engine,
    local_view,
    named_parameters,
    replicated_outputs,
    unwrap_optimizer,
    views_of,
)
from disttrace.run.attach.manifest import SOURCE, build_manifest, evaluation_section, manifest_id_of
from disttrace.run.attach.replicas import (
    infer_replicas,
    layout_groups,
    parse_layout,
    topology_doc,
)
from disttrace.run.attach.run import AttachedRun
from disttrace.store.documents import RunInfo
from disttrace.store.events import Attached
from disttrace.store.records import ZERO_CODE_SOURCE
from disttrace.store.rundir import LOCK, read_run_info
from disttrace.store.writers import event, new_run_dir, write_json_atomic, write_run_info

RUN_DIR_ENV = "DISTTRACE_RUN_DIR"  # set by `disttrace run -- CMD`: the prepared run directory


def _blocks(inner: torch.nn.Module, forward) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose outputs the `forward` phase records: by default (None) the outputs a
    tensor-parallel style declares Replicate, which the replica rules hold to agree (few, and the first
    place an unsummed row-parallel output or a dropout drifting across tp ranks shows); the model's
    top-level children and those (forward=True); the given module paths; none (False)."""
    if forward is None:
        declared = set(replicated_outputs(inner))
        return [(n, m) for n, m in _post_order(inner) if n in declared]
    if not forward:
        return []
    if forward is True:
        blocks = list(inner.named_children())
        extra = [p for p in replicated_outputs(inner) if p not in dict(blocks)]
        if not extra:
            return blocks
        # and every output a tensor-parallel style declares Replicate (the replica rules hold them), in
        # post-order: a module's output is computed before its parent's
        wanted = set(dict(blocks)) | set(extra)
        return [(n, m) for n, m in _post_order(inner) if n in wanted]
    out = []
    for path in forward:
        try:
            out.append((str(path), inner.get_submodule(str(path))))
        except AttributeError:
            children = ", ".join(n for n, _ in inner.named_children())
            raise BadInput(
                "attach(forward=...)",
                f"the model has no module '{path}'; its top-level blocks: {children}",
            ) from None
    return out


def _post_order(module: torch.nn.Module, prefix: str = ""):
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        yield from _post_order(child, path)
        yield path, child


# "zero-code" while attach_discovered runs attach for a command that never called it (run/zerocode/recording.py)
_RECORDING: ContextVar[str | None] = ContextVar("recording", default=None)


def attach_discovered(model, optimizer) -> AttachedRun:
    """attach() with its defaults for a command run with no attach call (run/zerocode/recording.py found its model
    and optimizer); the lock's `source` and the manifest's `record.source` say what was inferred."""
    token = _RECORDING.set("zero-code")
    try:
        return attach(model, optimizer)
    finally:
        _RECORDING.reset(token)


def attach(
    model,
    optimizer,
    out: str | Path = "runs",
    name: str = "user-script",
    seed: int | None = None,
    edition: str = "user",
    config: dict | None = None,
    loader=None,
    forward=None,
    evaluation: dict | None = None,
    layout: dict | None = None,
) -> AttachedRun:
    """Attach the recorder to a model and its optimizer; every rank calls it (it is collective).

    model: the module as trained (DDP-wrapped, FSDP2-sharded, DTensor or plain), or a
    DeepSpeedEngine (integrations/deepspeed/); optimizer: the torch
    optimizer (HF/Lightning wrappers are unwrapped). config: the experiment's settings (lr, batch, data...):
    stored in the manifest, so diff refuses runs of different experiments and names the fields; the keys
    grad_accum_steps, micro_batch_size and steps also fill the manifest's typed fields. seed: default the
    default generator's (torch.initial_seed()). loader: the training DataLoader, watched in place (its
    batches become the `data` records, with its DistributedSampler's sample ids; see
    AttachedRun.watch_loader). forward: which module outputs the `forward` phase records: by default every
    module whose tensor-parallel style declares its output Replicate (the replica check holds them to
    agree; none without tensor parallelism), True for the model's top-level children as well, a list of
    module paths ("layers.0", "head"), or False for none; the manifest's record.forward says which. evaluation: the gate's evaluation of this run's final checkpoint when it is
    the reference, the policy's `[eval]` keys (command, metric, better, rtol, atol, timeout_s, env, data,
    data_sha256, cwd; docs/gate.md): data and cwd are resolved against the working directory and the data
    hashed here, by rank 0. layout: what the replica rules cannot see, {"cp": group, "ep": group}, each
    this rank's ProcessGroup, one-dimensional DeviceMesh or list of global ranks (docs/replicas.md: a
    context-parallel group's ranks read one batch; an expert-parallel mesh dimension not named "ep" is
    not tensor parallelism). Under `disttrace run/inject -- CMD` the run directory (and fault) come from
    DISTTRACE_RUN_DIR and `out` is ignored."""
    recording = _RECORDING.get()
    rank, world = _rank_world()
    optimizer = unwrap_optimizer(optimizer)
    engine = detect_engine(model)
    named = list(enumerate(named_parameters(engine.inner)))
    said = parse_layout(layout, rank)
    views = views_of(
        _gather(local_view(engine, [(i, n, p) for i, (n, p) in named], rank, said).wire())
    )
    layout_groups(views)  # every rank refuses a layout whose groups do not split the world
    eval_section, eval_resolved, eval_error = None, {}, None
    if evaluation is not None:
        if rank == 0:
            try:
                eval_section, eval_resolved = evaluation_section(evaluation)
            except BadInput as e:
                eval_error = e
        eval_section, eval_resolved, message = _broadcast(
            (eval_section, eval_resolved, str(eval_error) if eval_error else None)
        )
        if eval_error is not None:
            raise eval_error
        if message:
            raise BadInput("attach(evaluation=)", message)
    manifest = build_manifest(
        engine, optimizer, views, name, edition, seed, config, evaluation=eval_section
    )
    blocks = _blocks(engine.inner, forward)
    # what is recorded, not the experiment (diff compares runs that differ here), as the harness's [record]
    manifest["record"] = {
        "every": 1,
        "forward": bool(blocks),
        "forward_modules": [n for n, _ in blocks],
        # how the run was found: absent for an attach call (its manifests, and so their ids, unchanged)
        **({"source": recording} if recording else {}),
    }
    manifest_id = manifest_id_of(manifest)
    prepared = os.environ.get(RUN_DIR_ENV)
    path, failure = None, None
    if rank == 0:
        try:
            path = _prepare_dir(
                prepared,
                out,
                manifest,
                manifest_id,
                engine,
                views,
                eval_resolved,
                source=ZERO_CODE_SOURCE if recording == "zero-code" else SOURCE,
            )
        except BadInput as e:
            failure = e
    path, error = _broadcast((path, str(failure) if failure else None))
    if failure is not None:
        raise failure
    if error:
        raise RuntimeError(f"rank 0 could not prepare the run directory: {error}")
    run_dir = Path(path)
    info = read_run_info(run_dir)
    kind = AttachedRun
    if engine.kind == "DeepSpeed":
        from disttrace.run.deepspeed import DeepSpeedRun as kind
    run = kind(
        model,
        optimizer,
        run_dir,
        rank,
        engine,
        manifest,
        manifest_id,
        info.fault.doc() if info.fault else None,
        blocks,
        depth=_depth_request(info, run_dir, rank, engine, views),
    )
    if loader is not None:
        run._watch_in_place(loader)
    return run


def _depth_request(info: RunInfo, run_dir: Path, rank: int, engine: Engine, views):
    """run.json's `depth` (a replay recording one step at depth, docs/zoom.md), with this rank's place in
    the data-parallel layout the records are placed by; None when there is none."""
    from disttrace.run.attach.replicas import attached_layout
    from disttrace.run.record.depth import DepthRequest, attached_spec

    spec = attached_spec(info.doc(), run_dir / "run.json")
    if spec is None:
        return None
    dp_groups, _ = attached_layout(engine.kind, views)
    group = next((g for g in dp_groups if rank in g), [rank])
    return DepthRequest(**spec, dp=len(group), dp_rank=group.index(rank))


def _prepare_dir(
    prepared: str | None,
    out,
    manifest: dict,
    manifest_id: str,
    engine: Engine,
    views: list[dict],
    resolved: dict | None = None,
    source: str = SOURCE,
) -> str:
    """Rank 0: the run directory (prepared by the CLI, or a new one) with the lock, run.json, env.json,
    topology.json and replicas.json."""
    from disttrace.run.job.worker import environment

    if prepared:
        run_dir = Path(prepared)
        if not (run_dir / "run.json").exists():
            raise BadInput(run_dir, f"{RUN_DIR_ENV} is not a prepared run directory (no run.json)")
        if (run_dir / LOCK).exists():
            raise BadInput(
                run_dir / LOCK, "this run directory was attached already (one attach per run)"
            )
    else:
        run_dir = new_run_dir(out, manifest_id, "reference")
        info = RunInfo(
            path="reference", fault=None, resume=None, created=time.time(), pid=os.getpid()
        )
        write_run_info(run_dir, info)
    write_json_atomic(
        run_dir / LOCK,
        {
            "manifest": manifest,
            "manifest_id": manifest_id,
            "source": source,
            "overrides": [],
            "resolved": dict(resolved or {}),
        },
    )
    dist = initialized_dist()
    backend = dist.get_backend() if dist else None
    write_json_atomic(run_dir / "env.json", environment(torch, backend, [v.host for v in views]))
    write_json_atomic(run_dir / "topology.json", topology_doc(engine, views).doc())
    replicas = infer_replicas(engine.kind, views)
    write_json_atomic(run_dir / "replicas.json", replicas.doc())
    event(
        run_dir,
        Attached(
            engine=engine.kind,
            world_size=len(views),
            manifest_id=manifest_id,
            replica_rules=len(replicas.rules),
        ),
    )
    return str(run_dir)
