"""What recording costs a run users would run: step time of each recording variant against the unrecorded
baseline (`record.enabled = false`), in the same processes, same data, steps interleaved so machine noise
hits every variant alike. Prints medians, ratios and run-store bytes per step.

    python bench/overhead.py [--world 2] [--steps 8] [--set model.dim=768 ...] [--no-tiny] [--device cuda]

`--device cuda` runs the same on GPUs with NCCL, one rank per GPU (bench/gpu_check.sh): each step's time is
taken after a device synchronisation, so it includes whatever the digests make the device or the host wait.

By default it measures a realistic CPU model (dim 512, 4 layers, sequence 256, dp = 2, gradient
accumulation 2, the memory ledger on), then the tiny default model as the worst case (every tensor is
small, so the Python cost per tensor is the largest share). Variants:

  off                      record.enabled = false: the loop and the step clock only
  recorder+ledger          trajectory digests every step, memory ledger, no collective trace
  default                  + the Flight Recorder collective trace (record.collectives = "metadata")
  default+magnitudes       + the gradient magnitudes the numeric bound reads (run/scales.py: one sum of
                           squares per module input and output gradient; the job records them whenever
                           it records)
  default+live check       + debug.live_check (one 16-byte-per-rule all-gather per step)
  values                   recorder + ledger + the dispatch-mode tracer with payload digests ("values")

The Flight Recorder ring is set to 64 entries here so that it is copied several times within a short bench
(its copy costs per entry in the ring, so the amortised cost per step is the same as with torch's 2,000);
every variant issues the same collectives, so the metadata trace's bytes per step are its file's bytes
over all steps of all variants. Real parts throughout: the manifest's model, DDP strategy, hook bus,
recorder, ledger and trace on a gloo world started by torch.multiprocessing.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = (
    "off",
    "recorder+ledger",
    "default",
    "default+magnitudes",
    "default+live check",
    "values",
)
REALISTIC = [
    "model.dim=512",
    "model.n_layers=4",
    "model.max_seq_len=256",
    "training.grad_accum_steps=2",
]
TINY = ["training.grad_accum_steps=2"]  # the default manifest's model
RING = 64
WARMUP = 2  # steps left out of the medians (DDP rebuilds its buckets after step 1)


class Gated:
    """A view of the hook bus whose handlers run only while `flag["on"]` names their variant, timing them:
    an observer's own seconds (`spent[label]`) are a figure the machine's noise does not swamp."""

    def __init__(self, bus, flag: dict, names: set[str], spent: dict, label: str):
        self.bus, self.flag, self.names, self.spent, self.label = bus, flag, names, spent, label
        spent.setdefault(label, 0.0)

    def on(self, point, fn, order=50):
        def gated(b, p):
            if self.flag["on"] in self.names:
                t = time.perf_counter()
                fn(b, p)
                self.spent[self.label] += time.perf_counter() - t

        self.bus.on(point, gated, order)

    def listening(self, point):
        return self.bus.listening(point)


def worker(rank, world, port, frozen_doc, steps, out, q, device_type="cpu"):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        TORCH_FR_BUFFER_SIZE=str(RING),
    )
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from disttrace.config.manifest import Manifest
    from disttrace.data.windows import TokenData
    from disttrace.model.llama import build_model, lm_loss
    from disttrace.run.collectives import CollectiveTracer
    from disttrace.run.flightrec import FlightRecorderTrace
    from disttrace.run.hooks import HookBus
    from disttrace.run.livecheck import LiveCheck
    from disttrace.run.loop import emit_module_outputs
    from disttrace.run.memory import MemoryLedger
    from disttrace.run.parallel import build_strategy
    from disttrace.run.recorder import Recorder
    from disttrace.run.stepclock import StepClock
    from disttrace.run.topology import groups_of

    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    m = frozen_doc["manifest"]
    typed = Manifest.model_validate(
        m
    )  # strategies, ledger and topology read the typed manifest, as in the job
    mesh = init_device_mesh(device_type, (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
    data = TokenData(
        m, frozen_doc["resolved"]["data_path"], frozen_doc["resolved"]["tokenizer_path"]
    )
    bus = HookBus(rank)
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"]).to(
        device
    )
    emit_module_outputs(model, bus)
    strategy = build_strategy(typed, model, mesh, bus)
    base = Path(out) / f"rank{rank}"
    flag = {"on": "off"}
    recorded = {"recorder+ledger", "default", "default+magnitudes", "default+live check", "values"}
    StepClock(base / "off", rank).attach(bus)
    recorders, ledgers = {}, []
    spent: dict[
        str, float
    ] = {}  # own seconds of each observer's hook handlers, in the default variant
    for v in sorted(recorded):  # each variant writes its own run dir, so its bytes are its own
        recorders[v] = Recorder(base / v, rank).attach(
            Gated(bus, flag, {v}, spent, f"recorder {v}")
        )
        ledgers.append(
            MemoryLedger(base / v, rank, typed, strategy).attach(
                Gated(bus, flag, {v}, spent, f"ledger {v}")
            )
        )
    fr = FlightRecorderTrace(base / "default", rank).attach(
        Gated(bus, flag, {"default", "default+magnitudes", "default+live check"}, spent, "trace")
    )
    from disttrace.run.scales import Magnitudes

    mags = Magnitudes(base / "default+magnitudes", rank, model).attach(
        Gated(bus, flag, {"default+magnitudes"}, spent, "magnitudes")
    )
    LiveCheck(
        base / "default+live check",
        recorders["default+live check"],
        strategy.replicas(),
        {**groups_of(typed), "world": [list(range(world))]},
        rank,
    ).attach(Gated(bus, flag, {"default+live check"}, spent, "live check"))
    tracer = CollectiveTracer(base / "values", rank, values=True)
    times = {v: [] for v in VARIANTS}
    accum = m["training"]["grad_accum_steps"]
    for step in range(1, steps + 1):
        for v in VARIANTS:
            flag["on"] = v
            mags._on = v == "default+magnitudes"  # its module hooks fire in that variant only
            ctx = tracer if v == "values" else contextlib.nullcontext()
            dist.barrier()
            t = time.perf_counter()
            with ctx:
                tracer.step = bus.step = step
                bus.emit("step_start")
                strategy.zero_grad()
                for mb in range(accum):
                    bus.micro_batch = mb
                    batch = data.batch(step, mb, rank)
                    batch = {
                        **batch,
                        "inputs": batch["inputs"].to(device),
                        "targets": batch["targets"].to(device),
                    }
                    batch = bus.emit("data", batch=batch, fetch=None)["batch"]
                    with strategy.micro_batch(mb == accum - 1):
                        loss = bus.emit(
                            "loss",
                            loss=lm_loss(strategy.model(batch["inputs"]), batch["targets"]),
                            tokens=0,
                        )["loss"]
                        strategy.backward(loss / accum, mb == accum - 1)
                strategy.step()
                bus.emit("step_end")
                if cuda:
                    torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t)
    dumps = fr.dumps
    t = time.perf_counter()
    fr.close()  # the end-of-run copy of what is left in the ring
    close_s = time.perf_counter() - t
    tracer.close()
    for o in [*recorders.values(), *ledgers, mags]:
        o.close()
    if rank == 0:
        q.put(
            {
                "times": {v: statistics.median(ts[WARMUP:]) for v, ts in times.items()},
                "dumps": dumps,
                "own_ms_per_step": {
                    k: 1e3 * s / steps
                    for k, s in spent.items()
                    if k.endswith("default") or k in ("trace", "live check", "magnitudes")
                },
                "final_copy_ms": 1e3 * close_s,
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def _bytes(d: Path) -> int:
    """Every file the run store holds (JSON lines, the trajectory's Arrow streams)."""
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) if d.is_dir() else 0


def _per_record(dirs: list[Path]) -> float | None:
    """Trajectory bytes per record (the streams' bytes over the records the step indexes count)."""
    import orjson

    size = records = 0
    for d in dirs:
        for f in (d / "trajectory").glob("rank-*.arrows"):
            size += f.stat().st_size
        for f in (d / "trajectory").glob("rank-*.steps.jsonl"):
            records += sum(
                orjson.loads(line)["records"] for line in f.read_bytes().splitlines() if line
            )
    return size / records if records else None


def measure(world: int, steps: int, sets: list[str], device_type: str = "cpu") -> dict:
    """Median step time (rank 0) per variant and run-store bytes per step (all ranks), for one world size."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.multiprocessing as mp

    from disttrace.config.manifest import freeze
    from disttrace.run.launch import free_port

    frozen = freeze(
        ROOT / "manifests" / "default.toml",
        [f"parallelism.dp={world}", f"training.steps={steps}", *sets],
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [
            ctx.Process(
                target=worker,
                args=(r, world, port, frozen.model_dump(), steps, out, q, device_type),
            )
            for r in range(world)
        ]
        for p in procs:
            p.start()
        res = None
        while (
            res is None
        ):  # a rank that dies (an import error, a crash) ends the bench instead of hanging it
            try:
                res = q.get(timeout=5)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    for p in procs:
                        p.terminate()
                    raise SystemExit(
                        f"a rank failed (exit codes {dead}); see its traceback above"
                    ) from None
        for p in procs:
            p.join()
        ranks = [Path(out) / f"rank{r}" for r in range(world)]
        fr_trace = sum(_bytes(d / "default" / "collectives") for d in ranks) / (
            len(VARIANTS) * steps
        )
        stored = {
            "recorder+ledger": sum(_bytes(d / "recorder+ledger") for d in ranks) / steps,
            "default": sum(
                _bytes(d / "default") - _bytes(d / "default" / "collectives") for d in ranks
            )
            / steps
            + fr_trace,
            "default+magnitudes": sum(_bytes(d / "default+magnitudes") for d in ranks) / steps
            + fr_trace,
            "default+live check": sum(_bytes(d / "default+live check") for d in ranks) / steps
            + fr_trace,
            "values": sum(_bytes(d / "values") for d in ranks) / steps,
        }
        res["bytes_per_record"] = _per_record(
            [d / "default" for d in ranks]
        )  # before the directory goes
    m = frozen.manifest["model"]
    return {
        **res,
        "bytes_per_step": stored,
        "model": f"dim {m['dim']}, {m['n_layers']} layers, seq {m['max_seq_len']}",
    }


def report(title: str, r: dict, world: int, steps: int) -> None:
    base = r["times"]["off"]
    print(
        f"{title} ({r['model']}, dp={world}, accumulation 2): {steps} steps x {len(VARIANTS)} variants "
        f"interleaved, median of steps {WARMUP + 1}..{steps} on rank 0; Flight Recorder copies: {r['dumps']}"
    )
    for v in VARIANTS:
        t = r["times"][v]
        kib = r["bytes_per_step"].get(v)
        size = f"   {kib / 1024:8.1f} KiB/step" if kib is not None else ""
        print(f"  {v:18s} {t * 1e3:9.1f} ms   ratio vs off {t / base:5.3f}{size}", flush=True)
    own = ", ".join(
        f"{k.removesuffix(' default')} {ms:.2f} ms ({ms / (base * 1e3):.2%})"
        for k, ms in r["own_ms_per_step"].items()
    )
    print(
        f"  default variant, each observer's own hook time per step (share of the off step): {own}; "
        f"end-of-run ring copy {r['final_copy_ms']:.1f} ms",
        flush=True,
    )
    if r.get("bytes_per_record"):
        print(
            f"  trajectory: {r['bytes_per_record']:.1f} bytes per record (Arrow stream, all ranks)",
            flush=True,
        )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="override the realistic model (section.key=value)",
    )
    ap.add_argument(
        "--no-tiny", action="store_true", help="skip the tiny default model (the worst case)"
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one rank per GPU"
    )
    args = ap.parse_args()
    report(
        "realistic",
        measure(args.world, args.steps, REALISTIC + args.set, args.device),
        args.world,
        args.steps,
    )
    if not args.no_tiny:
        report(
            "worst case: the tiny default model",
            measure(args.world, max(args.steps, 12), TINY, args.device),
            args.world,
            max(args.steps, 12),
        )


if __name__ == "__main__":
    main()
