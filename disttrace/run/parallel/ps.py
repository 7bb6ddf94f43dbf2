"""A parameter server, kept small: the one mechanism no torch.distributed engine offers.

Rank 0 is the server (and also a worker): it holds the master parameters and the optimizer. Every step,
each worker computes gradients on its own data shard with its copy of the parameters, pushes them to the
server (point-to-point send), the server averages them, steps the optimizer, and sends parameters back
(pull). With `parallelism.staleness = k`, workers compute on the parameters of k updates ago: the
asynchronous algorithm, made deterministic. k = 0 is synchronous SGD and must equal all-reduce; k > 0 is
a different algorithm, and diff must say so.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from disttrace.config.manifest import Manifest
from disttrace.run.job.hooks import (
    Backward,
    BeforeOptimizer,
    Optimizer,
    Reduce,
    ServerUpdate,
    TensorRef,
    grads_of,
    param_refs,
)
from disttrace.run.parallel.common import (
    OPTIMIZER_BLOB_TEMPLATE,
    Strategy,
    build_optimizer,
    load_optimizer_bytes,
    optimizer_bytes,
    optimizer_state_list,
)
from disttrace.store.documents import ReplicaRule


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflat_into(buffer: torch.Tensor, tensors) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(buffer[offset : offset + n].view_as(t))
        offset += n


class ParameterServer(Strategy):
    name = "parameter-server"
    engine = "parameter server over torch.distributed send/recv (ours)"
    SERVER = 0

    def __init__(self, manifest: Manifest, model, mesh, bus):
        self.plain = self.model = model
        self.bus = bus
        self.group = mesh.get_group("dp")
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.staleness = manifest.parallelism.staleness
        self.named = param_refs(model)
        self.is_server = self.rank == self.SERVER
        if self.is_server:
            self.master = [torch.nn.Parameter(p.detach().clone()) for _, _, p in self.named]
            self.optimizer = build_optimizer(manifest, self.master)
            self.versions: deque = deque(
                [flat(self.master).detach().clone()], maxlen=self.staleness + 1
            )
        else:
            self.master, self.optimizer = None, _NoOptimizer()
        self.master_named = [
            TensorRef(i, n, m) for (i, n, _), m in zip(self.named, self.master or [])
        ]

    def replicas(self) -> list[ReplicaRule]:
        rules = [ReplicaRule(phase="data", dim="dp", relation="differ")]
        if (
            self.staleness == 0
        ):  # everyone pulled the same version; with staleness the server is ahead
            rules.append(ReplicaRule(phase="optimizer", dim="dp", relation="agree", exclude="*:*"))
        return rules

    def micro_batch(self, last: bool):
        return (
            contextlib.nullcontext()
        )  # gradients accumulate locally; the push happens after the last

    def backward(self, loss, last: bool):
        loss.backward()
        grads = grads_of(self.named)
        self.bus.emit(Backward(grads=grads, before_collective=last))
        if not last:
            return
        local = flat(g for _, _, g in grads)
        if self.is_server:  # pull every worker's gradient, average with ours
            total = local.clone()
            buf = torch.empty_like(local)
            for src in range(self.world):
                if src != self.SERVER:
                    dist.recv(buf, src=dist.get_global_rank(self.group, src), group=self.group)
                    total += buf
            total /= self.world
            for m, (_, _, _g) in zip(self.master, grads):
                m.grad = torch.empty_like(m)
            unflat_into(total, [m.grad for m in self.master])
            self.bus.emit(Reduce(grads=grads_of(self.master_named)))
        else:
            dist.send(local, dst=dist.get_global_rank(self.group, self.SERVER), group=self.group)

    def step(self):
        self.bus.emit(
            BeforeOptimizer(optimizer=self.optimizer, params=self.master_named or self.named)
        )
        if self.is_server:
            self.optimizer.step()
            # parameter faults act here, on the master state, so the version handed out carries them
            self.bus.emit(ServerUpdate(params=self.master_named, optimizer=self.optimizer))
            self.versions.append(flat(self.master).detach().clone())
            # staleness k: hand out the parameters of k updates ago (the oldest kept version)
            out = self.versions[0]
            for dst in range(self.world):
                if dst != self.SERVER:
                    dist.send(out, dst=dist.get_global_rank(self.group, dst), group=self.group)
        else:
            out = torch.empty(
                sum(p.numel() for _, _, p in self.named), dtype=self.named[0][2].dtype
            )
            dist.recv(out, src=dist.get_global_rank(self.group, self.SERVER), group=self.group)
        with torch.no_grad():
            unflat_into(out, [p for _, _, p in self.named])
        state = optimizer_state_list(self.optimizer, self.master_named) if self.is_server else []
        self.bus.emit(Optimizer(params=self.named, state=state, optimizer=self.optimizer))

    def zero_grad(self):
        for _, _, p in self.named:
            p.grad = None

    # checkpoint: the server saves the master parameters and the optimizer; every rank loads the master
    def state_dict(self, with_optimizer: bool = True) -> dict:
        if not self.is_server:
            return {}
        state = {"model": {n: m.detach() for (_, n, _), m in zip(self.named, self.master)}}
        if with_optimizer:
            state["optim"] = optimizer_bytes(self.optimizer)
        return state

    def empty_state(self, with_optimizer: bool) -> dict:
        state = {"model": {n: torch.empty_like(p) for _, n, p in self.named}}
        if with_optimizer and self.is_server:
            state["optim"] = OPTIMIZER_BLOB_TEMPLATE
        return state

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for _, n, p in self.named:
                p.copy_(state["model"][n])
            if self.is_server:
                for (_, n, _), m in zip(self.named, self.master):
                    m.copy_(state["model"][n])
                if "optim" in state:
                    load_optimizer_bytes(self.optimizer, state["optim"])
                # the staleness window restarts at the loaded version (a documented limit of resume, k > 0)
                self.versions = deque(
                    [flat(self.master).detach().clone()], maxlen=self.staleness + 1
                )


class _NoOptimizer:
    """Workers have no optimizer: the server steps."""

    param_groups: list = []
    state: dict = {}

    def zero_grad(self, set_to_none: bool = True):
        pass
