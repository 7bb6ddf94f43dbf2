"""The comparing side of a numeric diff alone: the compiled pass (disttrace/native/compare.c where built, and
analysis/fused.py's numba kernels) against the numpy path it replaces (docs/benchmarks.md, "The comparison
compiled").

Reads every rank-block of two stores once (what the read-ahead thread hands the comparison: decoded, as numpy
columns, aligned), then folds them all into per-step results (`_fold_columns`: the comparison, its per-step
summaries, the bounds and the fold) with each path in turn (C, numba, numpy; a path not installed is left
out), alternating, in one process; prints each path's CPU seconds (minimum and median of the passes), the
ratios, and checks that every path gives the same results. Also the one-off cost each compiled module adds to
a process: importing the C extension, and numba's import with the loading of its compiled pass from its
cache, measured in fresh processes.

    .venv/bin/python bench/diff_fused.py A B [--passes 3] [--block-rows N] [--sizes 1,16,150]
        [--against OTHER_CHECKOUT]

A, B: run stores of one topology, e.g. `reference` and `noisy` of `bench/diff_speed.py --dir D --keep`.
--block-rows: the rows a rank-block gathers (default: diff's BLOCK_ROWS; 1: one step a block, the smallest
blocks a diff compares). --sizes: also the CPU of folding one block of each of these row counts, per path
(minimum and median of 9 alternating passes): where the compiled pass starts to pay. With --against, also the comparison's set-up in fresh processes of this checkout's
and the other's code, alternating: reading and checking both sides' step indexes (`_Setup`) and planning the
blocks for the read-ahead and for the comparison; medians of CPU seconds and their ratio.
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


def _jobs(st: _Setup, rows: int) -> list:
    """Every rank-block of the comparison, read and decoded as the read-ahead thread would."""
    plan, out, n = _Plan(st.steps, st.ranks, (st.side_a, st.side_b)), [], 0
    while n < len(st.steps):
        block = plan.block(n, rows)
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


_IMPORTS = {
    "C": "import disttrace.native._compare",
    "numba": "import disttrace.analysis.fused",
}


def _import_cost(what: str, passes: int) -> float:
    """The median CPU seconds a fresh process spends importing the C module, or analysis/fused.py (numba, and
    its compiled pass loaded from the cache), after numpy and pyarrow."""
    code = (
        "import time, numpy, pyarrow, disttrace.analysis.tolerance\n"
        "t = time.process_time()\n"
        f"{_IMPORTS[what]}\n"
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


def _use(path: str) -> None:
    """Make columnar.summarize take `path`'s module (numpy: none)."""
    os.environ["DISTTRACE_FUSED"] = "0" if path == "numpy" else "1"
    columnar._fused_module = None
    columnar._native_module = False if path == "numba" else None


def _paths() -> list[str]:
    paths = []
    _use("C")
    if columnar.is_native(columnar._fused()):
        paths.append("C")
    _use("numba")
    if columnar._fused() is not None:
        paths.append("numba")
    return paths + ["numpy"]


_SETUP = """
import sys, time
from disttrace.analysis.diff import blocks
from disttrace.analysis.diff.prepare import _Setup
a, b = sys.argv[1], sys.argv[2]
t = time.process_time()
st = _Setup(a, b, "numeric", None, None, False, True, None, True)
t1 = time.process_time()
steps, ranks, sides = st.steps, st.ranks, (st.side_a, st.side_b)
if hasattr(blocks, "_Plan"):
    plan = blocks._Plan(steps, ranks, sides)
    block = lambda n: plan.block(n, blocks.BLOCK_ROWS)
else:
    block = lambda n: blocks._block(steps, n, ranks, sides, blocks.BLOCK_ROWS)
for _ in range(2):  # the read-ahead's walk over the blocks and the comparison's
    n = 0
    while n < len(steps):
        n += len(block(n))
print(t1 - t, time.process_time() - t1)
"""


def _setup_cost(a: str, b: str, code: Path, passes: int) -> list[tuple[float, float]]:
    env = dict(os.environ, PYTHONPATH=str(code))
    return [
        tuple(
            map(
                float,
                subprocess.run(
                    [sys.executable, "-c", _SETUP, a, b],
                    capture_output=True,
                    text=True,
                    check=True,
                    env=env,
                ).stdout.split(),
            )
        )
        for _ in range(passes)
    ]


def _against(a: str, b: str, other: Path, passes: int) -> None:
    ours, theirs = [], []
    for _ in range(passes):
        ours += _setup_cost(a, b, ROOT, 1)
        theirs += _setup_cost(a, b, other, 1)
    med = lambda xs, i: sorted(x[i] for x in xs)[len(xs) // 2]  # noqa: E731
    for i, what in enumerate(("step indexes read and checked", "blocks planned, twice")):
        o, t = med(ours, i), med(theirs, i)
        print(
            f"{what}: {o:.4f} s of CPU against {t:.4f} s ({other}): {t / o:.2f}x, "
            f"median of {passes} fresh processes each"
        )


def _sizes(jobs, tol, sizes: list[int], paths: list[str]) -> None:
    """Per path, the CPU seconds of folding a block of n rows (the first n rows of the first rank-block, its
    steps cut there), for each n: where the compiled pass starts to pay (columnar.NATIVE_MIN, FUSED_MIN)."""
    todo, r, ((ba, starts), _, ca, cb, _) = jobs[0]
    for n in sizes:
        n = min(n, ca.num_rows)
        s = starts[starts < n] if n else starts[:1]
        a, b = columnar.Columns(ca.batch.slice(0, n)), columnar.Columns(cb.batch.slice(0, n))
        for c, src in ((a, ca), (b, cb)):
            c._np.update({k: v[:n] for k, v in src._np.items()})
        got: dict[str, list[float]] = {p: [] for p in paths}
        reps = max(3, 3000 // max(n, 1))
        for _ in range(9):
            for p in paths:
                _use(p)
                t = time.process_time()
                for _ in range(reps):
                    out = [_RankStep(k) for k in np.diff(np.append(s, n)).tolist()]
                    _fold_columns(todo[: len(s)], r, a, b, s, tol, out)
                got[p].append((time.process_time() - t) / reps)
        print(
            f"block of {n:>5} rows ({len(s)} steps): "
            + ", ".join(
                f"{p} {min(v) * 1e3:.3f} ms (median {sorted(v)[len(v) // 2] * 1e3:.3f})"
                for p, v in got.items()
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--passes", type=int, default=3, help="passes of each path (alternating)")
    ap.add_argument(
        "--block-rows", type=int, default=BLOCK_ROWS, help="rows a rank-block gathers (1: a step)"
    )
    ap.add_argument(
        "--sizes",
        default=None,
        help="also each path's CPU a block of these row counts (comma-separated), e.g. 1,16,150,4096",
    )
    ap.add_argument(
        "--against", type=Path, default=None, help="another checkout (the set-up's cost)"
    )
    args = ap.parse_args()
    if args.against is not None:
        _against(args.a, args.b, args.against, max(args.passes, 5))
    load = os.getloadavg()
    st = _Setup(args.a, args.b, "numeric", None, None, False, True, None, True)
    jobs = _jobs(st, args.block_rows)
    pairs = sum(job[2][0][0].num_rows for job in jobs)
    # this bench measures the paths whatever the diff's own thresholds would choose
    columnar.FUSED_PAIRS = columnar.FUSED_MIN = columnar.NATIVE_MIN = 0
    st.tol.fused = True
    paths = _paths()
    times: dict[str, list[float]] = {k: [] for k in paths}
    results = {}
    for name in paths * (args.passes + 1):
        _use(name)
        t = time.process_time()
        results[name] = _fold_all(jobs, st.tol)
        times[name].append(time.process_time() - t)
    for k in times:  # the first pass of each: imports and warm-up, not counted
        times[k] = times[k][1:]
    for k in paths:
        assert results[k] == results["numpy"], f"{k} and numpy differ"
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(
        f"{len(jobs)} rank-blocks ({pairs / len(jobs):,.0f} rows a block), {pairs:,} pairs of records; "
        f"load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1, 5, 15 min)"
    )
    for k, v in times.items():
        print(
            f"{k:>9}: CPU min {min(v):.4f} s, median {med[k]:.4f} s "
            f"({med[k] / pairs * 1e6:.3f} us a pair)"
        )
    for k in paths[:-1]:
        print(f"{k} / numpy: {med['numpy'] / med[k]:.2f}x fewer CPU seconds by medians")
    if "C" in paths and "numba" in paths:
        print(f"C / numba: {med['numba'] / med['C']:.2f}x fewer CPU seconds by medians")
    print("results the same on every path")
    for k in paths[:-1]:
        cost = _import_cost(k, args.passes)
        saved = (med["numpy"] - med[k]) / pairs
        back = f"earned back from ~{cost / saved:,.0f} pairs" if saved > 0 else "not earned back"
        print(
            f"one-off: importing {k}'s module {cost * 1e3:.1f} ms of CPU (median of {args.passes} fresh "
            f"processes): {back}"
        )
    if args.sizes:
        _sizes(jobs, st.tol, [int(x) for x in args.sizes.split(",")], paths)
    print(f"load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
