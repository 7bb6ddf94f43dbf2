"""One rank of a real job in this process (a gloo world of 1): the manifest's model, data, strategy and hook
bus, and its training step emitted through the bus as run/job/loop.py emits it. For the benches that time the
recorder's hooks on a real step's hook lists (bench/recorder_breakdown.py, bench/recorder_passes.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# the realistic CPU model the recorder's benches measure (dp, accumulation 2), as manifest overrides
REALISTIC = [
    "model.dim=512",
    "model.n_layers=4",
    "model.max_seq_len=256",
    "training.grad_accum_steps=2",
]


@dataclass
class OneRank:
    manifest: dict  # the frozen manifest as a plain document
    data: Any  # disttrace.data.windows.TokenData
    bus: Any  # disttrace.run.job.hooks.HookBus
    model: Any
    strategy: Any  # disttrace.run.parallel.common.Strategy
    params: int  # the parameters' bytes

    def step(self, step: int, before_end=None) -> None:
        """One training step through the bus: step_start, every micro-batch's data, forward, loss and
        backward, the optimizer step, then `before_end()` (e.g. a checkpoint's point) and step_end."""
        from disttrace.model.llama import lm_loss
        from disttrace.run.job.hooks import Batch, Data, Loss

        bus, strategy = self.bus, self.strategy
        accum = self.manifest["training"]["grad_accum_steps"]
        bus.step = step
        bus.emit("step_start")
        strategy.zero_grad()
        for mb in range(accum):
            bus.micro_batch = mb
            batch = bus.emit(Data(Batch(**self.data.batch(step, mb, 0)))).batch
            with strategy.micro_batch(mb == accum - 1):
                loss = lm_loss(strategy.model(batch.inputs), batch.targets)
                loss = bus.emit(Loss(loss)).loss
                strategy.backward(loss / accum, mb == accum - 1)
        strategy.step()
        if before_end is not None:
            before_end()
        bus.emit("step_end")


def start(sets: list[str]) -> OneRank:
    """The default manifest with `sets` (dp = 1 added first), on a fresh gloo world of one rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", OMP_NUM_THREADS="1")
    from disttrace.run.job.launch import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from disttrace.config.freezing import freeze
    from disttrace.config.manifest import Manifest
    from disttrace.data.windows import TokenData
    from disttrace.model.llama import build_model
    from disttrace.run.job.hooks import HookBus
    from disttrace.run.job.loop import emit_module_outputs
    from disttrace.run.parallel import build_strategy

    torch.set_num_threads(1)
    doc = freeze(ROOT / "manifests" / "default.toml", ["parallelism.dp=1", *sets]).model_dump()
    m = doc["manifest"]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    data = TokenData(m, doc["resolved"]["data_path"], doc["resolved"]["tokenizer_path"])
    bus = HookBus(0)
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"])
    emit_module_outputs(model, bus)
    strategy = build_strategy(Manifest.model_validate(m), model, mesh, bus)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return OneRank(m, data, bus, model, strategy, params)


def stop() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
