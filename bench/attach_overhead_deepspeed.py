"""What attaching disttrace costs a DeepSpeed script (bench/attach_overhead.py's sibling): an MLP trained by a
DeepSpeedEngine at one ZeRO stage (AdamW, accumulation 2, clipping, 2 ranks on gloo, DeepSpeed's CPU
accelerator), timed unattached, then a fresh engine of the same model attached (every phase recorded, the
collective tracer on), in one run on the same processes. Prints the median step times and their ratio.

    python bench/attach_overhead_deepspeed.py [--stage 2] [--steps 6] [--world 2] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

import disttrace.api


def build(width: int):
    torch.manual_seed(0)
    blocks = []
    for _ in range(2):
        blocks += [nn.Linear(width, 3 * width), nn.GELU(), nn.Linear(3 * width, width)]
    return nn.Sequential(*blocks)


def engine_of(width: int, stage: int):
    import deepspeed

    model = build(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1_000_000,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return model, engine, optimizer


def steps(engine, rank, n, width, accum=2, run=None) -> list[float]:
    times = []
    for step in range(n):
        t0 = time.perf_counter()
        for mb in range(accum):
            g = torch.Generator().manual_seed(1000 * rank + 10 * step + mb)
            loss = engine(torch.randn(16, width, generator=g)).pow(2).mean()
            if run is not None:
                loss = run.loss(loss)
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - t0)
    return times


def worker(rank, world, port, n, width, stage, out, q):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(1)
    model, engine, _ = engine_of(width, stage)
    steps(engine, rank, 2, width)  # warm-up
    plain = steps(engine, rank, n, width)
    _, engine2, opt2 = engine_of(width, stage)
    run = disttrace.api.attach(engine2, opt2, out=out, name="attach-overhead-deepspeed")
    steps(engine2, rank, 2, width, run=run)
    attached = steps(engine2, rank, n, width, run=run)
    run.close()
    if rank == 0:
        q.put((sum(p.numel() for p in build(width).parameters()), plain, attached))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--width", type=int, default=1024)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(
            worker,
            args=(args.world, port, args.steps, args.width, args.stage, out, q),
            nprocs=args.world,
            join=True,
            start_method="spawn",
        )
        params, plain, attached = q.get()
    a, b = statistics.median(plain), statistics.median(attached)
    print(
        f"DeepSpeed ZeRO-{args.stage}, {params / 1e6:.1f}M parameters, {args.world} ranks, "
        f"{args.steps} steps each (accumulation 2, clipping)"
    )
    print(
        f"median step: unattached {a * 1e3:.0f} ms, attached {b * 1e3:.0f} ms; ratio {b / a:.2f}x"
    )


if __name__ == "__main__":
    main()
