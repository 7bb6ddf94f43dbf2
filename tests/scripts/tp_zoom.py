"""A user-style tensor-parallel script attached to disttrace, for `zoom` of attached runs: two blocks (an up
projection and a down projection each), tensor parallel by torch's own parallelize_module (ColwiseParallel up,
RowwiseParallel down) over `--tp` ranks, or plain on one rank with `--tp 1` (the dp=1 reference). Every rank
reads the same batch. `--bug-from K` plants, from step K on, the bug in layers.1.down only: its style relabels
the row-parallel output's Partial placement Replicate without the all-reduce, so each rank goes on with its
own partial sum (the unsummed row-parallel output). A checkpoint after every step (DCP, disttrace's INDEX);
`--resume CKPT` starts from one with run.resume().

    python tests/scripts/tp_zoom.py --out runs [--tp 1|2] [--bug-from K] [--steps N] [--resume CKPT]
"""

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import disttrace.api  # disttrace

VOCAB, DIM, HIDDEN, SEQ, BATCH = 32, 16, 32, 8, 4
BUG = {"on": False}


class UnsummedRowwise(RowwiseParallel):
    """RowwiseParallel whose output hook, while the bug is on, tags the local partial sum with the output
    placement instead of redistributing to it (no all-reduce over tp)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if BUG["on"] and outputs.placements != tuple(output_layouts):
            outputs = DTensor.from_local(
                outputs.to_local(), device_mesh, output_layouts, run_check=False
            )
        return RowwiseParallel._prepare_output_fn(
            output_layouts, use_local_output, mod, outputs, device_mesh
        )


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(h)))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def batch(step):
    g = torch.Generator().manual_seed(1000 * step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def train(rank, world, args):
    torch.manual_seed(0)
    model = Model()
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {}
        for i in range(len(model.layers)):
            plan[f"layers.{i}.up"] = ColwiseParallel()
            plan[f"layers.{i}.down"] = UnsummedRowwise() if i == 1 else RowwiseParallel()
        parallelize_module(model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = disttrace.api.attach(
        model, optimizer, out=args.out, name="tp-zoom", forward=True, config={"steps": args.steps}
    )  # disttrace
    start = run.resume(args.resume) if args.resume else 0  # disttrace
    for step in range(start + 1, args.steps + 1):
        BUG["on"] = args.bug_from is not None and step >= args.bug_from
        tokens, targets = batch(step)
        optimizer.zero_grad()
        logits = model(tokens)
        loss = run.loss(F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)))
        loss.backward()
        optimizer.step()
        run.checkpoint()  # disttrace
    run.close()  # disttrace
    return run


def worker(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        run = train(rank, world, args)
        if rank == 0:
            print(run.run_dir, flush=True)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--bug-from", type=int, default=None)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--out", default="runs")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.tp == 1:
        worker(0, 1, port, args)
    else:
        mp.spawn(worker, args=(args.tp, port, args), nprocs=args.tp, join=True)


if __name__ == "__main__":
    main()
