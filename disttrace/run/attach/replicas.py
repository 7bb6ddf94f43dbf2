"""The replica map (replicas.json) and topology (topology.json) of an attached job, inferred from every
rank's view at attach (engine.local_view); docs/replicas.md lists every rule."""

from __future__ import annotations

from disttrace.errors import BadInput
from disttrace.run.attach.engine import AttachView, Engine, views_of
from disttrace.run.parallel.common import SCALARS_AGREE
from disttrace.store.documents import ReplicaRule, Replicas, Topology, TopologyRank

# what attach(layout=) may say: the dimensions attach cannot always see (docs/replicas.md)
LAYOUT_FIELDS = ("ep", "cp")


def parse_layout(layout, rank: int) -> dict[str, list[int]]:
    """attach(layout=)'s groups as this rank's global ranks per field: each a ProcessGroup, a
    one-dimensional DeviceMesh or a list of global ranks, holding this rank. A bad field is refused with
    one line naming it."""
    if layout is None:
        return {}
    if not isinstance(layout, dict):
        raise BadInput(
            "attach(layout=)",
            f"a dict of {', '.join(LAYOUT_FIELDS)} to groups, not {type(layout).__name__}",
        )
    out = {}
    for key, value in layout.items():
        where = f"attach(layout={{{key!r}: ...}})"
        if key not in LAYOUT_FIELDS:
            raise BadInput(where, f"unknown field {key!r}; the fields: {', '.join(LAYOUT_FIELDS)}")
        ranks = _group_ranks(value)
        if ranks is None:
            raise BadInput(
                where,
                "a ProcessGroup, a one-dimensional DeviceMesh or a list of global ranks, "
                f"not {type(value).__name__}",
            )
        if rank not in ranks:
            raise BadInput(where, f"rank {rank} passed a group without itself: {ranks}")
        out[key] = ranks
    return out


def _group_ranks(value) -> list[int] | None:
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
            if len(set(value)) == len(value):
                return sorted(value)
        return None
    mesh = getattr(value, "mesh", None)
    if mesh is not None and hasattr(value, "mesh_dim_names"):  # a DeviceMesh
        return sorted(mesh.flatten().tolist()) if mesh.ndim == 1 else None
    try:
        import torch.distributed as dist

        if isinstance(value, dist.ProcessGroup):
            return sorted(dist.get_process_group_ranks(value))
    except (ImportError, AttributeError, RuntimeError):
        return None
    return None


def layout_groups(views: list[AttachView] | list[dict]) -> dict[str, list[list[int]]]:
    """Field -> its rank groups, from every rank's attach(layout=): every rank must name the same fields,
    and each field's groups must hold every rank once, in groups of one size (else refused, naming it)."""
    views = views_of(views)
    fields = {tuple(sorted(v.layout)) for v in views}
    if len(fields) > 1:
        raise BadInput("attach(layout=)", f"the ranks name different fields: {sorted(fields)}")
    out = {}
    for key in sorted(next(iter(fields), ())):
        gs = sorted({tuple(v.layout[key]) for v in views})
        if not _partition(gs, len(views)) or any(v.rank not in v.layout[key] for v in views):
            raise BadInput(
                f"attach(layout={{{key!r}: ...}})",
                f"the ranks' groups {[list(g) for g in gs]} do not split the {len(views)} ranks "
                "into groups of one size",
            )
        out[key] = [list(g) for g in gs]
    return out


def _positions(within: list[list[int]], among: list[int]) -> list[list[int]]:
    """The ranks of `among` at one position of their `within` groups: with a context-parallel group
    [[0, 1], [2, 3]] and DDP over [0, 1, 2, 3], the data-parallel shards [[0, 2], [1, 3]]."""
    place = {r: (i, g.index(r)) for i, g in enumerate(within) for r in g}
    by_pos: dict[int, list[int]] = {}
    for r in among:
        by_pos.setdefault(place[r][1] if r in place else -1 - r, []).append(r)
    return sorted(sorted(g) for g in by_pos.values())


def infer_replicas(engine: str, views: list[AttachView] | list[dict]) -> Replicas:
    """replicas.json for an attached run, in the harness's format ({"groups": {dim: [[ranks]]}, "rules": [...]}).

    DDP: the engine says it (data differs, reduced gradients, clip scalars, parameters and optimizer state
    agree over its group). FSDP2: its mesh is data parallelism (data differs there; the global gradient
    norm, clip coefficient and learning rates agree over the world). Tensor parallelism (the mesh dimensions
    a DTensor parameter is sharded over that are not FSDP2's): a tp group reads one batch and computes one
    loss (unless the loss is computed from an output sharded on tokens: token_sharded_loss), the clip
    scalars agree, every output its style declares Replicate agrees (replicated_outputs),
    and a plain parameter, which every rank of the group holds whole, has one reduced gradient and one value
    after the step. A DTensor parameter's Replicate placements name dimensions whose copies agree after the
    step (its gradient may legitimately be Partial until the optimizer reduces it, so not at `reduce`).
    Otherwise: copies identical at attach must have one reduced gradient and stay identical after every
    optimizer step (parameters whose elements are all equal are left out: equal by construction, they
    show nothing). docs/replicas.md lists every rule."""
    views = views_of(views)
    world = len(views)
    groups: dict[str, list[list[int]]] = {"world": [list(range(world))]}
    rules: list[ReplicaRule] = []
    notes: list[str] = []
    if engine == "DeepSpeed":
        from disttrace.run import deepspeed

        return deepspeed.replicas(views)
    layout = layout_groups(views)
    if engine == "DDP":
        return _ddp_replicas(views, groups, layout)
    fsdp = sorted({tuple(g) for v in views for g in v.fsdp_groups})
    if engine == "FSDP2" and fsdp:  # FSDP2 shards over data parallelism: each rank's batch differs
        groups["dp"] = [list(g) for g in fsdp]
        data_dim = "dp"
        if layout.get("cp"):  # a cp group reads one batch: as under DDP (_ddp_replicas)
            groups["cp"] = layout["cp"]
            groups["dp-shards"] = [g for d in fsdp for g in _positions(layout["cp"], list(d))]
            data_dim = "dp-shards"
            notes.append(
                f"context parallel over {layout['cp']} (attach(layout=)): data differs only "
                f"across {groups['dp-shards']}"
            )
        rules += [
            ReplicaRule(phase="data", dim=data_dim, relation="differ"),
            SCALARS_AGREE,
            ReplicaRule(
                phase="optimizer",
                dim="world",
                relation="agree",
                tensors=["param_groups.*.lr"],
            ),
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
            for e in v.params.values():
                for dim, gs in (e.shard or {}).items():
                    if {tuple(g) for g in gs} != set(fsdp) and not _not_tp(dim, gs, layout):
                        tp[f"mesh:{dim}"] = gs
    # where the model's output leaves its last styled module sharded on tokens (sequence parallelism up to
    # the loss), each rank's loss is its own tokens': one loss only after a reduction the script owns
    per_shard = {f"mesh:{d}": path for v in views for d, path in v.token_sharded_loss.items()}
    for dim, gs in sorted(tp.items()):
        groups[dim] = gs
        rules.append(ReplicaRule(phase="data", dim=dim, relation="agree"))
        if dim in per_shard:
            notes.append(
                f"tensors sharded over {gs} ({dim}): those ranks read the same batch; the loss is computed "
                f"from {per_shard[dim]}'s output, sharded on tokens over {dim}: a loss per shard, no rule"
            )
            continue
        rules.append(ReplicaRule(phase="loss", dim=dim, relation="agree"))
        notes.append(
            f"tensors sharded over {gs} ({dim}): those ranks read the same batch and compute one loss"
        )
    if tp and SCALARS_AGREE not in rules:
        rules.append(SCALARS_AGREE)
    outputs: dict[str, list[str]] = {}
    for v in views:
        for path, e in v.replicated_outputs.items():
            key = f"mesh:{e.dim}"
            groups.setdefault(key, e.groups)
            outputs.setdefault(key, [])
            if path not in outputs[key]:
                outputs[key].append(path)
    for key, paths in sorted(outputs.items()):
        rules.append(ReplicaRule(phase="forward", dim=key, relation="agree", tensors=sorted(paths)))
        notes.append(
            f"{len(paths)} module output(s) declared Replicate over {key} by their parallel style"
        )
    names = sorted({n for v in views for n in v.params})
    by_dims: dict[tuple, list[str]] = {}
    whole: list[
        str
    ] = []  # plain parameters of a tensor-parallel job: every tp rank holds them whole
    for name in names:
        entries = {v.rank: v.params[name] for v in views if name in v.params}
        first = next(iter(entries.values()))
        if first.replicate is not None:  # a DTensor: its placements say it
            for dim, gs in first.replicate.items():
                key = f"mesh:{dim}"
                groups.setdefault(key, gs)
                by_dims.setdefault((key,), []).append(name)
            continue
        if len(tp) == 1:
            whole.append(name)
            continue
        if all(e.constant for e in entries.values()):
            continue
        buckets: dict[str, list[int]] = {}
        for r, e in entries.items():
            buckets.setdefault(e.digest, []).append(r)
        part = tuple(sorted(tuple(g) for g in buckets.values() if len(g) > 1))
        if part:
            by_dims.setdefault(part, []).append(name)
    if whole:
        (key,) = tp
        rules += [
            ReplicaRule(phase=phase, dim=key, relation="agree", tensors=whole)
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
            ReplicaRule(phase=phase, dim=dim, relation="agree", tensors=sorted(tensors))
            for phase in phases
        ]
        notes.append(
            f"{len(tensors)} parameter(s) identical across {groups[dim]} at attach ({dim})"
        )
    if not rules:
        notes.append("no parameter has an identical copy on another rank: nothing must agree")
    return Replicas(groups=groups, rules=rules, inferred={"engine": engine, "notes": notes})


def _not_tp(dim: str, gs: list[list[int]], layout: dict) -> bool:
    """A mesh dimension parameters are sharded over that is not tensor parallelism: experts sharded over
    an expert-parallel dimension (named "ep", as torchtitan names it, or the group attach(layout={"ep":
    ...}) names) read their own data and compute their own loss, so the tp rules (one batch, one loss)
    must not hold them; likewise a dimension named "cp"."""
    return dim in LAYOUT_FIELDS or sorted(gs) == sorted(layout.get("ep", []))


def _literal(name: str) -> str:
    """A tensor name as an fnmatch pattern matching only itself."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def _ddp_replicas(views: list[AttachView], groups: dict, layout: dict) -> Replicas:
    """DDP: data differs over its group, and its all-reduce gives every rank one gradient, so one clip and
    one update. Two things it does not see are left out: the parameters DDP ignores (a rank's own expert
    shards under expert parallelism: each rank's gradient and value are its own; copies identical at attach
    must stay identical), and a context-parallel group (attach(layout={"cp": ...})), whose ranks read one
    batch and take their slices: data differs only between ranks at one position of their cp groups, and
    no data or loss rule holds inside a cp group (its recorded batch may be the whole one or the slice, its
    loss the slice's until the script reduces it)."""
    dp = sorted({tuple(v.ddp_group) for v in views})
    groups["dp"] = [list(g) for g in dp]
    rules: list[ReplicaRule] = []
    notes: list[str] = []
    data_dim = "dp"
    cp = layout.get("cp")
    if cp:
        groups["cp"] = cp
        groups["dp-shards"] = [g for d in dp for g in _positions(cp, list(d))]
        data_dim = "dp-shards"
        notes.append(
            f"context parallel over {cp} (attach(layout=)): data differs only across "
            f"{groups['dp-shards']}; a cp group's batch and loss are not held"
        )
    rules.append(ReplicaRule(phase="data", dim=data_dim, relation="differ"))
    ignored = sorted({n for v in views for n in v.ddp_ignored})
    if not ignored:
        rules += [
            ReplicaRule(phase=phase, dim="dp", relation="agree")
            for phase in ("reduce", "clip", "optimizer")
        ]
        notes.append(
            f"DDP over {groups['dp']}: reduced gradients, clip, parameters and optimizer state agree"
        )
        return Replicas(groups=groups, rules=rules, inferred={"engine": "DDP", "notes": notes})
    kept = [_literal(n) for n in sorted({n for v in views for n in v.params}) if n not in ignored]
    if kept:
        state = [f"{n}:*" for n in kept]
        rules += [
            ReplicaRule(phase="reduce", dim="dp", relation="agree", tensors=kept),
            ReplicaRule(
                phase="clip", dim="dp", relation="agree", tensors=kept + SCALARS_AGREE.tensors
            ),
            ReplicaRule(
                phase="optimizer",
                dim="dp",
                relation="agree",
                tensors=kept + state + ["param_groups.*"],
            ),
        ]
    else:
        rules += [
            ReplicaRule(phase="clip", dim="dp", relation="agree", tensors=SCALARS_AGREE.tensors),
            ReplicaRule(phase="optimizer", dim="dp", relation="agree", tensors=["param_groups.*"]),
        ]
    notes.append(
        f"DDP over {groups['dp']}: reduced gradients, clip, parameters and optimizer state agree, but for "
        f"the {len(ignored)} parameter(s) DDP ignores ({', '.join(ignored)}): each rank's own"
    )
    # an ignored parameter identical on several ranks at attach (an expert slice held by its edp group)
    buckets: dict[tuple[str, str], list[int]] = {}
    for v in views:
        for name in ignored:
            e = v.params.get(name)
            if e is not None and not e.constant:
                buckets.setdefault((name, e.digest), []).append(v.rank)
    by_part: dict[tuple, list[str]] = {}
    for name in ignored:
        part = tuple(sorted(tuple(g) for (n, _), g in buckets.items() if n == name and len(g) > 1))
        if part:
            by_part.setdefault(part, []).append(name)
    for n, (part, names) in enumerate(sorted(by_part.items()), 1):
        dim = "replicas" if n == 1 else f"replicas-{n}"
        groups[dim] = [list(g) for g in part]
        tensors = [_literal(x) for x in names]
        rules += [
            ReplicaRule(phase="reduce", dim=dim, relation="agree", tensors=tensors),
            ReplicaRule(
                phase="optimizer",
                dim=dim,
                relation="agree",
                tensors=tensors + [f"{t}:*" for t in tensors],
            ),
        ]
        notes.append(
            f"{len(names)} ignored parameter(s) identical across {groups[dim]} at attach ({dim})"
        )
    return Replicas(groups=groups, rules=rules, inferred={"engine": "DDP", "notes": notes})


def attached_layout(
    kind: str, views: list[AttachView] | list[dict]
) -> tuple[list[list[int]], list[list[int]]]:
    """(data-parallel groups, tensor-parallel groups) of an attached job, from its engine and its parameters'
    placements: DDP's group, or FSDP2's shard groups, are data parallelism; the mesh dimensions a DTensor
    parameter is sharded over that are not FSDP2's are tensor parallelism. Without tensor parallelism each
    rank is its own tp group; without an engine's data parallelism the ranks at one position of their tp
    groups form the dp groups (a TP-only job on its whole world: dp = 1). A layout that is not a grid
    (a rank in two groups of one kind) keeps every rank its own tp group."""
    views = views_of(views)
    world = len(views)
    layout = layout_groups(views)
    if kind in ("DDP", "DeepSpeed"):
        dp = sorted({tuple(v.ddp_group) for v in views})
    else:
        dp = sorted({tuple(g) for v in views for g in v.fsdp_groups})
    by_dim: dict[str, set] = {}
    for v in views:
        for entry in v.params.values():
            for dim, gs in (entry.shard or {}).items():
                if not _not_tp(dim, gs, layout):
                    by_dim.setdefault(dim, set()).update(tuple(g) for g in gs)
    tp = sorted({g for gs in by_dim.values() if gs != set(dp) for g in gs})
    if not _partition(tp, world):
        tp = [(r,) for r in range(world)]
    if not dp:
        dp = [tuple(sorted(g[i] for g in tp)) for i in range(len(tp[0]))]
    if not _partition(dp, world):
        dp = [tuple(range(world))]
    return [list(g) for g in dp], [list(g) for g in tp]


def mesh_doc(views: list[AttachView] | list[dict]) -> dict | None:
    """The device mesh the job's DTensor parameters (FSDP2's included) live on, as attach found it: each
    named dimension's size, and which dimensions some parameter is replicated over or sharded over (HSDP:
    replicate and shard; FSDP2 + TP: dp and tp both shard). None when no parameter is a DTensor."""
    dims: dict[str, int] = {}
    replicate: set[str] = set()
    shard: set[str] = set()
    for v in views_of(views):
        for entry in v.params.values():
            for placed, into in ((entry.replicate, replicate), (entry.shard, shard)):
                for dim, gs in (placed or {}).items():
                    dims[dim] = len(gs[0]) if gs else 1
                    into.add(dim)
    if not dims:
        return None
    return {"dims": dims, "replicate": sorted(replicate), "shard": sorted(shard)}


def _partition(groups: list[tuple], world: int) -> bool:
    """Groups of one size that hold every rank exactly once."""
    ranks = sorted(r for g in groups for r in g)
    return bool(groups) and len({len(g) for g in groups}) == 1 and ranks == list(range(world))


def topology_doc(engine: Engine, views: list[AttachView] | list[dict]) -> Topology:
    """topology.json in the harness's shape (pp x dp x tp, coordinates per rank: a rank's place in its dp and
    tp groups), plus every process group torch built, as the ranks reported them."""
    views = views_of(views)
    world = len(views)
    dp_groups, tp_groups = attached_layout(engine.kind, views)
    place = {
        dim: {r: i for g in gs for i, r in enumerate(g)}
        for dim, gs in (("dp", dp_groups), ("tp", tp_groups))
    }
    pgs: dict[tuple, dict] = {}
    for v in views:
        for g in v.process_groups:
            pgs.setdefault((g.name, tuple(g.ranks)), g.wire())
    return Topology(
        world_size=world,
        mesh_dims=["pp", "dp", "tp"],
        mesh_shape={"pp": 1, "dp": len(dp_groups[0]), "tp": len(tp_groups[0])},
        groups={"pp": [[r] for r in range(world)], "dp": dp_groups, "tp": tp_groups},
        ranks=[
            TopologyRank(
                rank=v.rank,
                host=v.host,
                node_rank=v.node_rank,
                local_rank=v.local_rank,
                pid=v.pid,
                coords={
                    "pp": 0,
                    "dp": place["dp"].get(v.rank, 0),
                    "tp": place["tp"].get(v.rank, 0),
                },
            )
            for v in views
        ],
        process_groups=[pgs[k] for k in sorted(pgs, key=lambda k: (len(k[1]), k))],
        engine=engine.kind,
    )
