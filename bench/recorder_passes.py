"""Where the recorder's own time goes in one step: the bytes it reads at each phase, as passes over the
model's parameter bytes, and the time per phase; then, inside one tensor's digest, the time of each of the
operations every cache-sized block goes through. The job is a real one in this process: the manifest's
model, the DDP strategy and hook bus on a gloo world of one rank (a DDP step's phases and tensors are those
of every rank of a larger world; bench/overhead.py measures the world of two).

    python bench/recorder_passes.py [--steps 6] [--set model.dim=768 ...] [--clip] [--checkpoint]

Two recorders listen, one step each in turn (warm-up steps left out): the recorder as it is (host tensors
whose bytes it digested lately are hashed only: run/record/digest.py, `Seen`) and the same recorder digesting every
tensor in full (`reuse=False`, the recorder before `Seen`). `--clip` sets training.max_grad_norm high enough
that the clip coefficient is 1 (the clipped gradients are the reduced ones); `--checkpoint` hands the
strategy's state dict to `before_checkpoint` every step, as a checkpoint step does (no files written).
Prints, per phase, the tensors, MiB and passes (MiB over the parameters' MiB) each recorder digested in full,
what the recorder hashed only, the medians of its time, and the step's own time against the step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onerank import REALISTIC  # noqa: E402

WARMUP = 2


def run(steps: int, sets: list[str], clip: bool, checkpoint: bool) -> dict:
    import onerank

    from disttrace.run.job.hooks import BeforeCheckpoint
    from disttrace.run.record.recorder import Recorder

    extra = ["training.max_grad_norm=1e9"] if clip else []
    job = onerank.start([f"training.steps={steps}", *sets, *extra])
    m, bus, strategy, params = job.manifest, job.bus, job.strategy, job.params

    class Counted(Recorder):
        """The recorder, its phases' bytes and seconds tallied (`tally[phase] = [tensors, bytes, s]`)."""

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.tally = defaultdict(lambda: [0, 0, 0.0])
            self.write_s = 0.0

        def _records(self, bus, phase, refs, *a, **k):
            t = time.perf_counter()
            super()._records(bus, phase, refs, *a, **k)
            e = self.tally[phase]
            e[0] += len(refs)
            e[1] += sum(x.numel() * x.element_size() for _, _, x in refs)
            e[2] += time.perf_counter() - t

        def _write(self, *a):
            t = time.perf_counter()
            super()._write(*a)
            self.write_s += time.perf_counter() - t

    flag = {"on": None}

    class Turn:
        """The bus as one recorder sees it: its handlers run in its turns only."""

        def __init__(self, name):
            self.name = name

        def on(self, point, fn, order=50):
            bus.on(point, lambda b, p: fn(b, p) if flag["on"] == self.name else None, order)

    out = Path(tempfile.mkdtemp())
    recorders = {
        "reuse": Counted(out / "reuse", 0),
        "full": Counted(out / "full", 0, reuse=False),
    }
    for name, r in recorders.items():
        r.attach(Turn(name))
    per_step = {
        name: [] for name in recorders
    }  # (step s, own s, tally snapshot, hashed-only bytes)
    for step in range(1, steps + 1):
        for name, r in recorders.items():
            flag["on"] = name
            r.tally.clear()
            r.write_s = 0.0
            before = r._seen.hit_bytes if r._seen is not None else 0
            t = time.perf_counter()
            saved = (
                (lambda s=step: bus.emit(BeforeCheckpoint(strategy.state_dict(), s)))
                if checkpoint
                else None
            )
            job.step(step, saved)
            wall = time.perf_counter() - t
            own = sum(e[2] for e in r.tally.values()) + r.write_s
            hashed = (r._seen.hit_bytes if r._seen is not None else 0) - before
            per_step[name].append((wall, own, {k: list(v) for k, v in r.tally.items()}, hashed))
    for r in recorders.values():
        r.close()
    onerank.stop()
    return {"params": params, "per_step": per_step, "model": m["model"]}


def components(sets: list[str], repeats: int = 5) -> dict[str, float]:
    """Seconds per GiB of each operation run over every cache-sized block of one step's large tensors
    (gradients and parameters after a real step), and of the whole digest. Each block is hashed first and
    the operation then reads it from cache, as in the digest: an operation's own cost is its row less the
    hash's. The sketch's version 1 (a float32 GEMM with K leading factors) is timed beside version 2's
    GEMV (one shared leading factor), on the same blocks."""
    import numpy as np
    import torch
    import xxhash

    from disttrace.analysis import tolerance
    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model, lm_loss
    from disttrace.run.record import digest as D
    from disttrace.run.record.digestmany import SMALL
    from disttrace.run.record.sketchplan import plan_for

    m = freeze(ROOT / "manifests" / "default.toml", sets).manifest
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"])
    tokens = torch.randint(0, m["model"]["vocab_size"], (4, m["model"]["max_seq_len"] + 1))
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    tensors = [p.grad for p in model.parameters()] + [p.detach() for p in model.parameters()]
    tensors = [t for t in tensors if t.numel() > SMALL]
    gib = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    blocks = []
    rng = np.random.default_rng(0)
    for t in tensors:
        x = t.numpy()
        plan = plan_for(x.shape, (0,) * x.ndim, x.shape)
        x2 = x.reshape(-1, x.shape[-1])
        for r0 in range(0, x2.shape[0], plan.block_rows):
            blk = x2[r0 : r0 + plan.block_rows]
            u = plan.u32[r0 : r0 + plan.block_rows]
            ut = rng.standard_normal((D.SKETCH_K, blk.shape[0])).astype(np.float32)
            blocks.append((blk, u, ut))
    chunk = tolerance.STAT_CHUNK
    ones = np.ones(chunk, dtype=np.float32)

    def runs(blk):
        return blk.reshape(-1)[: blk.size - blk.size % chunk].reshape(-1, chunk)

    def over_blocks(op):
        def f():
            h = xxhash.xxh3_128()
            for blk, u, ut in blocks:
                h.update(blk)
                op(blk, u, ut)

        return f

    def whole():
        for t in tensors:
            D.digest_tensor(t)

    ops = {
        "xxh3 (the digest) alone": over_blocks(lambda b, u, ut: None),
        "+ sum (float32 runs)": over_blocks(
            lambda b, u, ut: (runs(b) @ ones).sum(dtype=np.float64)
        ),
        "+ sum of squares (runs)": over_blocks(
            lambda b, u, ut: np.vecdot(runs(b), runs(b)).sum(dtype=np.float64)
        ),
        "+ sketch v1 GEMM U^T X": over_blocks(lambda b, u, ut: ut @ b),
        "+ sketch v2 GEMV u^T X": over_blocks(lambda b, u, ut: u @ b),
        "digest_tensor (all of them)": whole,
    }
    import cputime

    med = cputime.medians(ops, repeats)
    return {k: v / gib for k, v in med.items()}, len(tensors), len(blocks)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--set", action="append", default=[], help="override the model")
    ap.add_argument("--clip", action="store_true", help="clip (with a coefficient of 1)")
    ap.add_argument("--checkpoint", action="store_true", help="a checkpoint's state every step")
    ap.add_argument("--no-components", action="store_true")
    args = ap.parse_args()
    sets = REALISTIC + args.set
    r = run(args.steps, sets, args.clip, args.checkpoint)
    mib = r["params"] / 2**20
    mm = r["model"]
    print(
        f"dim {mm['dim']}, {mm['n_layers']} layers, seq {mm['max_seq_len']}, accumulation 2, DDP "
        f"(world 1){', clip' if args.clip else ''}{', checkpoint state' if args.checkpoint else ''}: "
        f"parameters {mib:.1f} MiB; median of steps {WARMUP + 1}..{args.steps} of each recorder"
    )
    for name, rows in r["per_step"].items():
        rows = rows[WARMUP:]
        wall = statistics.median(w for w, *_ in rows)
        own = statistics.median(o for _, o, *_ in rows)
        hashed = statistics.median(h for *_, h in rows) / 2**20
        print(
            f"  recorder {name:5s}: own {own * 1e3:6.1f} ms a step = {own / wall:5.2%} of the step "
            f"({wall * 1e3:.0f} ms); hashed only (bytes digested before): {hashed:6.1f} MiB"
        )
        phases = rows[-1][2]
        full_mib = 0.0
        for ph, (n, b, _) in phases.items():
            s = statistics.median(row[2][ph][2] for row in rows)
            full_mib += b / 2**20
            print(
                f"    {ph:10s} {n:4d} tensors {b / 2**20:7.1f} MiB = {b / r['params']:4.2f} passes "
                f"{s * 1e3:7.1f} ms"
            )
        print(
            f"    all        {full_mib:7.1f} MiB handed over = {full_mib / mib:4.2f} passes; "
            f"{full_mib - hashed:7.1f} MiB digested in full = {(full_mib - hashed) / mib:4.2f} passes"
        )
    if not args.no_components:
        per_gib, n, blocks = components(sets)
        print(
            f"inside a digest ({n} gradients and parameters, {blocks} blocks of at most "
            f"{1 << 17} elements): CPU ms per GiB of tensor bytes, each block hashed and then, from cache, "
            "the operation"
        )
        for k, v in per_gib.items():
            print(f"  {k:32s} {v * 1e3:7.1f} ms/GiB ({1 / v:5.2f} GiB/s)")


if __name__ == "__main__":
    main()
