"""Expert parallel: a mixture's experts sharded over `ep` ranks of the data-parallel dimension, tokens sent to
the rank holding their expert and back by all-to-all (torchtitan's `ExpertParallel` design).

Each MoE layer's stacked expert matrices (experts x out x in) become DTensors sharded along the experts on
an (edp, ep) mesh: rank j of an ep group holds experts [j E/ep, (j+1) E/ep), replicated over the dp/ep
groups (edp) that hold the same slice. Around the plain model's `experts` module a forward pre-hook
dispatches (the per-expert counts first, then the tokens, `all_to_all_single` with uneven splits, the
arrivals regrouped by local expert) and a forward hook combines (the inverse regrouping, the all-to-all
back), so the model stays the single-device one: the router, the sort and the weighted sum run on every
rank for its own tokens. The dispatch and the combine are the `dispatch` hook point.

The router and the dense parameters stay in DDP over dp (its comm hook is the `backward` point). The
experts' gradients are DDP-ignored: after backward each rank's expert shard holds the gradient of every ep
rank's tokens routed to it (the all-to-all's backward brought them), so dividing by dp and summing over
edp gives the data-parallel mean DDP gives the rest.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import Backward, Dispatch, Reduce, TensorRef, grads_of
from disttrace.run.parallel.common import SCALARS_AGREE, build_optimizer
from disttrace.run.parallel.ddp import DataParallel, apply_ddp
from disttrace.store.documents import ReplicaRule

EXPERTS = "*.experts.*"  # the sharded tensors' names (parameters, gradients, optimizer state)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; its gradient is the all-to-all back with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x, out_splits: list[int], in_splits: list[int], group):
    return _AllToAll.apply(x, out_splits, in_splits, group)


class _LocalExperts:
    """Mixed into an `ExpertLinear` whose weight is a DTensor (as fully_shard swaps a module's class): it
    computes with the slice of experts this rank holds."""

    def forward(self, x, counts):
        from disttrace.model.llama import grouped_linear

        return grouped_linear(x, self.weight.to_local(), counts)


def _localise(module) -> None:
    cls = module.__class__
    module.__class__ = type(f"Local{cls.__name__}", (_LocalExperts, cls), {})


def apply_ep(model, mesh, bus) -> list[str]:
    """Shard every MoE layer's experts over `mesh` ("edp", "ep") and route their tokens by all-to-all.
    Returns the names of the sharded parameters."""
    from disttrace.model.llama import MoE

    group, ep = mesh.get_group("ep"), mesh.size(1)
    sharded = []
    for name, moe in model.named_modules():
        if not isinstance(moe, MoE):
            continue
        local_n = moe.n_experts // ep
        for wname in ("w1", "w2", "w3"):
            lin = getattr(moe.experts, wname)
            full = lin.weight.detach()
            piece = full[mesh.get_local_rank(1) * local_n :][:local_n].clone()
            lin.weight = torch.nn.Parameter(
                DTensor.from_local(piece, mesh, [Replicate(), Shard(0)], run_check=False)
            )
            _localise(lin)
            sharded.append(f"{name}.experts.{wname}.weight")
        _route(moe.experts, name, group, ep, local_n, bus)
    return sharded


def _route(experts, layer: str, group, ep: int, local_n: int, bus) -> None:
    state: dict = {}

    def dispatch(_mod, args):
        x, counts = args
        counts = counts.to(torch.int64)
        arrived = torch.empty_like(counts)  # [source rank, local expert], flattened
        dist.all_to_all_single(arrived, counts, group=group)
        send = counts.view(ep, local_n).sum(1).tolist()
        arrived = arrived.view(ep, local_n).tolist()
        recv = [sum(row) for row in arrived]
        p = bus.emit(Dispatch(layer=layer, stage="dispatch", tokens=x, splits=send))
        y = all_to_all(p.tokens, recv, send, group)
        # arrivals come by source rank, each source's tokens by local expert: regroup by local expert
        starts, at = [], 0
        for row in arrived:
            starts.append([])
            for n in row:
                starts[-1].append(at)
                at += n
        order = [
            i
            for e in range(local_n)
            for s in range(ep)
            for i in range(starts[s][e], starts[s][e] + arrived[s][e])
        ]
        perm = torch.tensor(order, dtype=torch.int64, device=y.device)
        local_counts = [sum(arrived[s][e] for s in range(ep)) for e in range(local_n)]
        state.update(perm=perm, send=send, recv=recv, counts=local_counts)
        return y.index_select(0, perm), local_counts

    def combine(_mod, _args, out):
        p = bus.emit(
            Dispatch(
                layer=layer,
                stage="combine",
                tokens=out,
                splits=state["recv"],
                counts=state["counts"],
            )
        )
        back = torch.empty_like(p.tokens).index_copy(0, state["perm"], p.tokens)
        return all_to_all(back, state["send"], state["recv"], group)

    experts.register_forward_pre_hook(dispatch)
    experts.register_forward_hook(combine)


class ExpertParallel(DataParallel):
    name = "ep"
    engine = "DistributedDataParallel + all_to_all expert parallel"

    def __init__(self, manifest: Manifest, model, mesh, bus):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.nn.parallel import DistributedDataParallel as DDP

        par = manifest.parallelism
        self.plain, self.bus, self.dp, self.ep = model, bus, par.dp, par.ep
        self.max_grad_norm = manifest.training.max_grad_norm
        names = [n for n, _ in model.named_parameters()]
        device = model.rope_cos.device
        # ep groups are consecutive dp ranks; tp = pp = 1 here, so the dp group is the world
        self.ep_mesh = init_device_mesh(
            device.type, (par.dp // par.ep, par.ep), mesh_dim_names=("edp", "ep")
        )
        sharded = set(apply_ep(model, self.ep_mesh, bus))
        params = dict(model.named_parameters())
        self.named = [TensorRef(i, n, params[n]) for i, n in enumerate(names)]
        self.experts = [r for r in self.named if r.name in sharded]
        self.edp_group = self.ep_mesh.get_group("edp") if par.dp > par.ep else None
        DDP._set_params_and_buffers_to_ignore_for_model(model, sorted(sharded))
        self.group = mesh.get_group("dp")
        self._buckets: dict[int, int] = {}
        dense = {id(p): (i, n) for i, n, p in self.named if n not in sharded}
        self.model = apply_ddp(
            model, self.group, bus, dense, manifest.debug.ddp_bucket_cap_mb, self._buckets
        )
        self.optimizer = build_optimizer(manifest, model.parameters())

    def groups(self) -> dict[str, list[list[int]]]:
        world = self.dp  # tp = pp = 1
        return {
            "ep": [list(range(s, s + self.ep)) for s in range(0, world, self.ep)],
            "edp": [list(range(j, world, self.ep)) for j in range(self.ep)],
        }

    def replicas(self) -> list[ReplicaRule]:
        """The router and the dense parameters are replicas over dp (DDP), so over each ep group too; an
        expert slice is replicated over edp only (the ranks of other ep groups holding the same experts)."""
        rules = [ReplicaRule(phase="data", dim="dp", relation="differ")]
        for phase in ("reduce", "clip", "optimizer"):
            rules.append(ReplicaRule(phase=phase, dim="dp", relation="agree", exclude=EXPERTS))
            if self.dp > self.ep:
                rules.append(ReplicaRule(phase=phase, dim="edp", relation="agree", tensors=EXPERTS))
        rules.append(SCALARS_AGREE)
        return rules

    def micro_batch(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()

    def backward(self, loss, last: bool):
        loss.backward()
        grads = grads_of(self.named)
        if not last:
            self.bus.emit(Backward(grads=grads))
            return
        local = grads_of(self.experts, present_only=True)
        self.bus.emit(Backward(grads=local, before_collective=True))
        for _, _, g in local:
            piece = g.to_local()  # the DTensor's own storage: changed in place
            piece.div_(self.dp)
            if self.edp_group is not None:
                dist.all_reduce(piece, group=self.edp_group)
        self.bus.emit(Reduce(grads=grads))
