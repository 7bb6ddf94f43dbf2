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
forward's first tensor input), `forward` (optional: each top-level block's output, or given module paths),
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
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from disttrace.errors import BadInput
from disttrace.run.collectives import CollectiveTracer
from disttrace.run.complete import gather_released, seal_and_complete
from disttrace.run.hooks import HookBus, process_exit
from disttrace.run.parallel.common import (
    SCALAR_INDEX,
    SCALARS_AGREE,
    Strategy,
    optimizer_state_list,
)
from disttrace.run.recorder import Recorder
from disttrace.store.records import ATTACHED_SOURCE, Event
from disttrace.store.rundir import LOCK, event, new_run_dir, read_json, write_json_atomic

RUN_DIR_ENV = "DISTTRACE_RUN_DIR"  # set by `disttrace run -- CMD`: the prepared run directory
SOURCE = ATTACHED_SOURCE  # the lock's `source` of attached runs (readers ask Run.attached)
ENGINES = ("plain", "DDP", "FSDP2", "DTensor", "DeepSpeed")


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank_world() -> tuple[int, int]:
    dist = _dist()
    return (dist.get_rank(), dist.get_world_size()) if dist else (0, 1)


def _gather(obj) -> list:
    dist = _dist()
    if dist is None:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj):
    dist = _dist()
    if dist is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _jsonable(v: Any) -> Any:
    """Hyper-parameters and user config as JSON (tuples as lists, tensors as numbers, the rest as text)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    return str(v)


def unwrap_optimizer(opt):
    """HF's AcceleratedOptimizer and Lightning's LightningOptimizer wrap the torch optimizer as .optimizer."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


# ---------------------------------------------------------------- what attach sees


@dataclass
class Engine:
    kind: str  # plain | DDP | FSDP2 | DTensor | DeepSpeed
    inner: torch.nn.Module  # the user's module (DDP's .module)
    ddp: Any = None  # DDP, or the DeepSpeedEngine
    # DDP's (DeepSpeed's) data-parallel group, global ranks
    group_ranks: list[int] = field(default_factory=list)
    zero_stage: int = 0


def detect_engine(model) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrace.integrations import deepspeed

    if deepspeed.is_engine(model):
        return deepspeed.detect(model)
    if isinstance(model, DDP):
        dist = _dist()
        ranks = dist.get_process_group_ranks(model.process_group) if dist else [0]
        return Engine("DDP", model.module, model, sorted(ranks))
    fsdp = False
    try:
        from torch.distributed.fsdp import FSDPModule

        fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    except ImportError:
        pass
    dtensor = any(hasattr(p, "placements") for p in model.parameters())
    return Engine("FSDP2" if fsdp else "DTensor" if dtensor else "plain", model)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _is_constant(t) -> bool:
    """A tensor whose elements are all equal (zeros, ones, a scalar) is equal on independent ranks by
    construction, not by synchronisation: its equality at attach says nothing about replicas."""
    t = _local(t).detach()
    if t.numel() <= 1:
        return True
    flat = t.reshape(-1)
    return bool((flat == flat[0]).all())


def _process_groups() -> list[dict]:
    """The process groups torch built that this rank is in (private c10d tables: best effort)."""
    dist = _dist()
    if dist is None:
        return [{"name": "world", "ranks": [0], "backend": None}]
    try:
        from torch.distributed import distributed_c10d as c10d

        out = []
        for pg, ranks in c10d._world.pg_group_ranks.items():
            try:
                backend = str(dist.get_backend(pg))
            except (RuntimeError, ValueError):
                backend = None
            out.append(
                {
                    "name": c10d._world.pg_names.get(pg, ""),
                    "ranks": sorted(ranks),
                    "backend": backend,
                }
            )
        return out
    except (AttributeError, RuntimeError):
        return [
            {
                "name": "world",
                "ranks": list(range(dist.get_world_size())),
                "backend": dist.get_backend(),
            }
        ]


def _mesh_groups(mesh, dim: int) -> list[list[int]]:
    """The rank groups along one dimension of a DeviceMesh (same coordinates on every other dimension)."""
    ranks = mesh.mesh
    size = ranks.shape[dim]
    return sorted(ranks.movedim(dim, -1).reshape(-1, size).tolist())


def _fsdp_groups(model) -> list[list[int]]:
    """The rank groups FSDP2 shards over (its data-parallel mesh, all of it for HSDP), from each
    fully_shard unit's mesh (private FSDP2 state: best effort, empty if torch moved it)."""
    groups = set()
    try:
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
            if group is not None:
                groups.add(tuple(sorted(group.mesh_info.mesh.mesh.flatten().tolist())))
    except (ImportError, AttributeError):
        return []
    return [list(g) for g in sorted(groups)]


def local_view(engine: Engine, named, rank: int) -> dict:
    """What this rank sees at attach: its parameters' digests, its process groups, where it runs."""
    import socket

    from disttrace.run.digest import digest_tensor

    params = {}
    for _, name, p in named:
        with torch.no_grad():
            params[name] = {"digest": digest_tensor(p)["digest"], "constant": _is_constant(p)}
        if hasattr(p, "placements") and hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            params[name]["replicate"] = {
                (mesh.mesh_dim_names[d] if mesh.mesh_dim_names else str(d)): _mesh_groups(mesh, d)
                for d, pl in enumerate(p.placements)
                if pl.is_replicate()
            }
            params[name]["shard_dims"] = [d for d, pl in enumerate(p.placements) if pl.is_shard()]
            params[name]["shard"] = {
                (mesh.mesh_dim_names[d] if mesh.mesh_dim_names else str(d)): _mesh_groups(mesh, d)
                for d, pl in enumerate(p.placements)
                if pl.is_shard()
            }
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "node_rank": int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "pid": os.getpid(),
        "params": params,
        "ddp_group": engine.group_ranks,
        "zero_stage": engine.zero_stage,
        "process_groups": _process_groups(),
        "fsdp_groups": _fsdp_groups(engine.inner) if engine.kind == "FSDP2" else [],
        "replicated_outputs": {
            path: {"dim": dim, "groups": gs}
            for path, (dim, gs) in replicated_outputs(engine.inner).items()
        },
        "seed": torch.initial_seed(),
    }


def replicated_outputs(inner: torch.nn.Module) -> dict[str, tuple[str, list[list[int]]]]:
    """Module path -> (mesh dimension, its rank groups) for the modules whose tensor-parallel style declares
    their output Replicate over that dimension: a RowwiseParallel output after its reduction (its default),
    a ColwiseParallel(output_layouts=Replicate()), a PrepareModuleOutput to Replicate. Read from the forward
    hooks parallelize_module registered (DTensor's distribute_module closes over the style's output
    function and the mesh; best effort: a torch that stores them otherwise gives none)."""
    import functools

    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ParallelStyle
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:
        return {}
    out = {}
    for path, module in inner.named_modules():
        if not path:
            continue
        for hook in list(getattr(module, "_forward_hooks", {}).values()):
            cells = []
            for c in getattr(hook, "__closure__", None) or ():
                try:
                    cells.append(c.cell_contents)
                except ValueError:  # an empty cell
                    continue
            mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
            layouts = None
            for c in cells:
                if (
                    isinstance(c, functools.partial)
                    and getattr(c.func, "__name__", "") == "_prepare_output_fn"
                    and c.args
                ):  # a style's static output function, given its output layouts
                    layouts = c.args[0]
                elif isinstance(c, ParallelStyle) and hasattr(c, "desired_output_layouts"):
                    layouts = c.desired_output_layouts
            if mesh is None or mesh.ndim != 1 or layouts is None:
                continue
            layouts = layouts if isinstance(layouts, (tuple, list)) else (layouts,)
            known = [x for x in layouts if x is not None]
            if (
                known
                and all(isinstance(x, Placement) for x in known)
                and all(isinstance(x, Replicate) for x in known)
            ):
                dim = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else "0"
                out[path] = (dim, _mesh_groups(mesh, 0))
    return out


def infer_replicas(engine: str, views: list[dict]) -> dict:
    """replicas.json for an attached run, in the harness's format ({"groups": {dim: [[ranks]]}, "rules": [...]}).

    DDP: the engine says it (data differs, reduced gradients, clip scalars, parameters and optimizer state
    agree over its group). FSDP2: its mesh is data parallelism (data differs there; the global gradient
    norm, clip coefficient and learning rates agree over the world). Tensor parallelism (the mesh dimensions
    a DTensor parameter is sharded over that are not FSDP2's): a tp group reads one batch and computes one
    loss, the clip scalars agree, every output its style declares Replicate agrees (replicated_outputs),
    and a plain parameter, which every rank of the group holds whole, has one reduced gradient and one value
    after the step. A DTensor parameter's Replicate placements name dimensions whose copies agree after the
    step (its gradient may legitimately be Partial until the optimizer reduces it, so not at `reduce`).
    Otherwise: copies identical at attach must have one reduced gradient and stay identical after every
    optimizer step (parameters whose elements are all equal are left out: equal by construction, they
    show nothing). docs/replicas.md lists every rule."""
    world = len(views)
    groups: dict[str, list[list[int]]] = {"world": [list(range(world))]}
    rules: list[dict] = []
    notes: list[str] = []
    if engine == "DeepSpeed":
        from disttrace.integrations import deepspeed

        return deepspeed.replicas(views)
    if engine == "DDP":
        dp = sorted({tuple(v["ddp_group"]) for v in views})
        groups["dp"] = [list(g) for g in dp]
        rules += [
            {"phase": "data", "dim": "dp", "relation": "differ"},
            {"phase": "reduce", "dim": "dp", "relation": "agree"},
            {"phase": "clip", "dim": "dp", "relation": "agree"},
            {"phase": "optimizer", "dim": "dp", "relation": "agree"},
        ]
        notes.append(
            f"DDP over {groups['dp']}: reduced gradients, clip, parameters and optimizer state agree"
        )
        return {"groups": groups, "rules": rules, "inferred": {"engine": engine, "notes": notes}}
    fsdp = sorted({tuple(g) for v in views for g in v.get("fsdp_groups", [])})
    if engine == "FSDP2" and fsdp:  # FSDP2 shards over data parallelism: each rank's batch differs
        groups["dp"] = [list(g) for g in fsdp]
        rules += [
            {"phase": "data", "dim": "dp", "relation": "differ"},
            SCALARS_AGREE,
            {
                "phase": "optimizer",
                "dim": "world",
                "relation": "agree",
                "tensors": ["param_groups.*.lr"],
            },
        ]
        notes.append(
            f"FSDP2 shards over {groups['dp']}: data differs there; the global gradient norm, "
            "clip coefficient and learning rates agree over the world"
        )
    tp: dict[str, list[list[int]]] = {}
    if engine in (
        "DTensor",
        "FSDP2",
    ):  # tensor parallelism: the shard dimensions that are not FSDP2's
        for v in views:
            for e in v["params"].values():
                for dim, gs in e.get("shard", {}).items():
                    if {tuple(g) for g in gs} != set(fsdp):
                        tp[f"mesh:{dim}"] = gs
    for dim, gs in sorted(tp.items()):
        groups[dim] = gs
        rules += [
            {"phase": "data", "dim": dim, "relation": "agree"},
            {"phase": "loss", "dim": dim, "relation": "agree"},
        ]
        notes.append(
            f"tensors sharded over {gs} ({dim}): those ranks read the same batch and compute one loss"
        )
    if tp and SCALARS_AGREE not in rules:
        rules.append(SCALARS_AGREE)
    outputs: dict[str, list[str]] = {}
    for v in views:
        for path, e in v.get("replicated_outputs", {}).items():
            key = f"mesh:{e['dim']}"
            groups.setdefault(key, e["groups"])
            outputs.setdefault(key, [])
            if path not in outputs[key]:
                outputs[key].append(path)
    for key, paths in sorted(outputs.items()):
        rules.append(
            {"phase": "forward", "dim": key, "relation": "agree", "tensors": sorted(paths)}
        )
        notes.append(
            f"{len(paths)} module output(s) declared Replicate over {key} by their parallel style"
        )
    names = sorted({n for v in views for n in v["params"]})
    by_dims: dict[tuple, list[str]] = {}
    whole: list[
        str
    ] = []  # plain parameters of a tensor-parallel job: every tp rank holds them whole
    for name in names:
        entries = {v["rank"]: v["params"][name] for v in views if name in v["params"]}
        first = next(iter(entries.values()))
        if "replicate" in first:  # a DTensor: its placements say it
            for dim, gs in first["replicate"].items():
                key = f"mesh:{dim}"
                groups.setdefault(key, gs)
                by_dims.setdefault((key,), []).append(name)
            continue
        if len(tp) == 1:
            whole.append(name)
            continue
        if all(e["constant"] for e in entries.values()):
            continue
        buckets: dict[str, list[int]] = {}
        for r, e in entries.items():
            buckets.setdefault(e["digest"], []).append(r)
        part = tuple(sorted(tuple(g) for g in buckets.values() if len(g) > 1))
        if part:
            by_dims.setdefault(part, []).append(name)
    if whole:
        (key,) = tp
        rules += [
            {"phase": phase, "dim": key, "relation": "agree", "tensors": whole}
            for phase in ("reduce", "optimizer")
        ]
        notes.append(
            f"{len(whole)} plain parameter(s) held whole by every rank of {key}: one reduced gradient, "
            "one value"
        )
    n = 0
    for key, tensors in sorted(by_dims.items(), key=lambda kv: str(kv[0])):
        if isinstance(key[0], str):  # a mesh dimension
            dim, phases = key[0], ("optimizer",)
        else:
            n += 1
            dim, phases = ("replicas" if n == 1 else f"replicas-{n}"), ("reduce", "optimizer")
            groups[dim] = [list(g) for g in key]
        rules += [
            {"phase": phase, "dim": dim, "relation": "agree", "tensors": sorted(tensors)}
            for phase in phases
        ]
        notes.append(
            f"{len(tensors)} parameter(s) identical across {groups[dim]} at attach ({dim})"
        )
    if not rules:
        notes.append("no parameter has an identical copy on another rank: nothing must agree")
    return {"groups": groups, "rules": rules, "inferred": {"engine": engine, "notes": notes}}


def attached_layout(kind: str, views: list[dict]) -> tuple[list[list[int]], list[list[int]]]:
    """(data-parallel groups, tensor-parallel groups) of an attached job, from its engine and its parameters'
    placements: DDP's group, or FSDP2's shard groups, are data parallelism; the mesh dimensions a DTensor
    parameter is sharded over that are not FSDP2's are tensor parallelism. Without tensor parallelism each
    rank is its own tp group; without an engine's data parallelism the ranks at one position of their tp
    groups form the dp groups (a TP-only job on its whole world: dp = 1). A layout that is not a grid
    (a rank in two groups of one kind) keeps every rank its own tp group."""
    world = len(views)
    if kind in ("DDP", "DeepSpeed"):
        dp = sorted({tuple(v["ddp_group"]) for v in views})
    else:
        dp = sorted({tuple(g) for v in views for g in v.get("fsdp_groups", [])})
    by_dim: dict[str, set] = {}
    for v in views:
        for entry in v["params"].values():
            for dim, gs in entry.get("shard", {}).items():
                by_dim.setdefault(dim, set()).update(tuple(g) for g in gs)
    tp = sorted({g for gs in by_dim.values() if gs != set(dp) for g in gs})
    if not _partition(tp, world):
        tp = [(r,) for r in range(world)]
    if not dp:
        dp = [tuple(sorted(g[i] for g in tp)) for i in range(len(tp[0]))]
    if not _partition(dp, world):
        dp = [tuple(range(world))]
    return [list(g) for g in dp], [list(g) for g in tp]


def mesh_doc(views: list[dict]) -> dict | None:
    """The device mesh the job's DTensor parameters (FSDP2's included) live on, as attach found it: each
    named dimension's size, and which dimensions some parameter is replicated over or sharded over (HSDP:
    replicate and shard; FSDP2 + TP: dp and tp both shard). None when no parameter is a DTensor."""
    dims: dict[str, int] = {}
    replicate: set[str] = set()
    shard: set[str] = set()
    for v in views:
        for entry in v["params"].values():
            for kind, into in (("replicate", replicate), ("shard", shard)):
                for dim, gs in entry.get(kind, {}).items():
                    dims[dim] = len(gs[0]) if gs else 1
                    into.add(dim)
    if not dims:
        return None
    return {"dims": dims, "replicate": sorted(replicate), "shard": sorted(shard)}


def _partition(groups: list[tuple], world: int) -> bool:
    """Groups of one size that hold every rank exactly once."""
    ranks = sorted(r for g in groups for r in g)
    return bool(groups) and len({len(g) for g in groups}) == 1 and ranks == list(range(world))


def topology_doc(engine: Engine, views: list[dict]) -> dict:
    """topology.json in the harness's shape (pp x dp x tp, coordinates per rank: a rank's place in its dp and
    tp groups), plus every process group torch built, as the ranks reported them."""
    world = len(views)
    dp_groups, tp_groups = attached_layout(engine.kind, views)
    place = {
        dim: {r: i for g in gs for i, r in enumerate(g)}
        for dim, gs in (("dp", dp_groups), ("tp", tp_groups))
    }
    pgs: dict[tuple, dict] = {}
    for v in views:
        for g in v["process_groups"]:
            pgs.setdefault((g["name"], tuple(g["ranks"])), g)
    return {
        "world_size": world,
        "mesh_dims": ["pp", "dp", "tp"],
        "mesh_shape": {"pp": 1, "dp": len(dp_groups[0]), "tp": len(tp_groups[0])},
        "groups": {"pp": [[r] for r in range(world)], "dp": dp_groups, "tp": tp_groups},
        "ranks": [
            {
                "rank": v["rank"],
                "host": v["host"],
                "node_rank": v["node_rank"],
                "local_rank": v["local_rank"],
                "pid": v["pid"],
                "coords": {
                    "pp": 0,
                    "dp": place["dp"].get(v["rank"], 0),
                    "tp": place["tp"].get(v["rank"], 0),
                },
            }
            for v in views
        ],
        "process_groups": [pgs[k] for k in sorted(pgs, key=lambda k: (len(k[1]), k))],
        "engine": engine.kind,
    }


def build_manifest(
    engine: Engine,
    optimizer,
    views: list[dict],
    name: str,
    edition: str,
    seed: int | None,
    config: dict | None,
    evaluation: dict | None = None,
) -> dict:
    """The experiment as attach sees it: the user's config plus the model's tensors, the optimizer and its
    hyper-parameters, the world, the engine and the default generator's seed. Two attached runs whose
    manifests differ in these are not the same experiment, and diff says which fields differ."""
    inner = engine.inner
    world = len(views)
    groups = [
        {k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    g0 = groups[0] if groups else {}
    training: dict = {"optimizer": type(optimizer).__name__}
    for key in ("lr", "weight_decay"):
        if key in g0:
            training[key] = g0[key]
    if isinstance(g0.get("betas"), list) and len(g0["betas"]) == 2:
        training["beta1"], training["beta2"] = g0["betas"]
    cfg = _jsonable(config or {})
    for key in ("grad_accum_steps", "micro_batch_size", "steps"):  # typed fields the readers know
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            # accumulation and micro-batch are topology (the global batch is compared), not the experiment
            training[key] = cfg.pop(key) if key != "steps" else cfg[key]
    from disttrace.integrations.deepspeed import logical_shape  # ZeRO-3 holds empty placeholders

    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in inner.parameters()})
    training["dtype"] = dtypes[0] if len(dtypes) == 1 else "mixed"
    dp_groups, tp_groups = attached_layout(engine.kind, views)
    from disttrace.config.attached import (
        AttachedManifest,
    )  # the shape, typed: a new key is declared there

    return AttachedManifest.model_validate(
        {
            "experiment": {
                "name": name,
                "edition": edition,
                "seed": int(views[0]["seed"] if seed is None else seed),
                "description": f"recorded by {SOURCE}",
            },
            "parallelism": {
                "dp": len(dp_groups[0]),
                "tp": len(tp_groups[0]),
                "pp": 1,
                "zero_stage": 3 if engine.kind == "FSDP2" else engine.zero_stage,
                "world_size": world,
                "architecture": "allreduce",
                "engine": engine.kind,
                **({"mesh": mesh} if (mesh := mesh_doc(views)) else {}),
            },
            "model": {
                "class": type(inner).__qualname__,
                "parameters": sum(math.prod(logical_shape(p)) for p in inner.parameters()),
                "tensors": {
                    n: {"shape": logical_shape(p), "dtype": str(p.dtype).removeprefix("torch.")}
                    for n, p in inner.named_parameters()
                },
            },
            "optimizer": {
                "type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                "param_groups": {str(i): g for i, g in enumerate(groups)},
            },
            "training": training,
            "config": cfg,
            **({"eval": evaluation} if evaluation is not None else {}),
        }
    ).document()


def manifest_id_of(manifest: dict) -> str:
    from disttrace.config.manifest import canonical_json

    return hashlib.sha256(
        canonical_json(manifest)
    ).hexdigest()  # the harness's manifest id, same rule


# ---------------------------------------------------------------- faults inside an attached run


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


# ---------------------------------------------------------------- the attached run


_ACTIVE: list[AttachedRun] = []  # the run that torch.nn.utils' clipping reports to
_ORIGINAL_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
# torch >= 2.6 splits clip_grad_norm_ in two public halves (what torchtitan's clipping calls); clip_grad_norm_
# calls the module's private names, so patching the public ones never records a clip twice
_ORIGINAL_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)
_ORIGINAL_WITH_NORM = getattr(torch.nn.utils, "clip_grads_with_norm_", None)


def _clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    if not _ACTIVE:
        return _ORIGINAL_CLIP(parameters, max_norm, *args, **kwargs)
    return _ACTIVE[-1]._clip(parameters, max_norm, *args, **kwargs)


def _get_total_norm(tensors, *args, **kwargs):
    """The gradients are final when their norm is taken: the step's reduce is recorded first."""
    if _ACTIVE:
        _ACTIVE[-1]._flush_reduce()
    return _ORIGINAL_TOTAL_NORM(tensors, *args, **kwargs)


def _clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
    if not _ACTIVE:
        return _ORIGINAL_WITH_NORM(parameters, max_norm, total_norm, *args, **kwargs)
    return _ACTIVE[-1]._clip_with_norm(parameters, max_norm, total_norm, *args, **kwargs)


def _patch_clip(on: bool) -> None:
    fn = _clip_grad_norm_ if on else _ORIGINAL_CLIP
    torch.nn.utils.clip_grad_norm_ = fn
    torch.nn.utils.clip_grad.clip_grad_norm_ = fn
    if _ORIGINAL_TOTAL_NORM is not None and _ORIGINAL_WITH_NORM is not None:
        torch.nn.utils.get_total_norm = _get_total_norm if on else _ORIGINAL_TOTAL_NORM
        torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_ if on else _ORIGINAL_WITH_NORM


class _CommHookState:
    """What DDP's comm hook holds. DDP keeps the hook and its state in C++ (its reducer), where Python's
    collector cannot see them: a hook that held the run would tie DDP -> reducer -> hook -> run -> DDP into a
    cycle no collection frees, keeping the model, the reducer and the process group (gloo's threads) alive
    until the process exits. So the run is held by weak reference, and a closed run's hook is DDP's plain
    all-reduce."""

    def __init__(self, run: AttachedRun, names: dict, group, size: int):
        self.run, self.names, self.group, self.size = weakref.ref(run), names, group, size


def _allreduce_with_hook(state: _CommHookState, bucket):
    """`backward` at DDP's comm hook: each bucket's local gradients right before its all-reduce (numerically
    DDP's default: divide by the group size, then sum)."""
    import torch.distributed as dist

    run = state.run()
    if run is not None and not run._closed:
        run._comm_fired = True
        grads = [(*state.names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
        run.bus.emit("backward", grads=grads, before_collective=True)
    buf = bucket.buffer()
    buf.div_(state.size)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(_first_value)


def _first_value(fut):
    return fut.value()[0]


class _UserState(Strategy):
    """The model and optimizer as a Strategy for run/checkpoint.py (DCP's state-dict helpers), or the
    user's own state dict when one is passed."""

    def __init__(self, model, optimizer, state: dict | None = None):
        self.model, self.optimizer, self.state = model, optimizer, state

    def state_dict(self, with_optimizer: bool = True) -> dict:
        return dict(self.state) if self.state is not None else super().state_dict(with_optimizer)

    def load_state_dict(self, state: dict) -> None:
        if self.state is None:
            super().load_state_dict(state)


class AttachedRun:
    def __init__(
        self,
        model,
        optimizer,
        run_dir: Path,
        rank: int,
        engine: Engine,
        manifest: dict,
        manifest_id: str,
        fault_spec: dict | None,
        blocks: list[tuple[str, torch.nn.Module]] = (),
    ):
        self.run_dir, self.rank = run_dir, rank
        self.model, self.engine, self.manifest, self.manifest_id = (
            model,
            engine,
            manifest,
            manifest_id,
        )
        self.inner = engine.inner
        self.named = [(i, n, p) for i, (n, p) in enumerate(self.inner.named_parameters())]
        self.optimizer = optimizer
        self.bus = HookBus(rank)
        self.tracer = CollectiveTracer(run_dir, rank)
        self.tracer.attach(
            self.bus
        )  # the step on each trace line (its handler holds the tracer, not the run)
        self.recorder = Recorder(run_dir, rank, forward=manifest["record"]["forward"]).attach(
            self.bus
        )
        self.ledger = self._memory_ledger()
        self.step = 1
        self._forwards = 0  # forwards of the model since the last optimizer step: the micro-batches
        self._data_mb: set[int] = set()
        self._pending: deque = (
            deque()
        )  # (inputs, sample ids) a watched DataLoader handed out, one per forward
        self._taken = (
            None  # the inputs of the batch the last training forward took (see _take_batch)
        )
        self._loaders: list = []  # loaders whose class attach swapped (restored at close)
        self._comm_fired = self._bw_queued = self._reduced = self._clipped = False
        # samples this rank's micro-batches of the current step held (None: one could not be counted), and
        # the first completed step's count: the experiment's global batch is summed from it at close
        self._samples: int | None = 0
        self._observed: dict | None = None
        self.completed = 0  # the last step whose optimizer stepped
        self._paused = (
            False  # inside our own checkpoint load/save: DCP's helpers may step the optimizer
        )
        self._stepped = (
            False  # the optimizer has stepped; the step's records close at the next forward
        )
        self._closed = False
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            self.inner.register_forward_pre_hook(self._on_forward, with_kwargs=True),
        ]
        if manifest["record"]["forward"]:
            self._handles += [
                module.register_forward_hook(self._block_output_hook(index, name))
                for index, (name, module) in enumerate(blocks)
            ]
        self.comm_hook = self._install_backward_points()
        self.capabilities = capabilities(engine, self.comm_hook)
        self.fault = None
        if fault_spec:
            names = [n for _, n, _ in self.named]
            try:
                self.fault = build_fault(fault_spec, engine, self.capabilities, manifest, names)
            except BadInput as e:
                if rank == 0:
                    event(
                        run_dir,
                        Event.FAULT_REFUSED,
                        fault=fault_spec.get("name"),
                        where=e.where,
                        field=e.field,
                        reason=e.reason,
                    )
                self._remove_hooks()
                raise
            ctx = SimpleNamespace(
                run_dir=run_dir,
                manifest=manifest,
                rank=rank,
                dp_rank=rank,
                strategy=SimpleNamespace(group=getattr(engine.ddp, "process_group", None)),
            )
            self.fault.attach(self.bus, ctx)
        self.tracer.__enter__()
        _ACTIVE.append(self)
        _patch_clip(True)
        self.bus.step, self.bus.micro_batch = 1, 0
        self.bus.emit("step_start")

    # ---------------------------------------------------------- the user's calls
    def batch(self, inputs, sample_ids=None) -> None:
        """The data record of the micro-batch about to run (call it before that forward)."""
        self._finish_step()
        mb = self._forwards
        self.bus.micro_batch = mb
        ids = sample_ids.tolist() if torch.is_tensor(sample_ids) else list(sample_ids or [])
        self._data_mb.add(mb)
        self._count(inputs)
        self.bus.emit(
            "data",
            batch={"inputs": inputs.detach(), "sample_ids": [int(i) for i in ids]},
            fetch=None,
        )

    def watch_loader(self, loader) -> WatchedLoader:
        """The training DataLoader as the run sees it: iterate what this returns instead of `loader`. Each
        batch it hands out is the `data` record of the next forward of the model, with the sample ids its
        DistributedSampler yielded for that batch (empty for samplers that cannot be read without drawing
        randomness). `attach(..., loader=loader)` does the same to the loader in place."""
        return WatchedLoader(self, loader)

    # what the integrations (integrations/hf.py, lightning.py) need of a watched loader's queue, where they
    # know better than the order of forwards which batch a forward reads
    def queued_inputs(self):
        """The inputs of the batch the next training forward will be paired with (None: nothing queued)."""
        return self._pending[0][0] if self._pending else None

    def queued_batches(self) -> int:
        return len(self._pending)

    def drop_queued_batches(self) -> None:
        """Forget the batches a watched loader handed out that no forward has taken: the forwards that follow
        record their own inputs, without sample ids (no id rather than another batch's)."""
        self._pending.clear()

    def watch_iterator(self, loader, iterator):
        """`iterator`, an iterator `loader` already made, watched as `attach(loader=)` watches the ones it makes."""
        return self._batches_of(loader, lambda: iterator)

    def _watch_in_place(self, loader) -> None:
        base = type(loader)
        ref = weakref.ref(
            self
        )  # the swapped class outlives close() until a collection: it must not hold the run

        def __iter__(self):
            run = ref()
            if run is None or run._closed:
                return base.__iter__(self)
            return run._batches_of(self, lambda: base.__iter__(self))

        namespace = {"__iter__": __iter__, "__module__": base.__module__, "_disttrace_base": base}
        swap = object.__dict__["__class__"].__set__  # the instance's class slot itself
        own = next(
            (k.__dict__["__class__"] for k in base.__mro__[:-1] if "__class__" in k.__dict__), None
        )
        if (
            own is not None
        ):  # accelerate's DataLoaderShard reports its inner DataLoader's class (a read-only
            if not isinstance(
                own, property
            ):  # property): keep reporting it, and let close() swap the class back
                return
            namespace["__class__"] = property(own.fget, swap)
        swap(loader, type(base.__name__, (base,), namespace))
        self._loaders.append((loader, base))

    def _batches_of(self, loader, make_iterator):
        """Yield the loader's batches, queueing each batch's inputs and sample ids for the forward that
        consumes it (a queue, not a record at once: a loop may fetch a whole accumulation window first)."""
        planned = _planned_sample_ids(loader)
        for n, batch in enumerate(make_iterator()):
            inputs = _batch_inputs(batch)
            # an evaluation pass (no_grad or eval mode) runs no micro-batch to consume the batch: not queued
            training = torch.is_grad_enabled() and self.inner.training
            if inputs is not None and training and not self._closed:
                ids = planned[n] if planned is not None and n < len(planned) else []
                self._pending.append((inputs.detach(), ids))
            yield batch

    def loss(self, loss: torch.Tensor, tokens: int = 0) -> torch.Tensor:
        """Record the loss of the current micro-batch (the last forward); returns the loss to backprop (a
        fault on the loss point acts on what this returns)."""
        self.bus.micro_batch = max(self._forwards - 1, 0)
        return self.bus.emit("loss", loss=loss, tokens=int(tokens))["loss"]

    def scalar(self, name: str, value) -> None:
        """A scalar every rank should agree on, recorded in this step's clip phase (after the step's reduce,
        recorded first): run.scalar("grad_norm", norm) is a hand-written clip's norm, held to the rule the
        clip scalars are (replicas.json)."""
        if self._forwards:  # after the step's backward passes: its gradients are final
            self._flush_reduce()
        t = (
            value.detach()
            if torch.is_tensor(value)
            else torch.tensor(float(value), dtype=torch.float64)
        )
        index = (
            SCALAR_INDEX + 100 + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16) % 100_000
        )
        self.recorder.add(self.bus, "clip", index, name, t)

    def checkpoint(self, state: dict | None = None, step: int | None = None) -> Path:
        """Write a DCP checkpoint of `state` (default: the model and optimizer, through DCP's state-dict
        helpers) with disttrace's sha256 INDEX.json, at `step` (default: the last completed step).
        Collective: every rank calls it."""
        from disttrace.run import checkpoint as ckpt

        if _dist() is None:
            raise BadInput(
                "run.checkpoint", "needs torch.distributed initialised (DCP's collective save)"
            )
        step = (self.step if self._stepped else self.step - 1) if step is None else int(step)
        holder = _UserState(self.model, self.optimizer, state)
        self._paused = True
        try:
            path = ckpt.save(
                holder,
                self.run_dir,
                step,
                self.manifest_id,
                self.manifest["parallelism"]["world_size"],
                self.rank,
                self.bus,
                extra={"source": SOURCE},
            )
        finally:
            self._paused = False
        if self.rank == 0:
            event(
                self.run_dir,
                Event.CHECKPOINT_SAVED,
                step=step,
                path=str(path.relative_to(self.run_dir)),
            )
        self._finish_step()  # the checkpoint's records belong to the step it saved, as in harness runs
        return path

    def resume(self, checkpoint: str | Path, state: dict | None = None) -> int:
        """Load a verified checkpoint (every file's sha256 against its INDEX; refused if it belongs to
        another experiment) into the model and optimizer (or `state`, in place); returns its step. Later
        steps are numbered from it, and the run becomes a recovered path that diff compares from there."""
        from disttrace.run import checkpoint as ckpt

        path = Path(checkpoint).resolve()
        holder = _UserState(self.model, self.optimizer, state)
        self._paused = True  # set_state_dict initialises optimizer state with a zero-gradient step(): not a step
        try:
            progress = ckpt.load(holder, path, self.rank, self.manifest_id)
        finally:
            self._paused = False
        step = int(progress["step"])
        if self.rank == 0:
            info_path = self.run_dir / "run.json"
            info = read_json(info_path)
            info.update(
                path="recovered",
                resume={
                    "checkpoint": str(path),
                    "step": step,
                    "from_run": str(path.parent.parent.parent),
                },
            )
            write_json_atomic(info_path, info)
            event(
                self.run_dir,
                Event.RESUMED,
                step=step,
                checkpoint=str(path),
                with_optimizer=progress["with_optimizer"],
            )
        self.step = step + 1
        self.bus.step, self.bus.micro_batch = self.step, 0
        self.tracer.step = self.step
        return step

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finish_step(start_next=False)
        self._remove_hooks()
        for loader, base in self._loaders:
            loader.__class__ = base
        self._loaders = []
        self._pending.clear()
        self._taken = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        _patch_clip(bool(_ACTIVE))
        self.tracer.__exit__(None, None, None)
        self.tracer.close()
        self.recorder.close()
        if self.ledger._hooks is not None:  # the step that never ran: nothing to write
            self.ledger._hooks.__exit__(None, None, None)
            self.ledger._hooks = None
        self.ledger.close()
        dist = _dist()
        self._write_observed(dist)
        seal_and_complete(
            self.run_dir,
            self.rank,
            self.recorder,
            dist,
            {
                "steps": self.completed,
                "source": SOURCE,
                "world_size": self.manifest["parallelism"]["world_size"],
            },
        )

    def _write_observed(self, dist) -> None:
        """Collective: every rank's first completed step's sample count to rank 0, which writes the global
        batch it sums to into the lock (as `observed`, beside the manifest the id was taken of), before the
        seal hashes the lock."""
        mine = self._observed or {"step": None, "samples": None, "micro_batches": 0}
        parts = [mine]
        if dist is not None:
            parts = [None] * dist.get_world_size()
            gather_released(dist, parts, mine)
        if self.rank != 0:
            return
        topo = read_json(self.run_dir / "topology.json")
        observed = observed_batch(parts, topo["groups"]["tp"])
        lock = read_json(self.run_dir / LOCK)
        lock["observed"] = observed
        write_json_atomic(self.run_dir / LOCK, lock)

    def __enter__(self) -> AttachedRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the run stays incomplete: what the observers hold is written, and why it stopped said
            process_exit(self.bus, exc)
            event(
                self.run_dir,
                Event.RANK_FAILED,
                rank=self.rank,
                error=f"{exc_type.__name__}: {exc}"[:2000],
            )

    # ---------------------------------------------------------- hook points
    def _memory_ledger(self):
        from disttrace.run.memory import MemoryLedger

        tr = self.manifest["training"]
        name = tr["optimizer"].lower()
        ledger_manifest = {
            "parallelism": {**self.manifest["parallelism"]},
            "training": {
                "dtype": tr["dtype"] if tr["dtype"] != "mixed" else "bfloat16",
                "optimizer": "adamw" if "adam" in name else "sgd",
            },
        }
        held = SimpleNamespace(plain=self.inner, optimizer=self.optimizer)
        return MemoryLedger(self.run_dir, self.rank, ledger_manifest, held).attach(self.bus)

    def _install_backward_points(self) -> bool:
        """`backward`: under DDP, a comm hook sees each bucket's local gradient right before its all-reduce
        (numerically DDP's default: divide by the group size, then sum). Every backward pass that does not
        reach the comm hook (no_sync micro-batches, no DDP, a forward that bypassed DDP) reports the local
        accumulated gradients when autograd finishes it."""
        comm = False
        names = {id(p): (i, n) for i, n, p in self.named}
        if self.engine.kind == "DDP":
            ddp = self.engine.ddp
            state = _CommHookState(self, names, ddp.process_group, len(self.engine.group_ranks))
            try:
                ddp.register_comm_hook(state, _allreduce_with_hook)
                comm = True
            except RuntimeError as e:  # the script registered its own, or training already started
                if self.rank == 0:
                    event(self.run_dir, Event.ATTACH_NOTE, note=f"no DDP comm hook: {e}"[:500])
        if self.engine.kind != "FSDP2":
            for _, _, p in self.named:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return comm

    def _on_forward(self, module, args, kwargs):
        if self._paused or not (module.training and torch.is_grad_enabled()):
            return None  # evaluation, not a micro-batch
        if torch._C._current_graph_task_id() != -1:
            return None  # recomputed inside backward (activation checkpointing)
        self._finish_step()
        mb = self._forwards
        self._forwards += 1
        self.bus.micro_batch = mb
        watched = self._take_batch(args, kwargs)
        if mb not in self._data_mb:
            inputs, ids = watched if watched is not None else (_first_tensor(args, kwargs), [])
            self._count(inputs)
            if inputs is not None:
                self._data_mb.add(mb)
                self.bus.emit(
                    "data", batch={"inputs": inputs.detach(), "sample_ids": ids}, fetch=None
                )
        return None

    def _count(self, inputs) -> None:
        """Add a micro-batch's samples (its data tensor's leading dimension) to the step's count."""
        if self._samples is None:
            return
        if torch.is_tensor(inputs) and inputs.dim() >= 1:
            self._samples += int(inputs.shape[0])
        else:
            self._samples = None

    def _take_batch(self, args, kwargs):
        """The queued batch this forward consumes: the next in order, unless the forward reads the batch the
        previous forward took (its input in that batch's storage, and not in the next one's: the model run twice
        on one batch), which takes none: by order it took the next batch, and its ids. Storage addresses only,
        so the device is never waited for; an input copied to another device is not recognised (docs/attach.md)."""
        where = _storage(_first_tensor(args, kwargs))
        if (
            where is not None
            and where == _storage(self._taken)
            and not (self._pending and _storage(self._pending[0][0]) == where)
        ):
            return None
        watched = self._pending.popleft() if self._pending else None
        # held (one batch's inputs, until the next take) so its address cannot be reused by a later batch
        self._taken = watched[0] if watched is not None else None
        return watched

    def _block_output_hook(self, index: int, name: str):
        """`forward`: a block's output (its first tensor) on a training micro-batch, as the harness records
        each layer's; evaluation and activation-checkpointing recomputation are not micro-batches."""

        def hook(module, _args, out):
            if self._paused or not (module.training and torch.is_grad_enabled()):
                return None
            if torch._C._current_graph_task_id() != -1:
                return None
            t = _first_tensor((out,), {})
            if t is not None:
                self.bus.emit("forward", name=name, index=index, tensor=t.detach())
            return None

        return hook

    def _on_grad(self, _param):
        if not self._bw_queued and not self._paused:
            self._bw_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        self._bw_queued = False
        if self._comm_fired:  # DDP's comm hook has reported this pass, bucket by bucket
            self._comm_fired = False
            return
        self.bus.micro_batch = max(self._forwards - 1, 0)
        self.bus.emit(
            "backward", grads=[(i, n, p.grad) for i, n, p in self.named if p.grad is not None]
        )

    def _flush_reduce(self):
        """`reduce`: the gradients as the step begins (after DDP's all-reduce, or the script's own)."""
        if self._reduced:
            return
        self._reduced = True
        self.bus.micro_batch = max(self._forwards - 1, 0)
        grads = [(i, n, p.grad) for i, n, p in self.named if p.grad is not None]
        if grads:
            self.bus.emit("reduce", grads=grads)

    def _clip(self, parameters, max_norm, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        self._flush_reduce()
        total = _ORIGINAL_CLIP(parameters, max_norm, *args, **kwargs)
        self._record_clip(total, max_norm)
        return total

    def _clip_with_norm(self, parameters, max_norm, total_norm, *args, **kwargs):
        """torch.nn.utils.clip_grads_with_norm_: the clip by a norm the script took itself (through
        get_total_norm, or any way it likes: a local shard's norm is recorded as what it is)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        self._flush_reduce()
        out = _ORIGINAL_WITH_NORM(parameters, max_norm, total_norm, *args, **kwargs)
        self._record_clip(total_norm, max_norm)
        return out

    def _record_clip(self, total, max_norm) -> None:
        """`clip`: the clipped gradients and the scalars every rank must agree on (the first clip of a step
        is the step's)."""
        if self._clipped:
            return
        self._clipped = True
        norm = total.full_tensor() if hasattr(total, "full_tensor") else total
        norm = (
            norm.detach()
            if torch.is_tensor(norm)
            else torch.tensor(float(norm), dtype=torch.float64)
        )
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's own formula
        scalars = [(SCALAR_INDEX, "grad_norm", norm), (SCALAR_INDEX + 1, "clip_coef", coef)]
        if self.optimizer.param_groups:
            scalars.append((SCALAR_INDEX + 2, "lr", _lr(self.optimizer.param_groups[0])))
        self.bus.emit(
            "clip",
            grads=[(i, n, p.grad) for i, n, p in self.named if p.grad is not None],
            scalars=scalars,
        )

    def _before_step(self, _opt, args, kwargs):
        if self._paused:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if callable(
            closure
        ):  # step(closure) (Lightning): the last micro-batch runs inside it, so reduce after it

            def closure_then_reduce():
                loss = closure()
                self._flush_reduce()
                self.bus.emit("before_optimizer", optimizer=self.optimizer, params=self.named)
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_reduce}
            return (closure_then_reduce, *args[1:]), kwargs
        self._flush_reduce()
        self.bus.emit("before_optimizer", optimizer=self.optimizer, params=self.named)
        return None

    def _after_step(self, _opt, _args, _kwargs):
        if self._paused:
            return
        state = optimizer_state_list(self.optimizer, self.named)
        base = len(
            self.named
        )  # the recorder puts state at base + index: lrs after every state tensor
        lrs = [
            (SCALAR_INDEX * 4 + g - base, f"param_groups.{g}.lr", _lr(group))
            for g, group in enumerate(self.optimizer.param_groups)
        ]
        self.bus.emit("optimizer", params=self.named, state=state + lrs, optimizer=self.optimizer)
        self._stepped = True
        self.completed = self.step
        if self._observed is None:
            self._observed = {
                "step": self.step,
                "samples": self._samples if self._forwards else None,
                "micro_batches": self._forwards,
            }

    def _finish_step(self, start_next: bool = True):
        """Close the stepped step (its records are written) and open the next; deferred from the optimizer
        step to the next forward so a checkpoint saved right after the step belongs to it."""
        if not self._stepped:
            return
        self._stepped = False
        self.bus.emit("step_end")
        if not start_next:
            return
        self.step += 1
        self._forwards = 0
        self._data_mb = set()
        self._reduced = self._clipped = False
        self._samples = 0
        self.bus.step, self.bus.micro_batch = self.step, 0
        self.bus.emit("step_start")

    def _remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles = []


def observed_batch(parts: list[dict], tp_groups: list[list[int]]) -> dict:
    """The global batch an attached job ran, from each rank's count of its first completed step (`parts`,
    by rank): the ranks of a tensor-parallel group read one batch, so each group counts once (its first
    rank's; the replica check's data rule holds the others to it), and the groups' counts are summed. None,
    with why, when a rank counted nothing or the group's ranks stepped at different steps."""
    per_rank = {str(r): p.get("samples") for r, p in enumerate(parts)}
    doc = {
        "global_batch": None,
        "step": parts[0].get("step") if parts else None,
        "samples": per_rank,
        "micro_batches": {str(r): p.get("micro_batches") for r, p in enumerate(parts)},
    }
    if not parts or any(p.get("step") is None for p in parts):
        doc["why"] = "a rank completed no optimizer step"
        return doc
    if len({p["step"] for p in parts}) > 1:
        doc["why"] = "the ranks' first completed steps differ"
        return doc
    counts = [parts[g[0]].get("samples") for g in tp_groups]
    if any(c is None for c in counts):
        doc["why"] = "a micro-batch's input had no leading dimension to count"
        return doc
    doc["global_batch"] = sum(counts)
    return doc


def _lr(group: dict) -> torch.Tensor:
    lr = group.get("lr", 0.0)
    return (
        lr.detach().to(torch.float64)
        if torch.is_tensor(lr)
        else torch.tensor(float(lr), dtype=torch.float64)
    )


def _first_tensor(args, kwargs):
    for v in (*args, kwargs.get("input_ids"), *kwargs.values()):
        if isinstance(v, (tuple, list)) and v:  # a (inputs, targets) batch handed whole (Lightning)
            v = v[0]
        if torch.is_tensor(v):
            return v
    return None


def _storage(t) -> int | None:
    """The address of a tensor's storage (a slice or `.to()` on its own device shares it), None if none."""
    if not torch.is_tensor(t) or hasattr(t, "to_local"):
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _batch_inputs(batch):
    """What a batch's `data` record digests: the batch itself, the first tensor of an (inputs, targets)
    pair, or a dict's input_ids (else its first tensor)."""
    if isinstance(batch, dict):
        batch = batch.get(
            "input_ids", next((v for v in batch.values() if torch.is_tensor(v)), None)
        )
    return _first_tensor((batch,), {})


def _planned_sample_ids(loader) -> list[list[int]] | None:
    """Each batch's sample ids for the epoch about to start, read from the loader's sampler where reading it
    changes nothing and the loader hands out its batches in the sampler's order: a DistributedSampler, a
    SequentialSampler (or accelerate's SeedableRandomSampler) is a pure function of its seed and epoch, batched
    by torch's own BatchSampler (sharded by accelerate's BatchSamplerShard in a DataLoaderShard, which sets the
    sampler's epoch to its own iteration count when it starts an epoch). The sampler read is the batch
    sampler's, not `loader.sampler` (with a batch_sampler given, that is a default SequentialSampler nobody
    iterates). None for anything else: other samplers (a RandomSampler draws its seed from the global
    generator: reading it ahead would change the training), other loader classes (a DataLoader subclass with
    its own iteration, torchdata's StatefulDataLoader resuming mid-epoch, accelerate's DataLoaderDispatcher
    slicing rank 0's batches), and workers allowed to hand batches out of order (in_order=False)."""
    import sys

    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

    kind = type(loader).__dict__.get(
        "_disttrace_base", type(loader)
    )  # the loader's own class, when watched
    acc = sys.modules.get(
        "accelerate.data_loader"
    )  # a DataLoaderShard exists only if accelerate is imported
    pure = (DistributedSampler, SequentialSampler) + ((acc.SeedableRandomSampler,) if acc else ())
    shard = acc is not None and kind is acc.DataLoaderShard
    if shard:
        if type(loader.base_dataloader) is not DataLoader:  # a StatefulDataLoader underneath
            return None
    elif not (
        isinstance(kind, type)
        and issubclass(kind, DataLoader)
        and kind.__iter__ is DataLoader.__iter__
        and kind._get_iterator is DataLoader._get_iterator
    ):
        return None
    if getattr(loader, "num_workers", 0) > 0 and getattr(loader, "in_order", True) is False:
        return None
    batches = getattr(loader, "batch_sampler", None)
    if batches is None:  # batch_size=None: one sample per batch
        sampler = getattr(loader, "sampler", None)
        return [[int(i)] for i in sampler] if not shard and type(sampler) in pure[:2] else None
    inner = batches.batch_sampler if shard and type(batches) is acc.BatchSamplerShard else batches
    if type(inner) is not BatchSampler:
        return None
    sampler = inner.sampler
    if type(sampler) not in pure:
        return None
    epoch = getattr(
        sampler, "epoch", None
    )  # a SeedableRandomSampler counts its epochs as it is read
    if shard and epoch is not None:  # the epoch DataLoaderShard.__iter__ is about to set
        sampler.set_epoch(loader.iteration)
    try:
        ids = [[int(i) for i in b] for b in batches]
    finally:
        if epoch is not None:
            sampler.set_epoch(epoch)
    return ids[loader.skip_batches :] if shard else ids


class WatchedLoader:
    """A DataLoader seen by an attached run (AttachedRun.watch_loader): same batches, same length."""

    def __init__(self, run: AttachedRun, loader):
        self.run, self.loader = run, loader

    def __iter__(self):
        return self.run._batches_of(self.loader, lambda: iter(self.loader))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _blocks(inner: torch.nn.Module, forward) -> list[tuple[str, torch.nn.Module]]:
    """The modules whose outputs the `forward` phase records: the model's top-level children (forward=True)
    or the given module paths."""
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


def attach(
    model,
    optimizer,
    out: str | Path = "runs",
    name: str = "user-script",
    seed: int | None = None,
    edition: str = "user",
    config: dict | None = None,
    loader=None,
    forward=False,
    evaluation: dict | None = None,
) -> AttachedRun:
    """Attach the recorder to a model and its optimizer; every rank calls it (it is collective).

    model: the module as trained (DDP-wrapped, FSDP2-sharded, DTensor or plain), or a
    DeepSpeedEngine (integrations/deepspeed.py); optimizer: the torch
    optimizer (HF/Lightning wrappers are unwrapped). config: the experiment's settings (lr, batch, data...):
    stored in the manifest, so diff refuses runs of different experiments and names the fields; the keys
    grad_accum_steps, micro_batch_size and steps also fill the manifest's typed fields. seed: default the
    default generator's (torch.initial_seed()). loader: the training DataLoader, watched in place (its
    batches become the `data` records, with its DistributedSampler's sample ids; see
    AttachedRun.watch_loader). forward: record each block's output (`forward`): True for the model's
    top-level children (and every module whose tensor-parallel style declares its output Replicate, which
    the replica check holds to agree), or a list of module paths ("layers.0", "head"); the manifest's
    record.forward says which. evaluation: the gate's evaluation of this run's final checkpoint when it is
    the reference, the policy's `[eval]` keys (command, metric, better, rtol, atol, timeout_s, env, data,
    data_sha256, cwd; docs/gate.md): data and cwd are resolved against the working directory and the data
    hashed here, by rank 0. Under `disttrace run/inject -- CMD` the run directory (and fault) come from
    DISTTRACE_RUN_DIR and `out` is ignored."""
    rank, world = _rank_world()
    optimizer = unwrap_optimizer(optimizer)
    engine = detect_engine(model)
    named = list(enumerate(engine.inner.named_parameters()))
    views = _gather(local_view(engine, [(i, n, p) for i, (n, p) in named], rank))
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
    }
    manifest_id = manifest_id_of(manifest)
    prepared = os.environ.get(RUN_DIR_ENV)
    path, failure = None, None
    if rank == 0:
        try:
            path = _prepare_dir(prepared, out, manifest, manifest_id, engine, views, eval_resolved)
        except BadInput as e:
            failure = e
    path, error = _broadcast((path, str(failure) if failure else None))
    if failure is not None:
        raise failure
    if error:
        raise RuntimeError(f"rank 0 could not prepare the run directory: {error}")
    run_dir = Path(path)
    info = read_json(run_dir / "run.json")
    kind = AttachedRun
    if engine.kind == "DeepSpeed":
        from disttrace.integrations.deepspeed import DeepSpeedRun as kind
    run = kind(
        model, optimizer, run_dir, rank, engine, manifest, manifest_id, info.get("fault"), blocks
    )
    if loader is not None:
        run._watch_in_place(loader)
    return run


def evaluation_section(spec: dict) -> tuple[dict, dict]:
    """attach(evaluation=) -> (the manifest's `eval` section, the lock's resolved paths): validated as a
    policy's [eval] is (gate/policy.py), the data's sha256 computed (or checked, if given) now."""
    from pydantic import ValidationError

    from disttrace.gate.policy import USER_EVAL_KEYS, EvalPolicy
    from disttrace.gate.usereval import EvalFailure, data_sha256

    where = "attach(evaluation=)"
    if not isinstance(spec, dict) or not spec.get("command"):
        raise BadInput(where, "needs a command (a list of strings)", field="command")
    unknown = sorted(set(spec) - set(USER_EVAL_KEYS) - {"data", "cwd"})
    if unknown:
        raise BadInput(where, "unknown key", field=unknown[0])
    cwd = Path(spec.get("cwd") or os.getcwd()).resolve()
    if spec.get("data") is None:
        raise BadInput(where, "names no held-out data (the gate checks it by hash)", field="data")
    data = (cwd / spec["data"]).resolve()
    try:
        sha = data_sha256(data)
    except EvalFailure as e:
        raise BadInput(where, str(e), field="data") from None
    if spec.get("data_sha256") not in (None, sha):
        raise BadInput(where, f"{data} has sha256 {sha}, not the one given", field="data_sha256")
    doc = {**spec, "data": str(data), "cwd": str(cwd), "data_sha256": sha}
    doc["command"] = list(doc["command"])
    doc["env"] = list(doc.get("env") or [])
    try:
        EvalPolicy.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadInput(
            where, err["msg"].removeprefix("Value error, "), field=".".join(map(str, err["loc"]))
        ) from None
    section = {k: _jsonable(doc[k]) for k in USER_EVAL_KEYS if k in doc}
    return section, {"eval_data": str(data), "eval_cwd": str(cwd)}


def _prepare_dir(
    prepared: str | None,
    out,
    manifest: dict,
    manifest_id: str,
    engine: Engine,
    views: list[dict],
    resolved: dict | None = None,
) -> str:
    """Rank 0: the run directory (prepared by the CLI, or a new one) with the lock, run.json, env.json,
    topology.json and replicas.json."""
    from disttrace.run.worker import environment

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
        write_json_atomic(
            run_dir / "run.json",
            {
                "path": "reference",
                "fault": None,
                "resume": None,
                "created": time.time(),
                "pid": os.getpid(),
            },
        )
    write_json_atomic(
        run_dir / LOCK,
        {
            "manifest": manifest,
            "manifest_id": manifest_id,
            "source": SOURCE,
            "overrides": [],
            "resolved": dict(resolved or {}),
        },
    )
    dist = _dist()
    backend = dist.get_backend() if dist else None
    write_json_atomic(run_dir / "env.json", environment(torch, backend, views))
    write_json_atomic(run_dir / "topology.json", topology_doc(engine, views))
    replicas = infer_replicas(engine.kind, views)
    write_json_atomic(run_dir / "replicas.json", replicas)
    event(
        run_dir,
        Event.ATTACHED,
        engine=engine.kind,
        world_size=len(views),
        manifest_id=manifest_id,
        replica_rules=len(replicas["rules"]),
    )
    return str(run_dir)
