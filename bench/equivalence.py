"""The same experiment under every strategy, compared in numeric mode against dp=1 (same global batch of
16 sequences, seed, data order), with the derived bound; plus step time and memory per strategy next to
the plan's prediction. Staleness 1 must differ (another algorithm). Prints one table.

    python bench/equivalence.py [--steps 4] [--world4]
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

from disttrace.analysis.diff import diff_runs  # noqa: E402
from disttrace.store.jsonlines import iter_jsonl  # noqa: E402
from disttrace.store.rundir import Run  # noqa: E402

B = ["training.micro_batch_size=4"]
MATRIX = {
    "dp=1 (baseline)": ["parallelism.dp=1", "training.grad_accum_steps=4"],
    "dp=2": ["parallelism.dp=2", "training.grad_accum_steps=2"],
    "dp=2 no accumulation": [
        "parallelism.dp=2",
        "training.micro_batch_size=8",
        "training.grad_accum_steps=1",
    ],
    "ZeRO-1": ["parallelism.zero_stage=1"],
    "ZeRO-2": ["parallelism.zero_stage=2"],
    "ZeRO-3": ["parallelism.zero_stage=3"],
    "tp=2": ["parallelism.dp=1", "parallelism.tp=2", "training.grad_accum_steps=4"],
    "pp=2 gpipe": ["parallelism.dp=1", "parallelism.pp=2", "training.grad_accum_steps=4"],
    "pp=2 1f1b": [
        "parallelism.dp=1",
        "parallelism.pp=2",
        'parallelism.pp_schedule="1f1b"',
        "training.grad_accum_steps=4",
    ],
    "parameter server k=0": ['parallelism.architecture="parameter-server"'],
    "parameter server k=1": [
        'parallelism.architecture="parameter-server"',
        "parallelism.staleness=1",
    ],
}
WORLD4 = {
    "dp=4": ["parallelism.dp=4", "training.grad_accum_steps=1"],
    "ZeRO-3 dp=4": ["parallelism.dp=4", "training.grad_accum_steps=1", "parallelism.zero_stage=3"],
    "dp=2 x tp=2": ["parallelism.dp=2", "parallelism.tp=2", "training.grad_accum_steps=2"],
}


def run(out: Path, sets: list[str], steps: int) -> Path:
    args = [a for s in [*B, f"training.steps={steps}", *sets] for a in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace", "run", "manifests/default.toml", *args, "--out", out],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode:
        raise SystemExit(f"run failed ({sets}):\n{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def step_ms(run_dir: Path) -> float:
    times = [e.time["end"] - e.time["start"] for e in Run(run_dir).step_index(0).records[1:]]
    return statistics.median(times) * 1e3 if times else float("nan")


def memory(run_dir: Path) -> tuple[int, int, int]:
    last = list(iter_jsonl(Run(run_dir).rank_path("memory", 0)))[-1]
    return last["model_state"], last["predicted"]["total"], last["peak_tracked"]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--world4", action="store_true", help="also world size 4 (dp=4, ZeRO-3 dp=4, dp2 x tp2)"
    )
    args = ap.parse_args()
    matrix = {**MATRIX, **(WORLD4 if args.world4 else {})}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        base = run(out, matrix.pop("dp=1 (baseline)"), args.steps)
        print(
            f"{'strategy':24} {'world':>5} {'equal':>6} {'max rel err':>11} {'bound':>9} {'step ms':>8} "
            f"{'model state B':>13} {'predicted B':>11} {'peak B':>9}"
        )
        ms, pred, peak = memory(base)
        print(
            f"{'dp=1 (baseline)':24} {1:>5} {'-':>6} {'-':>11} {'-':>9} {step_ms(base):>8.1f} {ms:>13} {pred:>11} {peak:>9}"
        )
        for name, sets in matrix.items():
            r = run(out, sets, args.steps)
            d = diff_runs(base, r, mode="numeric")
            by = d.get("numeric", {}).get("by_phase", {})
            worst = max(by.values(), key=lambda v: v.get("max_rel_err") or 0, default={})
            err = worst.get("max_rel_err", 0.0) or 0.0
            bound = worst.get("bound")
            if d["first_divergence"]:
                err, bound = d["first_divergence"]["rel_err"], d["first_divergence"]["bound"]
            ms, pred, peak = memory(r)
            print(
                f"{name:24} {Run(r).world_size:>5} {str(d['equal']):>6} {err or 0:>11.2e} "
                f"{bound if bound is not None else float('nan'):>9.2e} {step_ms(r):>8.1f} {ms:>13} {pred:>11} {peak:>9}",
                flush=True,
            )


if __name__ == "__main__":
    main()
