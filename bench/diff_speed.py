"""diff throughput: records per second to the first divergence on a large trajectory (docs/design.md; figures in docs/benchmarks.md).

Writes synthetic run stores (default 2 ranks x 500 steps x 1000 records = 1,000,000 records each) in the
recorder's format (bench/synthetic.py: store/trajectory_write.py's writer, an Arrow stream per rank + step index with
byte offsets, digest of digests and the chained sha256 of each step's bytes, COMPLETE's seal): a reference, a fault run identical except one record's
digest (bits changed, statistics equal) near the end, a noisy run, and a run of another topology (half the
ranks, twice the accumulation). Then, each in a fresh process:

  index   diff_runs(a, b, propagate=False): equal steps are skipped on the step index's digests (their raw
          bytes hashed, xxh3-128, against the index: no parsing); only the divergent step is read (by seeking
          to its byte range)
  scan    diff_runs(a, b, use_index=False, propagate=False): the step index is ignored; the trajectory
          files are scanned for step boundaries and every record up to the divergence is parsed and
          compared (the baseline: what diff would cost without the index)
  full    diff_runs(a, b): index mode plus propagation over every later step (what `disttrace diff` runs)
  numeric diff_runs(a, noisy, mode="numeric"): a third run whose every value is rounded differently (~1e-12
          relative, every digest different): every record of both runs is read and held to the derived bound
  cross   diff_runs(a, half): across topologies (numeric): every record read, the reduced gradients and the
          optimizer state compared as logical tensors, each of `half`'s copies against the reference's

and prints wall seconds, records/second (records of both runs up to and including the divergent step,
divided by the wall time), peak RSS of the child (ru_maxrss) and the peak of Python allocations
(tracemalloc, measured in a separate untimed pass); for the numeric diff also the CPU time of the main thread
(comparing) and of the read-ahead's threads (reading, hash-checking and decoding the blocks): on a free
machine the wall time is about the larger of the main thread's and the reading's divided by its threads.

    .venv/bin/python bench/diff_speed.py [--ranks 2] [--steps 500] [--records 1000] [--plant-step 490] [--layout 1|2]
        [--modes numeric,...] [--repeat N] [--against OTHER_CHECKOUT] [--dir D]

With --against, each diff also runs with another checkout's disttrace (the same child code, the same stores,
interleaved), its figures and the speed ratio printed by wall time and by CPU time, and the results must be
the same. The CPU time is the figure to compare on a machine other work shares.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
# whose disttrace this process imports: the checkout the script lies in, or (a child measuring --against)
# another checkout's
sys.path.insert(0, os.environ.get("DISTTRACE_BENCH_CODE") or str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

import synthetic  # noqa: E402


def step_records(step: int, rank: int, n: int) -> list[dict]:
    """n records of one rank and step as the recorder hands them to its writer (bench/synthetic.py)."""
    return synthetic.Layout(n).records(step, rank)


def write_runs(
    root: Path, ranks: int, steps: int, n: int, plant: tuple[int, int, int], magnitudes=False
):
    """Four run dirs in the recorder's format (bench/synthetic.py: the writer, each step's index line
    sealed, COMPLETE with the seal): `reference`, `fault` (equal but one record's digest, one bit),
    `noisy` (every value rounded differently) and `half` (noisy's first half of the ranks as another
    topology: half the data-parallel ranks, twice the accumulation, the same global batch)."""
    p_step, p_rank, p_pos = plant
    half = max(1, ranks // 2)
    dirs = {k: root / k for k in ("reference", "fault", "noisy", "half")}
    m = synthetic.manifest(ranks, steps, name="bench")
    for k in ("reference", "noisy"):
        synthetic.write_shared(dirs[k], m, replicas=False)
    fault = {"name": "bench", "step": p_step, "rank": p_rank}
    synthetic.write_shared(dirs["fault"], m, "fault", fault, replicas=False)
    mh = synthetic.manifest(half, steps, ranks // half, name="bench")
    synthetic.write_shared(dirs["half"], mh, replicas=False)
    variants = [
        synthetic.Variant(str(dirs["reference"]), scales=magnitudes),
        synthetic.Variant(
            str(dirs["fault"]), flip=(p_step, p_pos), flip_rank=p_rank, scales=magnitudes
        ),
        synthetic.Variant(str(dirs["noisy"]), noisy=True, scales=magnitudes),
        synthetic.Variant(
            str(dirs["half"]), noisy=True, ranks=tuple(range(half)), scales=magnitudes
        ),
    ]
    parts = synthetic.write_ranks(variants, ranks, steps, n)
    for k, p in zip(dirs, parts):
        synthetic.complete(dirs[k], p)
    return dirs, tuple(synthetic.planted(n, p_step, p_rank, p_pos))


def _time_reads():
    """Wrap the diff's read job (a rank's block of steps read, hash-checked and decoded) to add up the CPU time
    of the threads it runs in: {True: in a read-ahead thread, False: in the main thread}."""
    import threading

    from disttrace.analysis.diff import blocks

    spent, lock, job = {True: 0.0, False: 0.0}, threading.Lock(), blocks._read_rank

    def timed(*args, **kw):
        t0 = time.thread_time()
        try:
            return job(*args, **kw)
        finally:
            ahead = threading.current_thread() is not threading.main_thread()
            with lock:
                spent[ahead] += time.thread_time() - t0

    blocks._read_rank = timed
    return spent


def child(a: str, b: str, mode: str, trace: bool) -> None:
    """Run one diff in this (fresh) process and print one JSON line."""
    from disttrace.analysis.diff import diff_runs

    reads = _time_reads()

    kw = {
        "index": dict(propagate=False),
        "scan": dict(use_index=False, propagate=False),
        "full": {},
        "numeric": dict(mode="numeric"),
        "cross": {},
    }[mode]
    if trace:
        import tracemalloc

        tracemalloc.start()
    t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    r = diff_runs(a, b, **kw).to_dict()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {
        "seconds": dt,
        "cpu_seconds": cpu,
        # by thread: the main one (comparing, and reading where nothing reads ahead) and the read-ahead's
        "main_cpu_seconds": time.thread_time() - m0,
        "read_ahead_cpu_seconds": reads[True],
        "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "first_divergence": r["first_divergence"],
        "steps_read": r["stats"]["steps_read"],
        "records_read": r["records_read"]["a"] + r["records_read"]["b"],
        "equal": r["equal"],
        "tensors_compared": r["stats"]["tensors_compared"],
    }
    if trace:
        out["traced_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
    print(json.dumps(out))


def run_child(a: Path, b: Path, mode: str, trace: bool = False, code: Path | None = None) -> dict:
    """One diff in a fresh process (this script's child); `code`: the checkout whose disttrace it imports."""
    env = dict(os.environ)
    if code is not None:
        env["DISTTRACE_BENCH_CODE"] = str(code)
    p = subprocess.run(
        [sys.executable, __file__, "--child", mode, str(a), str(b)]
        + (["--trace"] if trace else []),
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env=env,
    )
    return json.loads(p.stdout.strip().splitlines()[-1])


def measure(a: Path, b: Path, mode: str, repeat: int, against: Path | None):
    """The run of median wall time of `repeat` fresh processes, and with --against the same of the other
    checkout's code, the two interleaved (a machine shared with other work loads both alike)."""
    ours, theirs = [], []
    for _ in range(repeat):
        ours.append(run_child(a, b, mode))
        if against is not None:
            theirs.append(run_child(a, b, mode, code=against))
    median = lambda rs: sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]  # noqa: E731
    cpu = lambda rs: sorted(r["cpu_seconds"] for r in rs)[len(rs) // 2]  # noqa: E731
    # the median CPU time over the repeats: the CPU time of the run of median wall time alone varies by
    # ~10% on a shared machine
    out = [median(rs) | {"cpu_median": cpu(rs)} if rs else None for rs in (ours, theirs)]
    return out[0], out[1]


def _versus(mode: str, r: dict, base: dict | None, against: Path | None) -> None:
    if base is None:
        return
    print(
        f"{'':>7}  against {against}: {base['seconds']:7.3f} s wall, {base['cpu_seconds']:.3f} s CPU; "
        f"this code {base['seconds'] / r['seconds']:.2f}x its speed by wall time, "
        f"{base['cpu_seconds'] / r['cpu_seconds']:.2f}x by CPU time; median CPU over the repeats "
        f"{base['cpu_median']:.3f} s against {r['cpu_median']:.3f} s: "
        f"{base['cpu_median'] / r['cpu_median']:.2f}x; "
        f"its CPU by thread: main {base['main_cpu_seconds']:.3f} s, reading ahead "
        f"{base['read_ahead_cpu_seconds']:.3f} s"
    )
    for k in ("first_divergence", "equal", "records_read", "steps_read", "tensors_compared"):
        assert r[k] == base[k], f"{mode}: {k} differs from {against}'s: {r[k]} vs {base[k]}"


MODES = ("index", "scan", "full", "numeric", "cross")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--records", type=int, default=1000, help="records per rank and step")
    ap.add_argument("--plant-step", type=int, default=None, help="default: steps - 10")
    ap.add_argument(
        "--dir",
        default=None,
        help="where to write the runs (default: a temporary directory); runs this script wrote there "
        "with the same arguments are used again",
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--layout",
        type=int,
        choices=(1, 2),
        default=None,
        help="write the stores in this trajectory layout (default: what the recorder writes now); "
        "readers take either, so two runs of the bench are an A/B of the layouts",
    )
    ap.add_argument(
        "--magnitudes",
        action="store_true",
        help="also write the gradient magnitudes (run/record/scales.py) the numeric bound reads",
    )
    ap.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"which diffs to measure, comma-separated (default: {','.join(MODES)})",
    )
    ap.add_argument(
        "--repeat", type=int, default=1, help="fresh processes per diff; the median is reported"
    )
    ap.add_argument(
        "--against",
        type=Path,
        default=None,
        help="another checkout of disttrace (e.g. `git worktree add /tmp/base main`): each diff also "
        "runs with its code, interleaved with this code's runs on the same stores, and the speed ratio "
        "is printed, by wall and by CPU time (the fair one on a shared machine); results must agree",
    )
    ap.add_argument("--child", nargs=3, metavar=("MODE", "A", "B"), help=argparse.SUPPRESS)
    ap.add_argument("--trace", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[1], args.child[2], args.child[0], args.trace)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        ap.error(f"--modes: unknown {sorted(unknown)}")
    against = args.against.resolve() if args.against else None

    if args.layout is not None:
        from disttrace.store import trajectory_write

        trajectory_write.VERSION = args.layout  # what a new stream is written in
    plant_step = args.plant_step or max(1, args.steps - 10)
    plant = (plant_step, args.ranks - 1, args.records // 2)
    root = Path(args.dir or tempfile.mkdtemp(prefix="disttrace-bench-"))
    params = {
        "ranks": args.ranks,
        "steps": args.steps,
        "records": args.records,
        "plant": plant,
        "magnitudes": args.magnitudes,
        "layout": args.layout,
    }
    written = root / "bench.json"
    try:
        t0 = time.perf_counter()
        if written.is_file() and orjson.loads(written.read_bytes())["params"] == orjson.loads(
            orjson.dumps(params)
        ):
            planted = tuple(orjson.loads(written.read_bytes())["planted"])
            dirs = {k: root / k for k in ("reference", "fault", "noisy", "half")}
            how = "the runs written before in"
        else:
            dirs, planted = write_runs(
                root, args.ranks, args.steps, args.records, plant, args.magnitudes
            )
            written.write_bytes(orjson.dumps({"params": params, "planted": planted}))
            how = "wrote"
        a, b = dirs["reference"], dirs["fault"]
        size = sum(p.stat().st_size for p in (a / "trajectory").glob("*.arrows"))
        n_run = args.ranks * args.steps * args.records
        print(
            f"{how} 4 runs x {n_run:,} records ({size / 2**20:.0f} MiB each, {size / n_run:.1f} bytes per "
            f"record) in {time.perf_counter() - t0:.1f} s; planted: step {planted[0]} rank {planted[1]} "
            f"{planted[2]} index {planted[3]}"
        )
        print(
            f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f} (1, 5, 15 min)"
        )
        base = subprocess.run(
            [
                sys.executable,
                "-c",
                "import resource, disttrace.analysis.diff; "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)",
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
        )
        print(
            f"a fresh process importing disttrace.analysis.diff: {float(base.stdout):.0f} MiB RSS"
        )
        covered = (
            2 * args.ranks * plant_step * args.records
        )  # both runs, every rank, steps 1..divergent
        results = {}
        for mode in [m for m in ("index", "scan", "full") if m in modes]:
            r, vs = measure(a, b, mode, args.repeat, against)
            r["traced_peak_mib"] = run_child(a, b, mode, trace=True)["traced_peak_mib"]
            results[mode] = r
            f = r["first_divergence"]
            print(
                f"{mode:>7}: {r['seconds']:7.3f} s  {covered / r['seconds']:>14,.0f} records/s  steps read "
                f"{r['steps_read']:>5}  peak RSS {r['maxrss_mib']:6.0f} MiB  traced peak {r['traced_peak_mib']:7.1f} MiB"
                f"  -> step {f['step']} rank {f['rank']} {f['phase']} index {f['index']}"
            )
            _versus(mode, r, vs, against)
            assert (f["step"], f["rank"], f["phase"], f["index"]) == tuple(planted), (
                f"wrong divergence {f}"
            )
        if "scan" in results and "index" in results:
            ratio = results["scan"]["seconds"] / results["index"]["seconds"]
            print(
                f"index vs scan: {ratio:,.0f}x faster to the first divergence "
                f"({'meets' if results['index']['seconds'] < 2 else 'MISSES'} the 2 s target)"
            )
        # numeric: every record of both runs read and held to the derived bound (what a cross-topology or
        # rounding-level comparison costs); the records are within it, so the runs compare equal
        if "numeric" in modes:
            r, vs = measure(a, dirs["noisy"], "numeric", args.repeat, against)
            r["traced_peak_mib"] = run_child(a, dirs["noisy"], "numeric", trace=True)[
                "traced_peak_mib"
            ]
            assert r["equal"] and r["records_read"] == 2 * n_run, r
            results["numeric"] = r
            print(
                f"numeric: {r['seconds']:7.3f} s  {r['records_read'] / r['seconds']:>14,.0f} records/s read and "
                f"compared ({r['records_read']:,} records, every one inexact)  peak RSS {r['maxrss_mib']:6.0f} MiB  "
                f"traced peak {r['traced_peak_mib']:7.1f} MiB; {r['records_read'] / r['cpu_seconds']:,.0f} "
                f"records per CPU second; CPU by thread: main {r['main_cpu_seconds']:.3f} s, reading ahead "
                f"{r['read_ahead_cpu_seconds']:.3f} s"
            )
            _versus("numeric", r, vs, against)
        # across topologies: the reduced gradients and optimizer state of every rank of `half` against the
        # reference's (the logical tensors; per-micro-batch phases differ by design and are not compared)
        if "cross" in modes:
            r, vs = measure(a, dirs["half"], "cross", args.repeat, against)
            assert r["equal"], r
            results["cross"] = r
            print(
                f"  cross: {r['seconds']:7.3f} s  {r['records_read'] / r['seconds']:>14,.0f} records/s read, "
                f"{r['tensors_compared'] / r['seconds']:,.0f} logical tensors/s compared ({r['records_read']:,} records "
                f"read, {r['tensors_compared']:,} compared)  peak RSS {r['maxrss_mib']:6.0f} MiB"
            )
            _versus("cross", r, vs, against)
        if (
            args.magnitudes
        ):  # the same stores without them, in the same run: what reading them costs
            hidden = []
            for d in (a, dirs["noisy"], dirs["half"]):
                for f in (d / "trajectory").glob("*.scales.*"):
                    hidden.append((f, f.with_suffix(".hidden")))
                    f.rename(hidden[-1][1])
            try:
                for mode, other in (("numeric", dirs["noisy"]), ("cross", dirs["half"])):
                    if mode not in results:
                        continue
                    n = run_child(a, other, mode)
                    ratio = n["seconds"] / results[mode]["seconds"]
                    print(
                        f"{mode:>7} without magnitudes: {n['seconds']:7.3f} s  "
                        f"{n['records_read'] / n['seconds']:>14,.0f} records/s; with them "
                        f"{ratio:.2f}x the speed of without"
                    )
            finally:
                for f, h in hidden:
                    h.rename(f)
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(root, ignore_errors=True)
        elif args.keep:
            print(f"kept {root}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    main()
