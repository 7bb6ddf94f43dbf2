"""A user-style training script: a tiny token model, gradient accumulation over padded micro-batches,
2 ranks on gloo, attached to disttrace in the marked lines. `--bug` plants one of the silent-bug families
people ship (the fix is the default):

  token-norm    each micro-batch's loss normalised by its own token count (mean / accum) instead of by the
                step's token count (https://github.com/huggingface/transformers/pull/34191)
  unwrapped     the forward runs through ddp.module, so DDP never reduces
                (https://github.com/pytorch/pytorch/issues/104336 family)
  zero-grad     optimizer.zero_grad() inside the accumulation window: earlier micro-batches are lost
  late-reduce   --engine manual: the hand-written all-reduce runs before the last micro-batch's backward, which
                stays local (https://github.com/deepspeedai/DeepSpeed/issues/7985 family)

    python tests/scripts/accum_train.py --out runs [--bug NAME] [--engine ddp|manual]
    disttrace run -- torchrun --nproc-per-node 2 tests/scripts/accum_train.py
"""

import argparse
import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api  # disttrace

VOCAB, PAD = 32, -100


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def micro_batch(rank, step, mb, size=4, length=8):
    """Sequences of varying length (padded targets are ignored): token counts differ per micro-batch."""
    g = torch.Generator().manual_seed(10_000 * rank + 100 * step + mb)
    tokens = torch.randint(0, VOCAB, (size, length), generator=g)
    targets = torch.roll(tokens, -1, dims=1)
    lengths = torch.randint(2, length + 1, (size,), generator=g)
    targets[torch.arange(length)[None, :] >= lengths[:, None]] = PAD
    return tokens, targets


def train(rank, world, args):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLM()
    net = DDP(model) if args.engine == "ddp" else model
    if args.engine == "manual":  # the script's own data parallelism: same start on every rank
        for p in model.parameters():
            dist.broadcast(p.data, 0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr)
    config = {
        "lr": args.lr,
        "grad_accum_steps": args.accum,
        "micro_batch_size": 4,
        "steps": args.steps,
        "max_grad_norm": 1.0,
    }
    run = disttrace.api.attach(
        net, optimizer, out=args.out, name="accum-train", config=config
    )  # disttrace
    if args.resume:
        start = run.resume(args.resume)  # disttrace
    else:
        start = 0
    for step in range(start + 1, args.steps + 1):
        batches = [micro_batch(rank, step, mb) for mb in range(args.accum)]
        total_tokens = sum(int((t != PAD).sum()) for _, t in batches)
        if args.bug != "zero-grad":
            optimizer.zero_grad()
        for mb, (tokens, targets) in enumerate(batches):
            if args.bug == "zero-grad":
                optimizer.zero_grad()
            last = mb == args.accum - 1
            if args.engine == "manual" and args.bug == "late-reduce" and last:
                reduce_gradients(model, world)  # too early: this micro-batch's gradient stays local
            run.batch(tokens)  # disttrace
            forward = net.module if args.bug == "unwrapped" else net
            sync = last or args.engine != "ddp"
            with net.no_sync() if not sync else contextlib.nullcontext():
                logits = forward(tokens)
                ce = F.cross_entropy(
                    logits.reshape(-1, VOCAB),
                    targets.reshape(-1),
                    ignore_index=PAD,
                    reduction="sum",
                )
                if args.bug == "token-norm":
                    loss = ce / int((targets != PAD).sum()) / args.accum
                else:
                    loss = ce / total_tokens
                loss = run.loss(loss)  # disttrace
                loss.backward()
        if args.engine == "manual" and args.bug != "late-reduce":
            reduce_gradients(model, world)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            run.checkpoint(step=step)  # disttrace
    run.close()  # disttrace
    if rank == 0:
        print(run.run_dir, flush=True)  # disttrace


def reduce_gradients(model, world):
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def spawned(rank, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, args)
    finally:
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--bug",
        default="none",
        choices=["none", "token-norm", "unwrapped", "zero-grad", "late-reduce"],
    )
    ap.add_argument("--engine", default="ddp", choices=["ddp", "manual"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--out", default="runs")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--resume", default=None, help="a checkpoint directory to resume from")
    args = ap.parse_args()
    if "RANK" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(spawned, args=(2, port, args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
