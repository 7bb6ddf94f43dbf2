"""A user-style training script whose data comes from a DataLoader driven by a DistributedSampler, attached
to disttrace in the marked lines: the loader is watched (its batches are the `data` records, with the sample
ids the sampler yielded) and the top-level blocks' outputs are recorded (`forward`). 2 ranks on gloo,
gradient accumulation 2, clipping.

  --engine ddp     DDP; the loader watched in place: attach(..., loader=loader)
  --engine fsdp2   FSDP2 (fully_shard on each block, then the root); the loader through run.watch_loader()
  --engine tp      DTensor tensor parallelism (parallelize_module: embed and head row-wise, mix column-wise);
                   both ranks read the same batches (a DistributedSampler with num_replicas=1)
  --sampler-seed   the DistributedSampler's seed (another seed: other samples on every rank)
  --bug perturb    the `mix` block adds 1e-4 to its output (a block that computes something else)
  --bug same-data  a DistributedSampler with num_replicas=1: every rank reads the same samples (under tp:
                   num_replicas=2, so the tensor-parallel ranks read different samples)

    python tests/scripts/loader_train.py --out runs [--engine fsdp2] [--sampler-seed 1] [--bug NAME]
"""

import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import disttrace.api  # disttrace

VOCAB, SAMPLES, BATCH, ACCUM = 32, 32, 4, 2


class Perturbed(nn.Linear):
    def forward(self, x):
        return super().forward(x) + 1e-4


class TinyLM(nn.Module):
    def __init__(self, perturb: bool):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = (Perturbed if perturb else nn.Linear)(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (SAMPLES, 8), generator=g)
    return TensorDataset(tokens, torch.roll(tokens, -1, dims=1))


def train(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM(args.bug == "perturb")
    if args.engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in (model.embed, model.mix, model.head):
            fully_shard(block)
        net = fully_shard(model)
    elif args.engine == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plan = {
            "embed": RowwiseParallel(input_layouts=Replicate()),
            "mix": ColwiseParallel(),
            "head": RowwiseParallel(),
        }
        net = parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    else:
        net = DDP(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    replicas = 1 if (args.bug == "same-data") != (args.engine == "tp") else world
    sampler = DistributedSampler(
        dataset(), num_replicas=replicas, rank=rank % replicas, shuffle=True, seed=args.sampler_seed
    )
    loader = DataLoader(dataset(), batch_size=BATCH, sampler=sampler)
    config = {"lr": 1e-2, "grad_accum_steps": ACCUM, "micro_batch_size": BATCH, "steps": args.steps}
    if args.engine == "ddp":
        run = disttrace.api.attach(
            net,
            optimizer,
            out=args.out,
            name="loader-train",
            config=config,  # disttrace
            loader=loader,
            forward=True,
        )  # disttrace
        batches = loader
    else:
        run = disttrace.api.attach(
            net,
            optimizer,
            out=args.out,
            name="loader-train",
            config=config,  # disttrace
            forward=["mix"],
        )  # disttrace
        batches = run.watch_loader(loader)  # disttrace
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        window = []
        for tokens, targets in batches:
            window.append((tokens, targets))
            if len(window) < ACCUM:
                continue
            step += 1
            optimizer.zero_grad()
            for mb, (x, y) in enumerate(window):
                last = mb == ACCUM - 1
                if args.engine == "fsdp2":
                    net.set_requires_gradient_sync(last)
                ctx = (
                    net.no_sync() if args.engine == "ddp" and not last else contextlib.nullcontext()
                )
                with ctx:
                    loss = F.cross_entropy(net(x).reshape(-1, VOCAB), y.reshape(-1)) / ACCUM
                    run.loss(loss).backward()  # disttrace
            window = []
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            if step == args.steps:
                break
        epoch += 1
    run.close()  # disttrace
    if rank == 0:
        print(run.run_dir, flush=True)  # disttrace


def spawned(rank, world, rendezvous, args):
    # a file rendezvous: a free TCP port picked here could be taken by another job before the ranks bind it
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", default="ddp", choices=["ddp", "fsdp2", "tp"])
    ap.add_argument("--bug", default="none", choices=["none", "perturb", "same-data"])
    ap.add_argument("--sampler-seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(2, os.path.join(tmp, "rendezvous"), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
