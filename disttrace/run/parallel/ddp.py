"""Data parallel through DistributedDataParallel, with gradient accumulation.

Every rank holds the whole model; after the last micro-batch's backward, DDP all-reduces the gradient
buckets and averages them. A communication hook (DDP's own extension point) lets the `backward` hook
point see each bucket's local gradients *before* the all-reduce, which is where a gradient fault must
act to reach the other ranks. Earlier micro-batches run under `no_sync()` and accumulate locally.
"""

from __future__ import annotations

import contextlib
import warnings

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import Backward, Reduce, TensorRef, grads_of, param_refs
from disttrace.run.parallel.common import Strategy, build_optimizer
from disttrace.store.documents import ReplicaRule


def apply_ddp(
    model,
    group,
    bus,
    names: dict[int, tuple[int, str]],
    bucket_cap_mb: float | None = None,
    buckets: dict | None = None,
):
    """Wrap `model` in DDP and route each bucket through the `backward` hook point before its all-reduce.
    `buckets` (if given) collects bucket index -> bytes as DDP's reducer hands them to the hook."""
    with (
        warnings.catch_warnings()
    ):  # broadcast_buffers is deprecated in 2.13, its successor absent in 2.5
        warnings.simplefilter("ignore", FutureWarning)
        # our only buffers are RoPE tables, identical everywhere: no per-forward buffer broadcast
        ddp = DDP(
            model,
            process_group=group,
            broadcast_buffers=False,
            bucket_cap_mb=bucket_cap_mb,
            device_ids=None if model.rope_cos.device.type == "cpu" else [model.rope_cos.device],
        )
    world = dist.get_world_size(group)

    def allreduce_with_hook(_state, bucket):
        grads = [
            TensorRef(*names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())
        ]
        bus.emit(Backward(grads=grads, before_collective=True))
        buf = bucket.buffer()
        if buckets is not None:
            buckets[bucket.index()] = buf.numel() * buf.element_size()
        # gradients() are views into buffer(): handlers change them in place (the hook-bus contract)
        buf.div_(world)
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, allreduce_with_hook)
    return ddp


class DataParallel(Strategy):
    name = "ddp"
    engine = "DistributedDataParallel"

    def __init__(self, manifest: Manifest, model, mesh, bus):
        self.plain = model
        self.bus = bus
        self.max_grad_norm = manifest.training.max_grad_norm
        self.named = param_refs(model)
        names = {id(p): (i, n) for i, n, p in self.named}
        self.group = mesh.get_group("dp")
        self._buckets: dict[int, int] = {}
        self.model = apply_ddp(
            model, self.group, bus, names, manifest.debug.ddp_bucket_cap_mb, self._buckets
        )
        self.optimizer = build_optimizer(manifest, model.parameters())

    def engine_facts(self) -> dict:
        """DDP's buckets as its reducer handed them to the comm hook (GradBucket.index() and buffer size),
        to hold the dispatch-mode collective trace against."""
        sizes = [self._buckets[i] for i in sorted(self._buckets)]
        self._buckets.clear()  # per step: DDP rebuilds its buckets after the first
        return {"ddp_bucket_sizes": sizes}

    def replicas(self) -> list[ReplicaRule]:
        """Which copies must agree across the data-parallel group (and which must differ)."""
        return [
            ReplicaRule(phase="data", dim="dp", relation="differ"),
            ReplicaRule(phase="reduce", dim="dp", relation="agree"),
            ReplicaRule(
                phase="clip",
                dim="dp",
                relation="agree",
            ),  # clipped gradients and the scalars
            ReplicaRule(phase="optimizer", dim="dp", relation="agree"),
        ]

    def micro_batch(self, last: bool):
        return contextlib.nullcontext() if last else self.model.no_sync()

    def backward(self, loss, last: bool):
        loss.backward()
        grads = grads_of(self.named)
        if not last:
            self.bus.emit(Backward(grads=grads))  # accumulated local gradient, nothing reduced yet
        else:
            self.bus.emit(Reduce(grads=grads))  # DDP has averaged the buckets into p.grad

    def zero_grad(self):
        self.optimizer.zero_grad(
            set_to_none=False
        )  # as the earliest runs did: keeps trajectories comparable

    # checkpoint state, through DCP's state-dict helpers (they know DDP and FSDP alike)
