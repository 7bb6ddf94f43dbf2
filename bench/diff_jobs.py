"""diff --jobs N against one process, on the same stores (docs/scale.md).

Writes synthetic run stores with the recorder's own writer (bench/diff_speed.py's `write_runs`: a
reference, a fault run with one bit changed late, a noisy run whose every value is rounded differently,
and a run of another topology), then runs each comparison in fresh processes, one process and `--jobs N`
alternately (`--repeat` times each, medians), through the CLI (`disttrace diff A B --json`) as a user
would, and prints the wall times, their ratio and whether the two `--json` documents are byte-identical:

  full     bitwise to the planted divergence, then propagation over every later step (ranks split)
  numeric  every record of both runs read and held to the derived bound (ranks split)
  cross    across topologies: logical tensors of every rank (steps split)

It also prints the machine's load average before and after: on a shared machine the ratio is only as
good as the cores the processes actually got. So, in another fresh process, it accounts the CPU time (not
the wall time, which the load stretches) of the same comparison done in one piece and done as its N
shares one after the other (what each process of `--jobs N` computes), and of combining the shares:
the largest share's CPU against the whole's is what `--jobs N` can gain on N free cores, less the
start of the process pool (a fresh interpreter importing the readers).

    python bench/diff_jobs.py [--jobs 2] [--ranks 8] [--steps 200] [--records 500] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from diff_speed import write_runs  # noqa: E402


def run_cli(a: Path, b: Path, extra: list[str]) -> tuple[float, str, int, float]:
    """(wall seconds, stdout, exit code, peak RSS in MiB of the largest of the command's processes)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(
            [sys.executable, "-m", "disttrace", "diff", str(a), str(b), "--json", *extra],
            stdout=out,
            stderr=err,
            cwd=ROOT,
        )
        _, status, usage = os.wait4(
            p.pid, 0
        )  # its own and its reaped descendants' (the workers) peak
        dt = time.perf_counter() - t0
        rc = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if rc not in (0, 1):
        raise SystemExit(f"diff {' '.join(extra)} failed ({rc}): {stderr[-500:]}")
    return dt, stdout, rc, usage.ru_maxrss / 1024


def cpu_child(name: str, a: str, b: str, jobs: int) -> None:
    """In this fresh process: CPU seconds of the whole comparison, of each share, of combining them."""
    from disttrace.analysis.diff import diff_runs
    from disttrace.analysis.diff.parallel.merge import _combine, _fold
    from disttrace.analysis.diff.parallel.share import _plan

    kw = {"mode": "numeric"} if name == "numeric" else {}
    c0 = time.process_time()
    whole = diff_runs(a, b, **kw).to_json()
    c1 = time.process_time()
    tasks = _plan(a, b, kw, jobs, None, None)
    shares = []
    for t in tasks:
        c = time.process_time()
        shares.append((t.payload(), time.process_time() - c))
    c2 = time.process_time()
    merged = _fold(_combine([p for p, _ in shares]), whole=True).to_json()
    c3 = time.process_time()
    print(
        json.dumps(
            {
                "whole": c1 - c0,
                "shares": [c for _, c in shares],
                "combine": c3 - c2,
                "same": merged == whole,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--records", type=int, default=500, help="records per rank and step")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="full,numeric,cross", help="which comparisons")
    ap.add_argument(
        "--dir", default=None, help="where to write the runs (default: a temporary one)"
    )
    ap.add_argument("--child-cpu", nargs=3, metavar=("NAME", "A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_cpu:
        cpu_child(*args.child_cpu, args.jobs)
        return
    root = Path(args.dir or tempfile.mkdtemp(prefix="disttrace-jobs-"))
    try:
        t0 = time.perf_counter()
        plant = (max(1, args.steps - 10), args.ranks - 1, args.records // 2)
        made = (
            root / "made.json"
        )  # --dir: runs written by an earlier call with the same sizes are reused
        sizes = [args.ranks, args.steps, args.records]
        if made.exists() and json.loads(made.read_text())["sizes"] == sizes:
            dirs = {k: root / k for k in ("reference", "fault", "noisy", "half")}
            planted = tuple(json.loads(made.read_text())["planted"])
        else:
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            dirs, planted = write_runs(root, args.ranks, args.steps, args.records, plant)
            made.write_text(json.dumps({"sizes": sizes, "planted": list(planted)}))
        n_run = args.ranks * args.steps * args.records
        print(
            f"4 runs x {n_run:,} records ({args.ranks} ranks x {args.steps} steps x "
            f"{args.records} records), written or reused in {time.perf_counter() - t0:.1f} s; planted: step "
            f"{planted[0]} rank {planted[1]}; {os.cpu_count()} CPUs, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        pairs = {
            "full": (dirs["reference"], dirs["fault"]),
            "numeric": (dirs["reference"], dirs["noisy"]),
            "cross": (dirs["reference"], dirs["half"]),
        }
        extra = {"full": [], "numeric": ["--mode", "numeric"], "cross": []}
        for name in args.only.split(","):
            a, b = pairs[name]
            one_t, many_t, rss1, rssn, same = [], [], [], [], True
            for _ in range(args.repeat):  # alternately, so a change of load hits both
                t, doc1, rc1, m = run_cli(a, b, extra[name])
                one_t.append(t)
                rss1.append(m)
                t, docn, rcn, m = run_cli(a, b, [*extra[name], "--jobs", str(args.jobs)])
                many_t.append(t)
                rssn.append(m)
                same = same and doc1 == docn and rc1 == rcn
            m1, mn = statistics.median(one_t), statistics.median(many_t)
            print(
                f"{name:>8}: one process {m1:6.2f} s, --jobs {args.jobs} {mn:6.2f} s: "
                f"{m1 / mn:4.2f}x  (runs {', '.join(f'{x:.2f}' for x in one_t)} | "
                f"{', '.join(f'{x:.2f}' for x in many_t)}); peak RSS of the largest process "
                f"{max(rss1):.0f} vs {max(rssn):.0f} MiB; --json identical: {same}",
                flush=True,
            )
            if not same:
                raise SystemExit(f"{name}: --jobs {args.jobs} printed another document")
            c = json.loads(
                subprocess.run(
                    [sys.executable, __file__, "--jobs", str(args.jobs), "--child-cpu", name]
                    + [str(a), str(b)],
                    capture_output=True,
                    text=True,
                    check=True,
                    cwd=ROOT,
                ).stdout.splitlines()[-1]
            )
            print(
                f"{'':>8}  CPU: whole {c['whole']:.2f} s; its {len(c['shares'])} shares "
                f"{' + '.join(f'{x:.2f}' for x in c['shares'])} s (sum {sum(c['shares']) / c['whole']:.2f}x "
                f"the whole, largest {max(c['shares']) / c['whole']:.2f}x); combining "
                f"{c['combine']:.3f} s; merged document identical: {c['same']}",
                flush=True,
            )
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
