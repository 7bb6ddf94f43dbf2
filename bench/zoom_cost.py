"""What a zoom costs (docs/zoom.md): the depth jobs it runs against one ordinary step, the memory of the step
recorded at depth, and the depth records written, at module and at op depth; and that every other step of a
depth job runs as an ordinary one (depth recording installs its hooks for its one step only).

    python bench/zoom_cost.py [--step 4] [--set model.dim=768 ...] [--tiny]

By default the realistic CPU model of bench/overhead.py (dim 512, 4 layers, sequence 256, dp = 2, gradient
accumulation 2). One ordinary run of `step` steps is the baseline; each depth job is what `zoom` runs for one
side (the frozen manifest again from its start with record.depth set, stopping after the step: lab/zoom.py's
`deep_run`), so a zoom of two runs costs two of them. All jobs are real gloo worlds launched the way
`disttrace run` launches them, one after the other on the same machine.

Printed per job: its wall time (launch to COMPLETE) and that over the ordinary run's median step; the step
recorded at depth over the ordinary median step; the other steps' median over the ordinary median (1.0: depth
off costs nothing); rank 0's resident memory at the step (the memory ledger's `resident`) against the
ordinary run's at the same step; the depth records and bytes written (all ranks).
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


def _steps(run: Path) -> dict[int, float]:
    from disttrace.store.jsonlines import iter_jsonl

    return {
        int(r["step"]): float(r["seconds"]) for r in iter_jsonl(run / "steps" / "rank-00000.jsonl")
    }


def _resident(run: Path, step: int) -> float | None:
    from disttrace.store.jsonlines import iter_jsonl

    for r in iter_jsonl(run / "memory" / "rank-00000.jsonl"):
        if r.get("step") == step:
            return r.get("resident")
    return None


def _depth_files(run: Path) -> tuple[int, int]:
    files = sorted((run / "depth").glob("rank-*.jsonl"))
    return sum(len(f.read_bytes().splitlines()) for f in files), sum(
        f.stat().st_size for f in files
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--step", type=int, default=4, help="the step zoomed into (the runs stop after it)"
    )
    ap.add_argument("--set", action="append", default=[], help="manifest override (repeatable)")
    ap.add_argument("--tiny", action="store_true", help="the default manifest's tiny model instead")
    args = ap.parse_args()

    from disttrace.config.freezing import freeze
    from disttrace.lab.zoom import deep_run
    from disttrace.run.job.launch import launch, prepare

    sets = ([] if args.tiny else REALISTIC) + args.set
    sets += [f"training.steps={args.step}", "checkpoint.interval=0"]
    out = Path(tempfile.mkdtemp(prefix="zoom-cost-"))
    frozen = freeze(None, sets)
    run = prepare(frozen, out, "reference")
    t0 = time.perf_counter()
    launch(run)
    base_wall = time.perf_counter() - t0
    base = _steps(run)
    ordinary = statistics.median(base[s] for s in base if s > 1)  # step 1: DDP's bucket rebuild
    print(f"model: {' '.join(sets)}")
    print(
        f"ordinary run: {args.step} steps in {base_wall:.1f} s; median step {ordinary:.3f} s (steps 2..)"
    )
    print()
    head = (
        f"{'job':<14} {'wall s':>7} {'/ step':>7} {'deep step s':>11} {'/ step':>7} "
        f"{'others / step':>13} {'resident MB':>12} {'vs ordinary':>11} {'records':>8} {'bytes':>10}"
    )
    print(head)
    print("-" * len(head))
    rss0 = _resident(run, args.step)
    for level in ("module", "op"):
        t0 = time.perf_counter()
        deep = deep_run(run, args.step, level)
        wall = time.perf_counter() - t0
        st = _steps(deep)
        others = [st[s] for s in st if 1 < s < args.step]
        rss = _resident(deep, args.step)
        n, nbytes = _depth_files(deep)
        print(
            f"{level + ' depth':<14} {wall:>7.1f} {wall / ordinary:>7.1f} {st[args.step]:>11.3f} "
            f"{st[args.step] / ordinary:>7.1f} "
            f"{(statistics.median(others) / ordinary if others else float('nan')):>13.2f} "
            f"{(rss or 0) / 2**20:>12.1f} {((rss or 0) / rss0 if rss0 else float('nan')):>11.2f} "
            f"{n:>8} {nbytes:>10}"
        )
    print()
    print(
        "a zoom of two runs runs two depth jobs (one a side) and compares their records; "
        f"the ordinary run's resident memory at step {args.step}: {(rss0 or 0) / 2**20:.1f} MB"
    )
    print(f"run stores under {out}")


if __name__ == "__main__":
    main()
