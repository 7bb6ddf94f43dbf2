"""Tracing overhead: step time with the recorder (and the live replica check, and the collective tracer) on vs off, in the same
processes, same data, interleaved, so machine noise hits every variant alike. Prints medians and ratios.

    python bench/overhead.py [--world 2] [--steps 30] [--set model.dim=128 ...]

Real parts: the default manifest's model, DDP strategy, hook bus, recorder and tracer on a gloo world
started by torch.multiprocessing (2 ranks by default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def worker(rank, world, port, frozen_doc, steps, out, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from disttrace.run.collectives import CollectiveTracer
    from disttrace.data.windows import TokenData
    from disttrace.run.hooks import HookBus
    from disttrace.model.llama import build_model, lm_loss
    from disttrace.run.parallel import build_strategy
    from disttrace.run.recorder import Recorder
    from disttrace.run.loop import emit_module_outputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    m = frozen_doc["manifest"]
    mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    data = TokenData(m, frozen_doc["resolved"]["data_path"], frozen_doc["resolved"]["tokenizer_path"])
    bus = HookBus(rank)
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"])
    emit_module_outputs(model, bus)
    strategy = build_strategy(m, model, mesh, bus)
    run_dir = Path(out) / f"rank{rank}"
    recorder = Recorder(run_dir, rank)
    tracer = CollectiveTracer(run_dir, rank)
    recorder_on = {"v": False}
    # the recorder attaches once; a gate in front of it turns it off for the "off" variant
    for point, handler in (("data", recorder._data), ("forward", recorder._forward), ("loss", recorder._loss),
                           ("backward", recorder._grads("backward")), ("reduce", recorder._grads("reduce")),
                           ("optimizer", recorder._optimizer), ("step_start", recorder._step_start),
                           ("step_end", recorder._step_end)):
        bus.on(point, lambda b, p, h=handler: h(b, p) if recorder_on["v"] else None, order=90)
    from disttrace.run.livecheck import LiveCheck

    from disttrace.run.topology import groups_of

    live = LiveCheck(run_dir, recorder, strategy.replicas(), {**groups_of(m), "world": [list(range(world))]}, rank)
    live_on = {"v": False}
    bus.on("step_end", lambda b, p: live._check(b, p) if live_on["v"] else None, order=89)
    variants = ["off", "recorder", "recorder+live check", "recorder+collectives"]
    times = {v: [] for v in variants}
    accum = m["training"]["grad_accum_steps"]
    for step in range(1, steps + 1):
        for v in variants:
            recorder_on["v"] = v != "off"
            live_on["v"] = v == "recorder+live check"
            ctx = tracer if v == "recorder+collectives" else contextlib.nullcontext()
            dist.barrier()
            t = time.perf_counter()
            with ctx:
                bus.step = step
                bus.emit("step_start")
                strategy.zero_grad()
                for mb in range(accum):
                    bus.micro_batch = mb
                    batch = bus.emit("data", batch=data.batch(step, mb, rank), fetch=None)["batch"]
                    with strategy.micro_batch(mb == accum - 1):
                        loss = bus.emit("loss", loss=lm_loss(strategy.model(batch["inputs"]), batch["targets"]),
                                        tokens=0)["loss"]
                        strategy.backward(loss / accum, mb == accum - 1)
                strategy.step()
                bus.emit("step_end")
            times[v].append(time.perf_counter() - t)
    recorder.close()
    tracer.close()
    if rank == 0:
        q.put({v: statistics.median(ts[3:]) for v, ts in times.items()})
    dist.destroy_process_group()


def measure(world: int, steps: int, sets: list[str]) -> dict:
    """Median step time (rank 0) per variant, and run-store bytes per step, for one world size."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.multiprocessing as mp

    from disttrace.run.launch import free_port
    from disttrace.config.manifest import freeze

    frozen = freeze(ROOT / "manifests" / "default.toml",
                    [f"parallelism.dp={world}", f"training.steps={steps}", *sets])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, frozen.model_dump(), steps, out, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        res = q.get(timeout=900)
        for p in procs:
            p.join()
        size = sum(f.stat().st_size for f in Path(out).rglob("*.jsonl"))
    return {"times": res, "bytes_per_step": size / (3 * steps)}  # three of the four variants record


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    r = measure(args.world, args.steps, args.set)
    base = r["times"]["off"]
    print(f"world {args.world}, {args.steps} steps x {len(r['times'])} variants interleaved, median step time (rank 0):")
    for v, t in r["times"].items():
        print(f"  {v:22s} {t * 1e3:8.2f} ms   ratio vs off {t / base:5.2f}")
    print(f"  run-store bytes per step (all ranks, trajectory + collectives): {r['bytes_per_step'] / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
