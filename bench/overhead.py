"""What recording costs a run users would run: step time of each recording variant against the unrecorded
baseline (`record.enabled = false`), in the same processes, same data, steps interleaved so machine noise
hits every variant alike. Prints medians, ratios and run-store bytes per step.

    python bench/overhead.py [--world 2] [--steps 8] [--set model.dim=768 ...] [--no-tiny] [--tp 2]
                             [--device cuda]

`--device cuda` runs the same on GPUs with NCCL, one rank per GPU (bench/gpu_check.sh): each step's time is
taken after a device synchronisation, so it includes whatever the digests make the device or the host wait.

By default it measures a realistic CPU model (dim 512, 4 layers, sequence 256, dp = 2, gradient
accumulation 2, the memory ledger on), then the tiny default model as the worst case (every tensor is
small, so the Python cost per tensor is the largest share). Variants:

  off                      record.enabled = false: the loop and the step clock only
  recorder+ledger          trajectory digests every step, memory ledger, no collective trace
  default                  + the Flight Recorder collective trace (record.collectives = "metadata")
  default, full digests    the same, every tensor digested in full (Recorder(reuse=False): the recorder
                           before run/record/digest.py's `Seen`, which hashes only the bytes it digested lately)
  default+magnitudes       + the gradient magnitudes the numeric bound reads (run/record/scales.py: one sum of
                           squares per module input and output gradient; the job records them whenever
                           it records); their own time counts their module and tensor hooks too
  default+live check       + debug.live_check (one 16-byte-per-rule all-gather per step)
  values                   recorder + ledger + the dispatch-mode tracer with payload digests ("values")

`--tp 2` runs the realistic model tensor parallel (DTensor, dp = world / 2) and measures what the replica
rules of tensor parallelism cost (docs/replicas.md: a tp group's forward outputs and loss agree, so do the
reduced gradients of the norm weights it replicates and the clip scalars), against the same run without
them:

  default, no forward      recorded as default, without forward records (record.forward = false)
  default                  with them (what the forward rule reads)
  default, full digests    as above, every tensor digested in full
  live check, no tp rules  + debug.live_check with the strategy's rules minus those
  live check, all rules    + debug.live_check with every rule

Each observer's own time is printed twice: wall seconds in its hook handlers against the off step's wall
time, and CPU seconds of the rank's thread in them (time.thread_time) against the off step's CPU seconds,
the figure other jobs on shared cores disturb least (it leaves out what gloo's own threads do, so the
off step's CPU time is below its wall time even on an idle machine).

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

# name -> what runs in that variant: the recorder (digesting every tensor in full with reuse=False: the
# recorder before run/record/digest.py's `Seen`; without forward records with forward=False), the memory ledger,
# the Flight Recorder trace, the magnitudes, the live check (its rules: "all" the strategy's, or "no tp
# rules": without the rules a tp group's replicated activations, loss, reduced norm gradients and clip
# scalars add), the dispatch-mode tracer with payload digests
ON = {"recorder": True, "ledger": True, "trace": True}
SPECS = {
    "off": {},
    "recorder+ledger": {"recorder": True, "ledger": True},
    "default": ON,
    "default, full digests": {**ON, "reuse": False},
    "default+magnitudes": {**ON, "magnitudes": True},
    "default+live check": {**ON, "live": "all"},
    "values": {"recorder": True, "ledger": True, "values": True},
}
# --tp: what the replica rules of tensor parallelism cost, against the same run without them
TP_SPECS = {
    "off": {},
    "default, no forward": {**ON, "forward": False},
    "default": ON,
    "default, full digests": {**ON, "reuse": False},
    "live check, no tp rules": {**ON, "live": "no tp rules"},
    "live check, all rules": {**ON, "live": "all"},
}
VARIANTS = tuple(SPECS)
from onerank import REALISTIC  # noqa: E402

TINY = ["training.grad_accum_steps=2"]  # the default manifest's model
RING = 64
CPU = ", CPU"  # an observer's label + CPU: its hook time in CPU seconds of the rank's thread (thread_time)
WARMUP = 2  # steps left out of the medians (DDP rebuilds its buckets after step 1)


class Gated:
    """A view of the hook bus whose handlers run only while `flag["on"]` names their variant, timing them:
    an observer's own seconds (`spent[label]`, per step: the worker takes the median over the steps after
    the warm-up) are a figure the machine's noise does not swamp."""

    def __init__(self, bus, flag: dict, names: set[str], spent: dict, label: str):
        self.bus, self.flag, self.names, self.spent, self.label = bus, flag, names, spent, label
        spent.setdefault(label, 0.0)
        spent.setdefault(label + CPU, 0.0)

    def on(self, point, fn, order=50):
        def gated(b, p):
            if self.flag["on"] in self.names:
                t, c = time.perf_counter(), time.thread_time()
                fn(b, p)
                self.spent[self.label + CPU] += time.thread_time() - c
                self.spent[self.label] += time.perf_counter() - t

        self.bus.on(point, gated, order)

    def listening(self, point):
        return self.bus.listening(point)

    def timed(self, fn):
        """`fn` with its calls' seconds added to this observer's (a method its module or tensor hooks call,
        outside the bus: the magnitudes' forward and gradient hooks)."""

        def call(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                self.spent[self.label + CPU] += time.thread_time() - c
                self.spent[self.label] += time.perf_counter() - t

        return call


def worker(rank, world, port, frozen_doc, steps, out, q, device_type="cpu", specs=None):
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
    from disttrace.run.job.hooks import Batch, Data, HookBus, Loss
    from disttrace.run.job.loop import emit_module_outputs
    from disttrace.run.job.stepclock import StepClock
    from disttrace.run.job.topology import groups_of
    from disttrace.run.parallel import build_strategy
    from disttrace.run.parallel.common import SCALARS_AGREE, TP_ACTIVATIONS_AGREE
    from disttrace.run.record.collectives import CollectiveTracer
    from disttrace.run.record.flightrec import FlightRecorderTrace
    from disttrace.run.record.livecheck import LiveCheck
    from disttrace.run.record.memory import MemoryLedger
    from disttrace.run.record.recorder import Recorder
    from disttrace.run.record.scales import Magnitudes

    specs = specs or SPECS
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
    tp = typed.parallelism.tp
    mesh = init_device_mesh(device_type, (1, world // tp, tp), mesh_dim_names=("pp", "dp", "tp"))
    data = TokenData(
        m, frozen_doc["resolved"]["data_path"], frozen_doc["resolved"]["tokenizer_path"]
    )
    bus = HookBus(rank)
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"]).to(
        device
    )
    emit_module_outputs(model, bus)
    strategy = build_strategy(typed, model, mesh, bus)
    dp_rank = mesh["dp"].get_local_rank()
    base = Path(out) / f"rank{rank}"
    flag = {"on": "off"}
    StepClock(base / "off", rank).attach(bus)
    closing = []
    recorders = {}
    # own seconds of each observer's hook handlers, per variant ("recorder <variant>", ...)
    spent: dict[str, float] = {}
    groups = {**groups_of(typed), "world": [list(range(world))]}
    all_rules = strategy.replicas()
    tp_rules = [*TP_ACTIVATIONS_AGREE, SCALARS_AGREE]
    without = [r for r in all_rules if r not in tp_rules and not (r.phase == "reduce" and tp > 1)]
    for v, spec in specs.items():  # each variant writes its own run dir, so its bytes are its own
        if not spec.get("recorder"):
            continue
        rec = Recorder(
            base / v,
            rank,
            forward=spec.get("forward", True),
            reuse=spec.get("reuse", True),
            updates=typed.record.updates,
        ).attach(Gated(bus, flag, {v}, spent, f"recorder {v}"))
        closing.append(rec)
        recorders[v] = rec
        if spec.get("ledger"):
            closing.append(
                MemoryLedger(base / v, rank, typed, strategy).attach(
                    Gated(bus, flag, {v}, spent, f"ledger {v}")
                )
            )
        if spec.get("live"):
            rules = all_rules if spec["live"] == "all" else without
            LiveCheck(base / v, rec, rules, groups, rank).attach(
                Gated(bus, flag, {v}, spent, f"live check {v} ({len(rules)} rules)")
            )
    traced = {v for v, spec in specs.items() if spec.get("trace")}
    fr = FlightRecorderTrace(base / "default", rank).attach(
        Gated(bus, flag, traced, spent, "trace")
    )
    magnified = [v for v, spec in specs.items() if spec.get("magnitudes")]
    mags = None
    if magnified:
        gated = Gated(bus, flag, set(magnified), spent, "magnitudes")
        # its module hooks (each input's norm) and tensor hooks (each output gradient's) timed as its own
        for name in ("_input", "_grad"):
            setattr(Magnitudes, name, gated.timed(getattr(Magnitudes, name)))
        mags = Magnitudes(base / magnified[0], rank, model).attach(gated)
        closing.append(mags)
    tracer = CollectiveTracer(base / "values", rank, values=True)
    times = {v: [] for v in specs}
    cpu_times = {v: [] for v in specs}  # the rank's main thread's CPU seconds a step
    own_steps: dict[str, list[float]] = {}
    first_turn = {"trace": "default", "magnitudes": magnified[0] if magnified else None}
    accum = m["training"]["grad_accum_steps"]
    for step in range(1, steps + 1):
        for v, spec in specs.items():
            flag["on"] = v
            if mags is not None:
                mags._on = bool(
                    spec.get("magnitudes")
                )  # its module hooks fire in that variant only
            ctx = tracer if spec.get("values") else contextlib.nullcontext()
            dist.barrier()
            t, c = time.perf_counter(), time.thread_time()
            with ctx:
                tracer.step = bus.step = step
                bus.emit("step_start")
                strategy.zero_grad()
                for mb in range(accum):
                    bus.micro_batch = mb
                    read = data.batch(step, mb, dp_rank)
                    batch = Batch(
                        read["inputs"].to(device), read["targets"].to(device), read["sample_ids"]
                    )
                    batch = bus.emit(Data(batch)).batch
                    with strategy.micro_batch(mb == accum - 1):
                        logits = strategy.model(batch.inputs)
                        loss = bus.emit(Loss(lm_loss(logits, batch.targets))).loss
                        strategy.backward(loss / accum, mb == accum - 1)
                strategy.step()
                bus.emit("step_end")
                if cuda:
                    torch.cuda.synchronize()
            times[v].append(time.perf_counter() - t)
            cpu_times[v].append(time.thread_time() - c)
            if step > WARMUP:  # each observer's seconds in this step: their median is its own time
                for label, secs in spent.items():
                    turn = label.removesuffix(CPU)
                    if secs and (turn not in first_turn or first_turn[turn] == v):
                        own_steps.setdefault(label, []).append(secs)
            spent.update(dict.fromkeys(spent, 0.0))
    dumps = fr.dumps
    t = time.perf_counter()
    fr.close()  # the end-of-run copy of what is left in the ring
    close_s = time.perf_counter() - t
    tracer.close()
    for o in closing:
        o.close()
    if rank == 0:
        q.put(
            {
                "times": {v: statistics.median(ts[WARMUP:]) for v, ts in times.items()},
                "cpu_times": {v: statistics.median(ts[WARMUP:]) for v, ts in cpu_times.items()},
                "dumps": dumps,
                "own_ms_per_step": {k: 1e3 * statistics.median(v) for k, v in own_steps.items()},
                "final_copy_ms": 1e3 * close_s,
                # what each recorder hashed only (bytes it had digested lately: digest.Seen)
                "hashed_mib_per_step": {
                    v: rec._seen.hit_bytes / 2**20 / steps
                    for v, rec in recorders.items()
                    if rec._seen is not None
                },
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


def measure(
    world: int,
    steps: int,
    sets: list[str],
    device_type: str = "cpu",
    tp: int = 1,
    only: list[str] | None = None,
) -> dict:
    """Median step time (rank 0) per variant and run-store bytes per step (all ranks), for one world size;
    `tp` > 1: tensor parallel over tp ranks (dp = world / tp), the TP_SPECS variants; `only`: these of
    them (and off)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.multiprocessing as mp

    from disttrace.config.freezing import freeze
    from disttrace.run.job.launch import free_port

    specs = TP_SPECS if tp > 1 else SPECS
    if only:
        unknown = set(only) - set(specs)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; known: {list(specs)}")
        specs = {v: spec for v, spec in specs.items() if v == "off" or v in only}
    frozen = freeze(
        ROOT / "manifests" / "default.toml",
        [
            f"parallelism.dp={world // tp}",
            f"parallelism.tp={tp}",
            f"training.steps={steps}",
            *sets,
        ],
    )
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [
            ctx.Process(
                target=worker,
                args=(r, world, port, frozen.model_dump(), steps, out, q, device_type, specs),
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
        # the trace's file is shared by the traced variants, which issue the same collectives
        fr_trace = sum(_bytes(d / "default" / "collectives") for d in ranks) / (len(specs) * steps)
        stored = {}
        for v, spec in specs.items():
            if not spec.get("recorder"):
                continue
            own = sum(_bytes(d / v) - _bytes(d / v / "collectives") for d in ranks) / steps
            stored[v] = own + (fr_trace if spec.get("trace") else 0.0)
        res["bytes_per_record"] = _per_record(
            [d / "default" for d in ranks]
        )  # before the directory goes
    m = frozen.manifest["model"]
    return {
        **res,
        "specs": list(specs),
        "bytes_per_step": stored,
        "model": f"dim {m['dim']}, {m['n_layers']} layers, seq {m['max_seq_len']}",
    }


def report(title: str, r: dict, world: int, steps: int, tp: int = 1) -> None:
    base = r["times"]["off"]
    layout = f"dp={world // tp}" + (f", tp={tp}" if tp > 1 else "")
    print(
        f"{title} ({r['model']}, {layout}, accumulation 2): {steps} steps x {len(r['specs'])} variants "
        f"interleaved, median of steps {WARMUP + 1}..{steps} on rank 0; Flight Recorder copies: {r['dumps']}"
    )
    for v in r["specs"]:
        t = r["times"][v]
        kib = r["bytes_per_step"].get(v)
        size = f"   {kib / 1024:8.1f} KiB/step" if kib is not None else ""
        print(f"  {v:24s} {t * 1e3:9.1f} ms   ratio vs off {t / base:5.3f}{size}", flush=True)
    print(
        "  each observer's own hook time per step (share of the off step): "
        f"end-of-run ring copy {r['final_copy_ms']:.1f} ms",
        flush=True,
    )
    for k, ms in r["own_ms_per_step"].items():
        print(f"    {k:48s} {ms:8.2f} ms  {ms / (base * 1e3):6.2%}", flush=True)
    cpu = r["cpu_times"]["off"]
    print(
        f"  in CPU time (the rank's thread; the figure other jobs on the cores disturb least): the off "
        f"step {cpu * 1e3:.1f} ms; "
        + "; ".join(
            f"{k.removesuffix(CPU)} {ms / (cpu * 1e3):.2%}"
            for k, ms in r["own_ms_per_step"].items()
            if k.endswith(CPU)
        ),
        flush=True,
    )
    hashed = ", ".join(f"{v} {mib:.1f}" for v, mib in r["hashed_mib_per_step"].items())
    print(f"  MiB a step hashed only (digested before, digest.Seen): {hashed}", flush=True)
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
        "--tp",
        type=int,
        default=1,
        help="tensor parallel over this many ranks (the replica rules' cost, TP_SPECS)",
    )
    ap.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one rank per GPU"
    )
    ap.add_argument(
        "--variants",
        default="",
        help="measure only these variants (and off), separated by ';' (names hold commas)",
    )
    args = ap.parse_args()
    only = [v.strip() for v in args.variants.split(";") if v.strip()]
    report(
        "realistic",
        measure(args.world, args.steps, REALISTIC + args.set, args.device, args.tp, only),
        args.world,
        args.steps,
        args.tp,
    )
    if not args.no_tiny:
        report(
            "worst case: the tiny default model",
            measure(args.world, max(args.steps, 12), TINY, args.device, args.tp, only),
            args.world,
            max(args.steps, 12),
            args.tp,
        )


if __name__ == "__main__":
    main()
