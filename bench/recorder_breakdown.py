"""Where the recorder's own time goes, by kind of tensor and by operation: one real DDP step (the job of
bench/recorder_passes.py: the manifest's model, DDP on a gloo world of one rank, accumulation 2) hands its
tensors to a recorder that keeps a copy of each hook's list; those lists are then digested again and again
in this process, in CPU time (time.thread_time, the figure other jobs on shared cores disturb least),
whole and operation by operation:

    python bench/recorder_breakdown.py [--repeats 7] [--set model.dim=768 ...] [--against REV]

  whole          digest_many on the hook's list: what the recorder pays for it
  whole, numpy   the same without run/record/fused.py's compiled pass (numba absent, or DISTTRACE_FUSED=0);
                 the columns after it are that path's operations
  read (xxh3)    one-shot xxh3-128 of each tensor's bytes: one pass over them from memory
  + sum          every cache-sized block of the large float32 tensors hashed, then its float32 runs'
                 sums taken from cache (the digest's own order): what the sum adds to the hash
  + squares      the same with the runs' sums of squares
  + sketch       the same with the sketch's GEMV u^T X
  rest           the numpy path less read, sum, squares and sketch: per-tensor Python, the small tensors'
                 batched path, the placement plans, the float64 fallbacks

and the step's write (the records sorted, encoded as one Arrow batch, written, the step index line sealed).
`--against REV` times digest_many of run/record/digest.py as git revision REV had it (loaded beside this
checkout's) on the same lists, interleaved, and prints both wholes and their ratio.

`--own STEPS` instead runs STEPS real steps with the recorder as a job has it (digest.Seen included) and
prints the CPU time of the rank's thread in all its hook handlers per step (median of the steps after two
of warm-up), and of it the compiled call (run/record/fused.py's many_stats: the hash and the statistics), the
step's write, and the rest (the recorder's and digest_many's Python, the small tensors' batches): what
bench/overhead.py's own time is made of, one rank in this process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from onerank import REALISTIC  # noqa: E402


def capture(sets: list[str], steps: int = 2):
    """The hook lists of the last of `steps` real DDP steps: [(kind, [(tensor copy, offset, shape)])], the
    step's records as the recorder wrote them, and the parameters' bytes."""
    import onerank

    from disttrace.run.record.recorder import Recorder

    job = onerank.start([f"training.steps={steps}", *sets])
    m, bus = job.manifest, job.bus
    lists: list = []
    written: list = []

    class Keeping(Recorder):
        def _records(self, bus, phase, refs, *a, **k):
            super()._records(bus, phase, refs, *a, **k)
            if bus.step == steps:
                kind = phase
                if phase == "backward":
                    kind = f"backward mb{bus.micro_batch}"
                elif phase == "optimizer":
                    kind = "optimizer state" if k.get("base") else "optimizer params"
                lists.append((kind, [(t.detach().clone(), None, None) for _, _, t in refs]))

        def _write(self, step, records, t):
            super()._write(step, records, t)
            written.append((step, list(records), t))

    rec = Keeping(Path(tempfile.mkdtemp()), 0).attach(bus)
    for step in range(1, steps + 1):
        job.step(step)
    rec.close()
    onerank.stop()
    return lists, written[-1], job.params, m["model"]


def _ops(items):
    """The operations of the breakdown over one hook's list, each a function of no argument."""
    import numpy as np
    import xxhash

    from disttrace.analysis import tolerance
    from disttrace.run.record import digest as D
    from disttrace.run.record.digestmany import SMALL, digest_many
    from disttrace.run.record.sketchplan import plan_for

    blocks = []
    for t, _, _ in items:
        if t.dtype.is_floating_point and t.numel() > SMALL and t.dim() > 0:
            x = t.numpy()
            plan = plan_for(tuple(x.shape), (0,) * x.ndim, tuple(x.shape))
            x2 = x.reshape(-1, x.shape[-1])
            for r0 in range(0, x2.shape[0], plan.block_rows):
                blocks.append((x2[r0 : r0 + plan.block_rows], plan.u32[r0 : r0 + plan.block_rows]))
    chunk = tolerance.STAT_CHUNK
    ones = np.ones(chunk, dtype=np.float32)

    def runs(b):
        f = b.reshape(-1)
        return f[: f.size - f.size % chunk].reshape(-1, chunk)

    def over_blocks(op):
        def f():
            h = xxhash.xxh3_128()
            for b, u in blocks:
                h.update(b)
                op(b, u)

        return f

    arrays = [t.numpy() for t, _, _ in items]

    def numpy_path():
        kernel, D._kernel = D._kernel, False
        try:
            digest_many(items)
        finally:
            D._kernel = kernel

    return {
        "whole": lambda: digest_many(items),
        "whole, numpy": numpy_path,
        "read (xxh3)": lambda: [xxhash.xxh3_128_hexdigest(a) for a in arrays],
        "blocks hashed": over_blocks(lambda b, u: None),
        "+ sum": over_blocks(lambda b, u: (runs(b) @ ones).sum(dtype=np.float64)),
        "+ squares": over_blocks(lambda b, u: np.vecdot(runs(b), runs(b)).sum(dtype=np.float64)),
        "+ sketch": over_blocks(lambda b, u: u @ b),
    }


def breakdown(lists, repeats: int) -> dict:
    """CPU seconds per kind and operation (median of the repeats, operations interleaved)."""
    import cputime

    out = {}
    for kind, items in lists:
        ops = _ops(items)
        med = cputime.medians(ops, repeats)
        hashed = med.pop("blocks hashed")
        row = {
            "tensors": len(items),
            "bytes": sum(t.numel() * t.element_size() for t, _, _ in items),
            "whole": med["whole"],
            "whole, numpy": med["whole, numpy"],
            "read (xxh3)": med["read (xxh3)"],
        }
        for k in ("+ sum", "+ squares", "+ sketch"):
            row[k] = max(0.0, med[k] - hashed)
        row["rest"] = row["whole, numpy"] - sum(
            row[k] for k in ("read (xxh3)", "+ sum", "+ squares", "+ sketch")
        )
        if kind in out:  # a kind's lists together (the forward point hands one tensor a call)
            for k, v in row.items():
                out[kind][k] += v
        else:
            out[kind] = row
    return out


def write_cost(last, repeats: int) -> dict:
    """CPU seconds of the step's write: encode, write, the index line (a fresh trajectory each repeat)."""
    from disttrace.run.record.recorder import Recorder

    step, records, t = last
    times = []
    for _ in range(repeats):
        d = Path(tempfile.mkdtemp())
        rec = Recorder(d, 0)
        recs = [dict(r) for r in records]
        s = time.thread_time()
        rec._write(step, recs, t)
        times.append(time.thread_time() - s)
        rec.close()
    return {"write": statistics.median(times), "records": len(records)}


def against(rev: str, lists, repeats: int) -> None:
    """digest_many of this checkout against REV's on the same lists, interleaved."""
    import cputime

    from disttrace.run.record import digestmany as now

    base = cputime.digest_at(rev)
    items = [it for _, lst in lists for it in lst]
    med = cputime.medians(
        {
            "base": lambda: [base.digest_many(lst) for _, lst in lists],
            "now": lambda: [now.digest_many(lst) for _, lst in lists],
        },
        repeats,
    )
    b, n = med["base"], med["now"]
    mib = sum(t.numel() * t.element_size() for t, _, _ in items) / 2**20
    print(
        f"digest_many of a step's hook lists ({len(items)} tensors, {mib:.1f} MiB), CPU time, median of "
        f"{repeats}: {rev} {b * 1e3:.1f} ms, this checkout {n * 1e3:.1f} ms: {n / b:.3f}x"
    )
    print(
        "  "
        + agreement(
            [base.digest_many(lst) for _, lst in lists], [now.digest_many(lst) for _, lst in lists]
        )
    )


def agreement(then: list, now: list) -> str:
    """What two revisions' records of the same tensors share: digests, and how far sums, norms and
    sketches moved (relative to norm, and to norm * sqrt(numel): the scale tolerance.py's roundings are
    relative to)."""
    a = [d for lst in then for d in lst]
    b = [d for lst in now for d in lst]
    same = sum(x["digest"] == y["digest"] for x, y in zip(a, b))
    rel = {"sum": 0.0, "norm": 0.0, "sketch": 0.0}
    equal = dict.fromkeys(rel, 0)
    for x, y in zip(a, b):
        scale = (x["norm"] or 0.0) * max(x["numel"], 1) ** 0.5
        for k in rel:
            u, v = x[k], y[k]
            if u == v:
                equal[k] += 1
            elif u is not None and v is not None and scale:
                d = max(abs(p - q) for p, q in zip(u, v)) if k == "sketch" else abs(u - v)
                rel[k] = max(rel[k], d / (x["norm"] if k == "norm" else scale))
    return (
        f"{same} of {len(a)} digests identical; identical sums {equal['sum']}, norms {equal['norm']}, "
        f"sketches {equal['sketch']}; largest change: sum {rel['sum']:.2e} of norm*sqrt(numel), norm "
        f"{rel['norm']:.2e} of the norm, sketch {rel['sketch']:.2e} of norm*sqrt(numel)"
    )


def own(sets: list[str], steps: int, warmup: int = 2) -> None:
    """The recorder's own CPU time per step in a real job, whole and in parts (`--own`)."""
    import onerank

    from disttrace.run.record import digest as D
    from disttrace.run.record.recorder import Recorder

    job = onerank.start([f"training.steps={steps}", *sets])
    spent = {"hooks": 0.0, "compiled": 0.0, "write": 0.0}

    def timed(key, fn):
        def f(*a, **k):
            t = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.thread_time() - t

        return f

    class Bus:  # what Recorder.attach sees: the job's bus, each handler timed
        def on(self, point, fn, order=50):
            job.bus.on(point, timed("hooks", fn), order)

    class Kernel:  # run/record/fused.py, its many_stats timed
        def __init__(self, module):
            self.module, self.many_stats = module, timed("compiled", module.many_stats)

        def __getattr__(self, name):
            return getattr(self.module, name)

    class Timed(Recorder):
        def _write(self, *a, **k):
            timed("write", super()._write)(*a, **k)

    rec = Timed(Path(tempfile.mkdtemp()), 0).attach(Bus())
    per = []
    for step in range(1, steps + 1):
        if step == 2 and D._fused() is not None:  # loaded by the first step's large tensors
            D._kernel = Kernel(D._kernel)
        spent.update(dict.fromkeys(spent, 0.0))
        job.step(step)
        if step > warmup:
            per.append(dict(spent))
    rec.close()
    onerank.stop()
    med = {k: statistics.median(p[k] for p in per) for k in spent}
    rest = statistics.median(p["hooks"] - p["compiled"] - p["write"] for p in per)
    print(
        f"the recorder's own CPU time a step, one rank in process, median of steps {warmup + 1}..{steps}: "
        f"{med['hooks'] * 1e3:.1f} ms; compiled call {med['compiled'] * 1e3:.1f}, write "
        f"{med['write'] * 1e3:.1f}, rest {rest * 1e3:.1f} ms"
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--set", action="append", default=[], help="override the model")
    ap.add_argument(
        "--against", default=None, help="a git revision whose run/record/digest.py to time too"
    )
    ap.add_argument(
        "--own", type=int, default=0, metavar="STEPS", help="the recorder's own time in a real job"
    )
    args = ap.parse_args()
    if args.own:
        own(REALISTIC + args.set, args.own)
        return
    lists, last, params, mm = capture(REALISTIC + args.set)
    if args.against:
        against(args.against, lists, args.repeats)
        return
    rows = breakdown(lists, args.repeats)
    w = write_cost(last, args.repeats)
    cols = ("whole", "whole, numpy", "read (xxh3)", "+ sum", "+ squares", "+ sketch", "rest")
    print(
        f"dim {mm['dim']}, {mm['n_layers']} layers, seq {mm['max_seq_len']}, accumulation 2, DDP (world 1), "
        f"one step's hook lists; CPU ms, median of {args.repeats}; parameters {params / 2**20:.1f} MiB"
    )
    print(f"  {'kind':22s} {'tensors':>7s} {'MiB':>7s} " + " ".join(f"{c:>11s}" for c in cols))
    total = dict.fromkeys(cols, 0.0)
    nt = nb = 0
    for kind, r in rows.items():
        nt += r["tensors"]
        nb += r["bytes"]
        for c in cols:
            total[c] += r[c]
        print(
            f"  {kind:22s} {r['tensors']:7d} {r['bytes'] / 2**20:7.1f} "
            + " ".join(f"{r[c] * 1e3:11.1f}" for c in cols)
        )
    print(
        f"  {'all':22s} {nt:7d} {nb / 2**20:7.1f} "
        + " ".join(f"{total[c] * 1e3:11.1f}" for c in cols)
    )
    print(
        "  share of the numpy path:        "
        + " ".join(f"{total[c] / total['whole, numpy']:11.1%}" for c in cols)
    )
    print(
        f"  the step's write ({w['records']} records: sort, Arrow encode, write, index line): "
        f"{w['write'] * 1e3:.2f} ms"
    )


if __name__ == "__main__":
    main()
