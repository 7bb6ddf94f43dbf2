"""What attaching disttrace costs a user's DDP script: the same loop (a ~12.6M-parameter MLP, AdamW,
accumulation 2, clipping, 2 ranks on gloo) timed unattached, then attached (every phase recorded, the
collective tracer on), in one run on the same processes. Prints the median step times and their ratio.

    python bench/attach_overhead.py [--steps 6] [--world 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import disttrace.api


def build():
    torch.manual_seed(0)
    blocks = []
    for _ in range(2):
        blocks += [nn.Linear(1024, 3072), nn.GELU(), nn.Linear(3072, 1024)]
    return nn.Sequential(*blocks)


def steps(net, optimizer, rank, n, accum=2, run=None) -> list[float]:
    times = []
    for step in range(n):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        for mb in range(accum):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
            x = torch.randn(16, 1024, generator=g)
            ctx = net.no_sync() if mb < accum - 1 else _Null()
            with ctx:
                loss = net(x).pow(2).mean() / accum
                if run is not None:
                    loss = run.loss(loss)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        times.append(time.perf_counter() - t0)
    return times


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def worker(rank, world, port, n, out, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = build()
    net = DDP(model)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    steps(net, optimizer, rank, 2)  # warm-up: DDP rebuilds its buckets after the first step
    plain = steps(net, optimizer, rank, n)
    net2 = DDP(build())  # a fresh DDP: a comm hook can only be registered before its first backward
    opt2 = torch.optim.AdamW(net2.parameters(), lr=1e-4)
    run = disttrace.api.attach(net2, opt2, out=out, name="attach-overhead")
    steps(net2, opt2, rank, 2, run=run)
    attached = steps(net2, opt2, rank, n, run=run)
    run.close()
    if rank == 0:
        q.put((sum(p.numel() for p in model.parameters()), plain, attached, str(run.run_dir)))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            worker,
            args=(args.world, port, args.steps, out, q),
            nprocs=args.world,
            join=True,
            start_method="spawn",
        )
        params, plain, attached, run_dir = q.get()
    a, b = statistics.median(plain), statistics.median(attached)
    print(
        f"{params / 1e6:.1f}M parameters, {args.world} ranks, {args.steps} steps each (accumulation 2, clipping)"
    )
    print(
        f"median step: unattached {a * 1e3:.0f} ms, attached {b * 1e3:.0f} ms; ratio {b / a:.2f}x"
    )


if __name__ == "__main__":
    main()
