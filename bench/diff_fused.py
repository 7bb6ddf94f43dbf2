"""The comparing side of a numeric diff alone: analysis/fused.py's compiled pass against the numpy path it replaces
(docs/benchmarks.md, "The comparison compiled").

Reads every rank-block of two stores once (what the read-ahead thread hands the comparison: decoded, as numpy
columns, aligned), then folds them all into per-step results (`_fold_columns`: the comparison, its per-step
summaries, the bounds and the fold) with each path in turn, alternating, in one process; prints each path's CPU
seconds (minimum and median of the passes), the ratio, and checks that both give the same results. Also the
one-off cost the compiled pass adds to a process: numba's import and the loading of the compiled pass from its
cache, measured in fresh processes.

    .venv/bin/python bench/diff_fused.py A B [--passes 3]

A, B: run stores of one topology, e.g. `reference` and `noisy` of `bench/diff_speed.py --dir D --keep`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrace.analysis import columnar  # noqa: E402
from disttrace.analysis.diff.blocks import BLOCK_ROWS, _Plan, _read_rank  # noqa: E402
from disttrace.analysis.diff.compare import _fold_columns, _RankStep  # noqa: E402
from disttrace.analysis.diff.prepare import _Setup  # noqa: E402


def _jobs(st: _Setup) -> list:
    """Every rank-block of the comparison, read and decoded as the read-ahead thread would."""
    plan, out, n = _Plan(st.steps, st.ranks, (st.side_a, st.side_b)), [], 0
    while n < len(st.steps):
        block = plan.block(n, BLOCK_ROWS)
        for r in st.ranks:
            _, todo, pair = _read_rank(r, block, st.side_a, st.side_b)
            if pair is None or not pair[4]:
                raise SystemExit(f"rank {r} steps {todo[0]}..: not an aligned block of Arrow steps")
            out.append((todo, r, pair))
        n += len(block)
    return out


def _fold_all(jobs, tol) -> list:
    results = []
    for todo, r, ((ba, starts), _, ca, cb, _) in jobs:
        out = [_RankStep(k) for k in np.diff(np.append(starts, ba.num_rows)).tolist()]
        _fold_columns(todo, r, ca, cb, starts, tol, out)
        results.append(
            [
                (
                    x.inexact,
                    x.differing,
                    x.hard,
                    x.max_rel,
                    x.max_rel_bound,
                    x.max_ratio,
                    x.ratio_by_phase,
                    None if x.first is None else x.first[0],
                )
                for x in out
            ]
        )
    return results


def _import_cost(passes: int) -> float:
    """The median CPU seconds a fresh process spends importing analysis/fused.py (numba, and its compiled
    pass loaded from the cache), after numpy and pyarrow."""
    code = (
        "import time, numpy, pyarrow, disttrace.analysis.tolerance\n"
        "t = time.process_time()\n"
        "import disttrace.analysis.fused\n"
        "print(time.process_time() - t)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    got = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
            ).stdout
        )
        for _ in range(passes)
    ]
    return sorted(got)[len(got) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--passes", type=int, default=3, help="passes of each path (alternating)")
    args = ap.parse_args()
    load = os.getloadavg()
    st = _Setup(args.a, args.b, "numeric", None, None, False, True, None, True)
    jobs = _jobs(st)
    pairs = sum(job[2][0][0].num_rows for job in jobs)
    # this bench measures the two paths whatever the diff's own threshold would choose
    columnar.FUSED_PAIRS = 0
    st.tol.fused = True
    times: dict[str, list[float]] = {"numpy": [], "compiled": []}
    results = {}
    for name in ("compiled", "numpy") + ("compiled", "numpy") * args.passes:
        os.environ["DISTTRACE_FUSED"] = "0" if name == "numpy" else "1"
        columnar._fused_module = None
        t = time.process_time()
        results[name] = _fold_all(jobs, st.tol)
        times[name].append(time.process_time() - t)
    for k in times:  # the first pass of each: imports and warm-up, not counted
        times[k] = times[k][1:]
    assert results["numpy"] == results["compiled"], "the two paths differ"
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(
        f"{len(jobs)} rank-blocks, {pairs:,} pairs of records; load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} (1, 5, 15 min)"
    )
    for k, v in times.items():
        print(
            f"{k:>9}: CPU min {min(v):.3f} s, median {med[k]:.3f} s "
            f"({med[k] / pairs * 1e6:.3f} us a pair)"
        )
    print(
        f"compiled / numpy: {med['numpy'] / med['compiled']:.2f}x fewer CPU seconds by medians; "
        "results the same"
    )
    cost = _import_cost(args.passes)
    saved = (med["numpy"] - med["compiled"]) / pairs
    print(
        f"one-off: importing analysis/fused.py (numba, the pass loaded from its cache) {cost:.3f} s of CPU "
        f"(median of {args.passes} fresh processes): earned back from ~{cost / saved:,.0f} pairs"
    )


if __name__ == "__main__":
    main()
