"""What recording costs through the CLI, the way users run it: `disttrace run manifests/default.toml` as it records
by default against the same run with `--set record.enabled=false`, each a fresh job of its own (dp=2 on this
host's launcher), rounds alternating the order of the variants so that a drift of the machine hits all alike.
A run's step time is the median of its ranks' step clocks (`steps/rank-N.jsonl`, kept whether the run records
or not), the first step left out (start-up: the digests' compiled pass, the allocator's first touch); a
variant's figure is the median over its rounds, and each is printed as a ratio against the unrecorded run.

Workload (docs/benchmarks.md, "Recording cost"): the default manifest at dim 512, 4 layers, sequence 256,
gradient accumulation 2, --steps steps, no checkpoints. Variants: `off` (record.enabled=false), `default`
(what `run` records with no --set), `no updates` (record.updates=false: no copy of the parameters, no update
records). Take it on an otherwise idle machine: the figure is a wall-clock ratio.

    python bench/run_overhead.py [--rounds 3] [--steps 10] [--set model.dim=768 ...] [--dir D]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrace.store.rundir import Run  # noqa: E402

WORKLOAD = [
    "model.dim=512",
    "model.n_layers=4",
    "model.max_seq_len=256",
    "training.grad_accum_steps=2",
    "checkpoint.interval=0",
]
VARIANTS = {
    "off": ["record.enabled=false"],
    "default": [],
    "no updates": ["record.updates=false"],
}


def run_once(out: Path, sets: list[str]) -> float:
    """One `disttrace run` through the CLI; the median step time of its ranks, first step left out."""
    cmd = [sys.executable, "-m", "disttrace", "run", "manifests/default.toml", "--out", str(out)]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(
            f"run_overhead: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}"
        )
    (path,) = [p.parent for p in out.glob("*/reference/COMPLETE")]
    run = Run(path)
    secs = [
        e["seconds"]
        for rank in run.ranks("steps")
        for e in run.step_times(rank).records
        if e["step"] > 1 and isinstance(e.get("seconds"), float)
    ]
    if not secs:
        sys.exit(f"run_overhead: {path} holds no step times after the first")
    return statistics.median(secs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], help="another manifest override")
    ap.add_argument("--dir", default=None, help="where the runs go (a temporary folder otherwise)")
    args = ap.parse_args()
    base = Path(args.dir or tempfile.mkdtemp(prefix="run-overhead-"))
    sets = [*WORKLOAD, f"training.steps={args.steps}", *args.set]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        order = list(VARIANTS) if r % 2 == 0 else list(reversed(VARIANTS))
        for v in order:
            out = base / f"round-{r}-{v.replace(' ', '-')}"
            times[v].append(run_once(out, [*sets, *VARIANTS[v]]))
            print(f"round {r + 1}/{args.rounds} {v:<10} {times[v][-1]:.3f} s a step", flush=True)
    off = statistics.median(times["off"])
    print(
        f"workload: manifests/default.toml --set {' --set '.join(sets)} (dp=2), {args.rounds} rounds"
    )
    for v, ts in times.items():
        med = statistics.median(ts)
        print(f"  {v:<10} median step {med:.3f} s  ({med / off:.3f}x off)")


if __name__ == "__main__":
    main()
