"""A training script with no disttrace line in it, in the shape of PyTorch's DDP tutorial: a dataset behind
a DistributedSampler, gradient accumulation with `no_sync`, clipping, AdamW, `destroy_process_group` at
the end. `disttrace run -- torchrun --nproc-per-node 2 tests/scripts/plain_ddp.py` records it as it is.

`--checkpoint-every N --checkpoint-dir D` saves a DCP checkpoint of the model and optimizer every N steps
(D/step-N), and `--resume D/step-N` starts from one, skipping the batches it already trained on.

`--optimizer zero` steps through ZeroRedundancyOptimizer (an optimizer holding the AdamW it steps), and
`--clip split` clips in a function of the script's own with the two halves of clip_grad_norm_, bound by
name at import (torchtitan's way).

`--bug no-accum-divide` plants a bug users report: each micro-batch's loss is not divided by the
accumulation count, so every step's gradient is `--accum` times too large; clipping and Adam hide most of
it from the loss curve. The script prints its own final loss, so the effect is measured without disttrace.

    torchrun --nproc-per-node 2 tests/scripts/plain_ddp.py [--bug no-accum-divide] [--steps N]
        [--checkpoint-every N --checkpoint-dir D] [--resume D/step-N]
    python tests/scripts/plain_ddp.py --spawn        # the tutorial's mp.spawn launch, 2 ranks
"""

import argparse
import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grads_with_norm_, get_total_norm
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def dataset(n=256):
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 10, generator=g)
    y = torch.randint(0, 5, (n,), generator=g)
    return TensorDataset(x, y)


def train(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(ToyModel())
    if args.optimizer == "zero":
        optimizer = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2
        )
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sampler = DistributedSampler(dataset(), num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=4, sampler=sampler)
    batches = iter(loader)
    start = 0
    if args.resume:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {
            "model": model_state,
            "optim": optim_state,
            "step": torch.zeros((), dtype=torch.int64),
        }
        dcp.load(state, checkpoint_id=args.resume)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        start = int(state["step"])
        for _ in range(start * args.accum):  # the batches the checkpoint's steps trained on
            next(batches)
    loss = torch.zeros(())
    for step in range(start + 1, args.steps + 1):
        optimizer.zero_grad()
        for mb in range(args.accum):
            x, y = next(batches)
            sync = mb == args.accum - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                loss = F.cross_entropy(model(x), y)
                if args.bug != "no-accum-divide":
                    loss = loss / args.accum
                loss.backward()
        if args.clip == "split":
            clip_in_halves(list(model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            model_state, optim_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optim": optim_state, "step": torch.tensor(step)}
            dcp.save(state, checkpoint_id=os.path.join(args.checkpoint_dir, f"step-{step}"))
    if rank == 0:
        print(f"final loss {loss.item():.6f}", flush=True)


def clip_in_halves(parameters, max_norm):
    total = get_total_norm([p.grad for p in parameters if p.grad is not None])
    clip_grads_with_norm_(parameters, max_norm, total)
    return total


def spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    train(rank, world, args)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bug", default="none", choices=["none", "no-accum-divide"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "zero"])
    ap.add_argument("--clip", default="whole", choices=["whole", "split"])
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--checkpoint-dir", default="checkpoints")
    ap.add_argument("--resume", default=None, help="a checkpoint directory this script saved")
    ap.add_argument("--spawn", action="store_true", help="launch 2 ranks with mp.spawn")
    args = ap.parse_args()
    if not args.spawn:  # started by torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
