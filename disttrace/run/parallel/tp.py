"""Tensor parallel (Megatron-style) with DTensor's `parallelize_module`, and dp x tp with FSDP2 over dp.

The plan is data: module path -> style. Column-wise splits the output features (q/k/v heads, the SwiGLU
gate and up projections), row-wise splits the input features and all-reduces the output (wo, w2), so each
block costs two all-reduces forward and two backward. The embedding is vocab-parallel (row-wise over the
vocabulary), the output head column-wise with its logits gathered for the loss. Norm weights stay whole
and replicated on every tp rank: their gradients must agree across the tp group (checked by `check`).

Composition order (torchtitan's): TP first, inside each block, then FSDP2 over the dp mesh dimension,
which shards the already TP-sharded DTensors further along dp. DDP + TP is avoided: TP-sharded
weights drop out of DDP's `named_parameters()` after a forward (docs/design.md, "Facts").
"""

from __future__ import annotations

import contextlib

from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import Backward, Reduce, TensorRef, grads_of
from disttrace.run.parallel.common import (
    SCALARS_AGREE,
    TP_ACTIVATIONS_AGREE,
    Strategy,
    build_optimizer,
)
from disttrace.store.documents import ReplicaRule


def tp_plan(model) -> dict:
    """Module path -> style, for the modules this (possibly pipeline-stage) model holds."""
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    if model.output is not None:
        plan["output"] = ColwiseParallel(output_layouts=Replicate())
    for i in model.layers:
        plan.update(
            {
                f"layers.{i}.attention.wq": ColwiseParallel(),
                f"layers.{i}.attention.wk": ColwiseParallel(),
                f"layers.{i}.attention.wv": ColwiseParallel(),
                f"layers.{i}.attention.wo": RowwiseParallel(),
                f"layers.{i}.feed_forward.w1": ColwiseParallel(),
                f"layers.{i}.feed_forward.w3": ColwiseParallel(),
                f"layers.{i}.feed_forward.w2": RowwiseParallel(),
            }
        )
    return plan


def apply_tp(model, tp_mesh):
    return parallelize_module(model, tp_mesh, tp_plan(model))


class TensorParallel(Strategy):
    engine = "DTensor parallelize_module"

    def __init__(self, manifest: Manifest, model, mesh, bus):
        self.name = "tp"
        self.plain = model
        self.bus = bus
        self.max_grad_norm = manifest.training.max_grad_norm
        self.group = mesh.get_group("dp")
        self.dp = manifest.parallelism.dp
        names = [n for n, _ in model.named_parameters()]
        apply_tp(model, mesh["tp"])
        if self.dp > 1:
            from disttrace.run.parallel.fsdp import apply_fsdp

            apply_fsdp(model, mesh["dp"], reshard_after_forward=True)
            self.engine += " + FSDP2 over dp"
        params = dict(model.named_parameters())
        self.named = [TensorRef(i, n, params[n]) for i, n in enumerate(names)]
        self.model = model
        self.optimizer = build_optimizer(manifest, model.parameters())

    def replicas(self) -> list[ReplicaRule]:
        rules = [
            ReplicaRule(phase=p, dim="tp", relation="agree", tensors="*norm.weight*")
            for p in ("reduce", "clip", "optimizer")
        ]
        rules.append(SCALARS_AGREE)
        rules.append(
            ReplicaRule(phase="data", dim="tp", relation="agree")
        )  # a tp group reads one batch
        rules += TP_ACTIVATIONS_AGREE
        if self.dp > 1:
            rules.append(ReplicaRule(phase="data", dim="dp", relation="differ"))
        return rules

    def micro_batch(self, last: bool):
        if self.dp > 1:
            self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def backward(self, loss, last: bool):
        loss.backward()
        grads = grads_of(self.named)
        if self.dp == 1:  # under FSDP2 the local gradient stays inside it until the reduce-scatter
            self.bus.emit(Backward(grads=grads))
        if last:
            self.bus.emit(
                Reduce(grads=grads)
            )  # tp's reductions ran inside backward; dp's (if any) just now
