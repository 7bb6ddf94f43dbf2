"""What attach sees of the model it is handed: the engine that wraps it and, per rank, its parameters'
digests and placements, its process groups and where it runs (gathered into the replica map, the
topology and the manifest)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from disttrace.run.attach.comm import _mesh_groups, _process_groups, initialized_dist

ENGINES = ("plain", "DDP", "FSDP2", "DTensor", "DeepSpeed")


# module wrappers that add a path segment without adding a tensor: activation checkpointing's, FSDP1's and
# torch.compile's. A tensor's identity is its path without them, so runs with and without a wrapper (or
# with it around other blocks) pair their tensors
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def tensor_name(path: str) -> str:
    """A parameter's name as the store keeps it: its module path without wrapper segments."""
    return ".".join(s for s in path.split(".") if s not in WRAPPER_SEGMENTS)


def named_parameters(module) -> list[tuple[str, torch.nn.Parameter]]:
    """The module's parameters by their stored names (tensor_name), in torch's order."""
    return [(tensor_name(n), p) for n, p in module.named_parameters()]


def unwrap_optimizer(opt):
    """HF's AcceleratedOptimizer and Lightning's LightningOptimizer wrap the torch optimizer as .optimizer."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    return opt


@dataclass
class Engine:
    kind: str  # plain | DDP | FSDP2 | DTensor | DeepSpeed
    inner: torch.nn.Module  # the user's module (DDP's .module)
    ddp: Any = None  # DDP, or the DeepSpeedEngine
    # DDP's (DeepSpeed's) data-parallel group, global ranks
    group_ranks: list[int] = field(default_factory=list)
    zero_stage: int = 0
    # parameters DDP leaves out of its all-reduce (`parameters_to_ignore`): a rank's own shard, such as its
    # experts under expert parallelism, which DDP's replica rule must not hold
    ignored: list[str] = field(default_factory=list)


def detect_engine(model) -> Engine:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from disttrace.run import deepspeed

    if deepspeed.is_engine(model):
        return deepspeed.detect(model)
    if isinstance(model, DDP):
        dist = initialized_dist()
        ranks = dist.get_process_group_ranks(model.process_group) if dist else [0]
        names = {n for n, _ in model.module.named_parameters()}
        ignored = sorted(
            tensor_name(n) for n in getattr(model, "parameters_to_ignore", ()) if n in names
        )
        return Engine("DDP", model.module, model, sorted(ranks), ignored=ignored)
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


Groups = dict[str, list[list[int]]]  # mesh dimension -> the rank groups along it


class _View(BaseModel):
    # gathered as its dict (`wire()`), validated again on arrival
    model_config = ConfigDict(extra="allow")

    def wire(self) -> dict:
        return self.model_dump(exclude_unset=True)


class ParamView(_View):
    """One parameter as a rank sees it at attach: its digest, whether its elements are all equal, and (a
    DTensor) the mesh dimensions it is replicated and sharded over."""

    digest: str
    constant: bool
    replicate: Groups | None = None
    shard_dims: list[int] | None = None
    shard: Groups | None = None


class ProcessGroupView(_View):
    name: str
    ranks: list[int]
    backend: str | None = None


class ReplicatedOutput(_View):
    dim: str  # the mesh dimension its parallel style declares it Replicate over
    groups: list[list[int]]


class AttachView(_View):
    """What one rank sees at attach (`local_view`): where it runs, its parameters, its groups."""

    rank: int
    host: str
    node_rank: int
    local_rank: int
    pid: int
    params: dict[str, ParamView]  # parameter name -> what this rank holds of it
    ddp_group: list[int] | None = None
    ddp_ignored: list[str] = []  # parameters DDP does not all-reduce (Engine.ignored)
    # what attach(layout=) said: field ("ep", "cp") -> the global ranks of this rank's group
    layout: dict[str, list[int]] = {}
    zero_stage: int | None = None
    process_groups: list[ProcessGroupView] = []
    fsdp_groups: list[list[int]] = []
    replicated_outputs: dict[str, ReplicatedOutput] = {}  # module path -> its Replicate output
    # mesh dimension -> the styled module whose token-sharded output the loss is computed from
    token_sharded_loss: dict[str, str] = {}
    seed: int


def views_of(gathered: list) -> list[AttachView]:
    """Every rank's view, as gathered (dicts) or built (models)."""
    return [AttachView.model_validate(v) for v in gathered]


def local_view(engine: Engine, named, rank: int, layout: dict | None = None) -> AttachView:
    """What this rank sees at attach: its parameters' digests, its process groups, where it runs, and
    the groups attach(layout=) names (checked by check_layout)."""
    import socket

    from disttrace.run.record.digest import digest_tensor

    params = {}
    for _, name, p in named:
        with torch.no_grad():
            entry = {"digest": digest_tensor(p)["digest"], "constant": _is_constant(p)}
        if hasattr(p, "placements") and hasattr(p, "device_mesh"):
            mesh = p.device_mesh
            names = [
                mesh.mesh_dim_names[d] if mesh.mesh_dim_names else str(d) for d in range(mesh.ndim)
            ]
            entry.update(
                replicate={
                    names[d]: _mesh_groups(mesh, d)
                    for d, pl in enumerate(p.placements)
                    if pl.is_replicate()
                },
                shard_dims=[d for d, pl in enumerate(p.placements) if pl.is_shard()],
                shard={
                    names[d]: _mesh_groups(mesh, d)
                    for d, pl in enumerate(p.placements)
                    if pl.is_shard()
                },
            )
        params[name] = ParamView(**entry)
    return AttachView(
        rank=rank,
        host=socket.gethostname(),
        node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        pid=os.getpid(),
        params=params,
        ddp_group=engine.group_ranks,
        zero_stage=engine.zero_stage,
        **({"ddp_ignored": engine.ignored} if engine.ignored else {}),
        **({"layout": layout} if layout else {}),
        process_groups=_process_groups(),
        fsdp_groups=_fsdp_groups(engine.inner) if engine.kind == "FSDP2" else [],
        replicated_outputs={
            path: {"dim": dim, "groups": gs}
            for path, (dim, gs) in replicated_outputs(engine.inner).items()
        },
        token_sharded_loss=token_sharded_loss(engine.inner),
        seed=torch.initial_seed(),
    )


def declared_outputs(inner: torch.nn.Module) -> dict[str, tuple[str, list[list[int]], tuple]]:
    """Module path -> (mesh dimension, its rank groups, the output placements its tensor-parallel style
    declares), in module order, for every module a style was applied to over a one-dimensional mesh: a
    ColwiseParallel's or RowwiseParallel's output_layouts, a PrepareModuleOutput's desired layouts, a
    SequenceParallel's sequence sharding (its output keeps the sharding its input hook gives). Read from
    the hooks parallelize_module registered (DTensor's distribute_module closes over the style's input and
    output functions and the mesh; best effort: a torch that stores them otherwise gives none)."""
    import functools

    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import ParallelStyle
        from torch.distributed.tensor.placement_types import Placement
    except ImportError:
        return {}

    def cells_of(hooks) -> list:
        cells = []
        for hook in list(hooks.values()):
            for c in getattr(hook, "__closure__", None) or ():
                try:
                    cells.append(c.cell_contents)
                except ValueError:  # an empty cell
                    continue
        return cells

    def placements(x) -> tuple | None:
        x = x if isinstance(x, (tuple, list)) else (x,)
        known = tuple(p for p in x if p is not None)
        return known if known and all(isinstance(p, Placement) for p in known) else None

    out = {}
    for path, module in inner.named_modules():
        if not path:
            continue
        cells = cells_of(getattr(module, "_forward_hooks", {}))
        mesh = next((c for c in cells if isinstance(c, DeviceMesh)), None)
        layouts = None
        for c in cells:
            if isinstance(c, functools.partial) and c.args:
                name = getattr(c.func, "__qualname__", "")
                if name.endswith("_prepare_output_fn"):
                    # a style's static output function, given its output layouts first (SequenceParallel
                    # gives it use_local_output: its layout is the input's, below)
                    layouts = placements(c.args[0])
                    if layouts is None and name.startswith("SequenceParallel."):
                        pre = cells_of(getattr(module, "_forward_pre_hooks", {}))
                        layouts = next(
                            (
                                placements(p.args[0])
                                for p in pre
                                if isinstance(p, functools.partial)
                                and p.args
                                and getattr(p.func, "__qualname__", "").endswith(
                                    "_prepare_input_fn"
                                )
                            ),
                            None,
                        )
            elif isinstance(c, ParallelStyle) and hasattr(c, "desired_output_layouts"):
                layouts = placements(c.desired_output_layouts)
        if mesh is None or mesh.ndim != 1 or layouts is None:
            continue
        dim = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else "0"
        out[path] = (dim, _mesh_groups(mesh, 0), layouts)
    return out


def replicated_outputs(inner: torch.nn.Module) -> dict[str, tuple[str, list[list[int]]]]:
    """Module path -> (mesh dimension, its rank groups) for the modules whose tensor-parallel style declares
    their output Replicate over that dimension: a RowwiseParallel output after its reduction (its default),
    a ColwiseParallel(output_layouts=Replicate()), a PrepareModuleOutput to Replicate."""
    return {
        path: (dim, groups)
        for path, (dim, groups, layouts) in declared_outputs(inner).items()
        if all(p.is_replicate() for p in layouts)
    }


def token_sharded_loss(inner: torch.nn.Module) -> dict[str, str]:
    """Mesh dimension -> module path, where the model's output leaves its last styled module sharded over
    that dimension on a token dimension (Shard(0) or Shard(1): the batch or sequence of a (batch, sequence,
    ...) activation; a sequence-parallel norm's output, a RowwiseParallel(output_layouts=Shard(1))): the
    loss is then computed from each rank's own tokens, and its tp ranks' losses differ until reduced. A
    class or vocabulary shard (Shard(-1), ColwiseParallel's default) leaves the loss replicated: the
    softmax needs the whole row, so a vocabulary-parallel loss reduces its statistics over the group. The
    last styled module in module order stands for the one that produces the output."""
    declared = list(declared_outputs(inner).items())
    if not declared:
        return {}
    path, (dim, _, layouts) = declared[-1]
    if any(p.is_shard() and 0 <= p.dim <= 1 for p in layouts):
        return {dim: path}
    return {}
