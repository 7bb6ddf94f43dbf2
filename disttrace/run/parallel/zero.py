"""ZeRO stage 1: DDP still all-reduces full gradients, but `ZeroRedundancyOptimizer` gives each rank the
optimizer state of its own partition of the parameters only; it steps that partition and broadcasts the
updated parameters to the others. Model-state bytes per rank: 4Psi + K Psi / N (fp32: params + grads whole,
optimizer state sharded)."""

from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrace.config.manifest import Manifest
from disttrace.run.parallel.common import (
    OPTIMIZER_BLOB_TEMPLATE,
    load_optimizer_bytes,
    optimizer_bytes,
    optimizer_class_and_kwargs,
)
from disttrace.run.parallel.ddp import DataParallel
from disttrace.store.documents import ReplicaRule


class ZeroStage1(DataParallel):
    name = "zero1"
    engine = "DistributedDataParallel + ZeroRedundancyOptimizer"

    def __init__(self, manifest: Manifest, model, mesh, bus):
        super().__init__(manifest, model, mesh, bus)
        cls, kwargs = optimizer_class_and_kwargs(manifest)
        self.optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=cls, process_group=self.group, **kwargs
        )

    def replicas(self) -> list[ReplicaRule]:
        # parameters are broadcast whole after each step: replicas; optimizer state is partitioned: not
        return [
            ReplicaRule(phase="data", dim="dp", relation="differ"),
            ReplicaRule(phase="reduce", dim="dp", relation="agree"),
            ReplicaRule(phase="clip", dim="dp", relation="agree"),
            ReplicaRule(phase="optimizer", dim="dp", relation="agree", exclude="*:*"),
        ]

    # the optimizer state is sharded by rank: each rank saves and loads its own partition's state
    def _key(self) -> str:
        return f"rank-{torch.distributed.get_rank(self.group):05d}"

    def state_dict(self, with_optimizer: bool = True) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = {"model": get_model_state_dict(self.model)}
        if with_optimizer:
            state["optim"] = {self._key(): optimizer_bytes(self.optimizer.optim)}
        return state

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state["model"])
        if "optim" in state:
            load_optimizer_bytes(self.optimizer.optim, state["optim"][self._key()])

    def empty_state(self, with_optimizer: bool) -> dict:
        state = self.state_dict(with_optimizer=False)
        if with_optimizer:
            state["optim"] = {self._key(): OPTIMIZER_BLOB_TEMPLATE}
        return state
