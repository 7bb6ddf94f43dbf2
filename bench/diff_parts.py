"""Where a numeric diff's CPU goes, by function: `diff_runs(A, B, mode="numeric")` in process, each of the
functions below wrapped to add up its own `time.process_time` (nested ones count inside their callers too),
the best of --repeat passes (docs/benchmarks.md, "The magnitudes as columns").

    .venv/bin/python bench/diff_parts.py RUN_A RUN_B [--repeat 3]
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

from disttrace.analysis import block_summary, magnitudes
from disttrace.analysis.diff import diff_runs, logical, prepare, shards, side, tol, window

# (module or class, function names, modules that imported the function by name)
WATCHED = [
    (window, ["compare_logical_steps", "_compare_columns"], [prepare]),
    (window._Read, ["__init__", "take"], []),
    (logical, ["_compare_whole_columns", "_losses"], [window]),
    (shards, ["_compare_sharded_columns", "_unit_batches", "_warn_columns"], [window]),
    (block_summary, ["summarize"], []),
    (magnitudes, ["lookup"], []),
    (tol._Tol, ["row_magnitudes"], []),
    (shards._Values, ["__init__", "values"], []),
    (side.Side, ["batches"], []),
    (magnitudes.Magnitudes, ["__init__"], []),
]


def watch(acc: Counter) -> None:
    for owner, names, importers in WATCHED:
        for name in names:
            f = getattr(owner, name)
            label = f"{getattr(owner, '__name__', owner).split('.')[-1]}.{name}"

            def timed(*a, _f=f, _label=label, **k):
                t = time.process_time()
                try:
                    return _f(*a, **k)
                finally:
                    acc[_label] += time.process_time() - t

            setattr(owner, name, timed)
            for m in importers:
                if getattr(m, name, None) is f:
                    setattr(m, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    acc: Counter = Counter()
    watch(acc)
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        acc.clear()
        t = time.process_time()
        diff_runs(args.a, args.b, mode="numeric").to_dict()
        acc["diff_runs (all)"] = time.process_time() - t
        for k, v in acc.items():
            best[k] = min(best.get(k, float("inf")), v)
    for k, v in sorted(best.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v:.3f} s")


if __name__ == "__main__":
    main()
