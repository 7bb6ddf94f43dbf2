"""The readers' cost at scale: how `diff`, `check`, `verify`, `show` and `report` grow with ranks, steps and
records a rank-step (docs/benchmarks.md, "Where the readers' cost goes", and its figures).

Synthetic run stores in the recorder's format (bench/synthetic.py: store/trajectory_write.py's TrajectoryWriter, each
step index line sealed by store/seal.py's StepChain, COMPLETE holding the seal `verify` checks, replicas.json for
`check`, a step-time line per step for `show`; a rank-step built from arrays, ranks written in 2 processes:
~0.8 ms of CPU a 1,000-record rank-step); per point (ranks x steps x records):

  ref    the reference: reduced gradients and optimizer state equal on every rank, data and local gradients not
  same   ref's files again (hard links): no divergence
  early  ref with one bit of one digest changed at step 1 on the last rank (bits changed, statistics equal)
  late   the same at the last step
  noisy  every value rounded differently (~1e-12 relative, every digest different): a numeric diff reads and
         compares every record
  half   noisy's first half of the ranks as a run of half the data-parallel ranks and twice the accumulation:
         the diff across topologies

Each command runs through the CLI (`disttrace.cli`) in a fresh process, the import not timed, and prints:
wall and CPU seconds (user + system of the process: the fair figure on a shared machine), peak RSS of that
process and how much of it the command added (ru_maxrss before and after),
bytes read (read calls: /proc/self/io rchar; plus the size of each file the readers map, which a scan
pages in), and CPU microseconds per record of one run. Then, per command, the growth exponent along each
curve: the least-squares slope of log(wall seconds), of log(CPU seconds) and of log(added memory) against
log(ranks), log(steps) or
log(records); 1 is linear, a fixed cost pulls it below 1, above ~1.15 is a defect. Commands:

  diff-late    disttrace diff ref late        bitwise, by the index, to a divergence in the last step
  diff-early   disttrace diff ref early       the same at step 1, then propagation over every later step
  diff-none    disttrace diff ref same        nothing differs: every step skipped by the index
  numeric      disttrace diff ref noisy --mode numeric   every record read and held to the derived bound
  cross        disttrace diff ref half        numeric across topologies (logical tensors)
  check        disttrace check ref            the replica rules, every step of every rank
  verify       disttrace verify ref           every step's sha256, the chain, every file against the seal
  show         disttrace show ref             the summary (step index, step times, stragglers)
  report       disttrace report ref late      the HTML page (a diff and its rendering)

    python bench/scale.py                                  # the default curves: a few minutes on 2 cores
    python bench/scale.py --ranks 2,8,64,256,1024          # the ranks curve to 1,024 ranks
    python bench/scale.py --point 1024x100x1000 --commands diff-late,numeric,check   # one large point
    python bench/scale.py --base 1024x100x1000 --steps 100,10 --ranks 1024,64 --records "" \
        --commands diff-late,numeric,check --json J      # the large point and its exponents in ranks and steps

A point two curves share is measured once; `--measured J...` takes the points of earlier runs' --json (the
curves and exponents then combine runs).

Stores go to a temporary directory under /tmp (or --dir) and are deleted after each point (--keep keeps them).
`--write-only --dir D` writes the points' stores and keeps them; the same command without it then measures
them (the writing is not timed again; they are deleted after, unless --keep):

    python bench/scale.py --write-only --dir D --point 1024x100x1000 --commands diff-late,numeric,check
    python bench/scale.py --dir D --point 1024x100x1000 --commands diff-late,numeric,check
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))

import synthetic  # noqa: E402

from disttrace.store.trajectory import SUFFIX  # noqa: E402

COMMANDS = (
    "diff-late",
    "diff-early",
    "diff-none",
    "numeric",
    "cross",
    "check",
    "verify",
    "show",
    "report",
)


def _link_tree(src: Path, dst: Path, skip: set[str] = frozenset()) -> None:
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
        elif str(rel) not in skip:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, dst / rel)


def _rank_files(rank: int) -> set[str]:
    return {
        f"trajectory/rank-{rank:05d}{SUFFIX}",
        f"trajectory/rank-{rank:05d}.steps.jsonl",
        f"steps/rank-{rank:05d}.jsonl",
    }


def write_point(root: Path, ranks: int, steps: int, n: int, need: set[str], jobs=None) -> dict:
    """The stores of one point (bench/synthetic.py, ranks in `jobs` processes); returns their paths and
    the planted coordinates."""
    runs = {k: root / k for k in ("ref", "same", "early", "late", "noisy", "half")}
    m = synthetic.manifest(ranks, steps)
    synthetic.write_shared(runs["ref"], m)
    variants = [synthetic.Variant(str(runs["ref"]))]
    numeric = bool(need & {"numeric", "cross"})
    if numeric:
        synthetic.write_shared(runs["noisy"], m)
        variants.append(synthetic.Variant(str(runs["noisy"]), noisy=True))
    # one bit of one digest of the last rank, at step 1 and at the last step: that rank's files written
    # again, the others linked to ref's
    last, pos = ranks - 1, n // 2
    planted, flips = {}, {}
    for kind, at in (("early", 1), ("late", steps)):
        if f"diff-{kind}" not in need and not (kind == "late" and "report" in need):
            continue
        fault = {"name": "bench", "step": at, "rank": last}
        synthetic.write_shared(runs[kind], m, "fault", fault)
        flips[kind] = len(variants)
        variants.append(synthetic.Variant(str(runs[kind]), flip=(at, pos), ranks=(last,)))
        planted[kind] = synthetic.planted(n, at, last, pos)
    parts = synthetic.write_ranks(variants, ranks, steps, n, jobs)
    synthetic.complete(runs["ref"], parts[0])
    _link_tree(runs["ref"], runs["same"])
    for kind, k in flips.items():
        skip = _rank_files(last) | {"COMPLETE", "run.json", "manifest.lock.json", "replicas.json"}
        _link_tree(runs["ref"], runs[kind], skip | {"topology.json"})
        synthetic.complete(runs[kind], parts[0][:-1] + parts[k])
    if numeric:
        synthetic.complete(runs["noisy"], parts[1])
    if "cross" in need:  # noisy's first half of the ranks, another topology (the same global batch)
        half = max(1, ranks // 2)
        synthetic.write_shared(runs["half"], synthetic.manifest(half, steps, ranks // half))
        for rank in range(half):
            for rel in _rank_files(rank):
                os.link(runs["noisy"] / rel, runs["half"] / rel)
        synthetic.complete(runs["half"], parts[1][:half])
    return {"runs": {k: str(v) for k, v in runs.items()}, "planted": planted}


def argv_of(command: str, runs: dict, out: Path) -> tuple[list[str], tuple[int, ...]]:
    """The CLI's arguments and the exit codes it must end with."""
    r = runs
    return {
        "diff-late": (["diff", r["ref"], r["late"], "--json"], (1,)),
        "diff-early": (["diff", r["ref"], r["early"], "--json"], (1,)),
        "diff-none": (["diff", r["ref"], r["same"], "--json"], (0,)),
        "numeric": (["diff", r["ref"], r["noisy"], "--mode", "numeric", "--json"], (0,)),
        "cross": (["diff", r["ref"], r["half"], "--json"], (0,)),
        "check": (["check", r["ref"], "--json"], (0,)),
        "verify": (["verify", r["ref"], "--json"], (0,)),
        "show": (["show", r["ref"], "--json"], (0,)),
        "report": (["report", r["ref"], r["late"], "-o", str(out / "report.html")], (0, 1)),
    }[command]


def _rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def child(argv: list[str]) -> None:
    """Run one CLI command in this (fresh) process, stdout to a file; print one JSON line on stderr's last line."""
    import contextlib
    import importlib

    from disttrace import cli
    from disttrace.store import safeio

    # what the commands import when they start, imported before the clock does: the cost measured is the
    # reading, not Python's import of the readers
    for name in (
        "disttrace.analysis.diff",
        "disttrace.analysis.consistency",
        "disttrace.analysis.facts",
        "disttrace.analysis.magnitudes",
        "disttrace.store.verify",
        "disttrace.report",
        "disttrace.views.diff",
        "disttrace.views.show",
        "disttrace.views.report",
        "disttrace.analysis.timeline",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    mapped = [0]
    real_mapped = safeio.mapped

    def counting(path, root):
        m = real_mapped(path, root)
        mapped[0] += len(m)
        return m

    safeio.mapped = counting
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # stdout to a file, not to memory: the peak is the command's, not that of a copy of its document (a
    # numeric diff's is ~40 MB at 1,024 ranks x 100 steps)
    out = tempfile.TemporaryFile("w+", encoding="utf-8")
    sys.argv = ["disttrace", *argv]
    r0, t0, c0 = _rchar(), time.perf_counter(), _cpu()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    dt, cpu = time.perf_counter() - t0, _cpu() - c0
    read = _rchar() - r0 + mapped[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc = None
    out.seek(0)
    try:
        doc = json.loads(out.read())
    except ValueError:
        pass
    first = (doc or {}).get("first_divergence") if isinstance(doc, dict) else None
    sys.__stderr__.write(
        "\n"
        + json.dumps(
            {
                "code": code,
                "seconds": dt,
                "cpu_seconds": cpu,
                "rss_mib": peak / 1024,
                "added_mib": (peak - base_rss) / 1024,
                "read_bytes": read,
                "first": [first[k] for k in ("step", "rank", "phase", "index")] if first else None,
            }
        )
        + "\n"
    )


def measure(command: str, point: dict, out: Path) -> dict:
    argv, codes = argv_of(command, point["runs"], out)
    p = subprocess.run(
        [sys.executable, __file__, "--child", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        r = json.loads(p.stderr.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{command}: the child printed no result:\n{p.stderr[-3000:]}") from None
    if r["code"] not in codes:
        raise SystemExit(f"{command}: exit {r['code']}, expected {codes}:\n{p.stderr[-3000:]}")
    kind = command.split("-")[-1]
    if command.startswith("diff-") and kind in point["planted"]:
        assert r["first"] == point["planted"][kind], (command, r["first"], point["planted"])
    return r


def slope(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(max(y, 1e-9))) for x, y in zip(xs, ys)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def _stores(root: Path, ranks: int, steps: int, n: int, commands, jobs=None) -> tuple[dict, str]:
    """The point's stores: those a `--write-only` run kept under `root` (its point.json names them and the
    commands they were written for), or new ones."""
    kept = root / "point.json"
    if kept.is_file():
        point = json.loads(kept.read_text())
        if set(commands) <= set(point["commands"]):
            return point, "written before"
        shutil.rmtree(root)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    point = write_point(root, ranks, steps, n, set(commands), jobs)
    point["commands"] = list(commands)
    kept.write_text(json.dumps(point))
    return point, f"written in {time.perf_counter() - t0:6.1f} s"


def run_point(
    base: Path, ranks: int, steps: int, n: int, commands, keep: bool, jobs=None, write_only=False
) -> dict:
    root = base / f"p{ranks}x{steps}x{n}"
    try:
        point, how = _stores(root, ranks, steps, n, commands, jobs)
        size = sum(p.stat().st_size for p in Path(point["runs"]["ref"]).glob("trajectory/*.arrows"))
        records = ranks * steps * n
        print(
            f"  {ranks:>5} ranks x {steps:>5} steps x {n:>5} records = {records:>12,} records a run, "
            f"{size / 2**20:9.1f} MiB a run; {how}; "
            f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}",
            flush=True,
        )
        res = {}
        if write_only:
            return {"ranks": ranks, "steps": steps, "records": n, "bytes": size, "commands": {}}
        for c in commands:
            r = measure(c, point, root)
            res[c] = r
            print(
                f"      {c:<10} {r['seconds']:9.3f} s ({r['cpu_seconds']:8.2f} s CPU)  "
                f"{r['cpu_seconds'] / records * 1e6:8.3f} CPU us/record  "
                f"peak RSS {r['rss_mib']:7.0f} MiB (+{r['added_mib']:6.0f})  read {r['read_bytes'] / 2**20:9.1f} MiB",
                flush=True,
            )
        return {"ranks": ranks, "steps": steps, "records": n, "bytes": size, "commands": res}
    finally:
        if not keep and not write_only:
            shutil.rmtree(root, ignore_errors=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ranks", type=_ints, default=[2, 8, 64], help="the ranks curve (steps 10, records 100)"
    )
    ap.add_argument(
        "--steps",
        type=_ints,
        default=[10, 100, 1000],
        help="the steps curve (2 ranks, records 100)",
    )
    ap.add_argument(
        "--records",
        type=_ints,
        default=[100, 1000, 5000],
        help="the records curve (2 ranks, 10 steps)",
    )
    ap.add_argument(
        "--base", default="2x10x100", help="RANKSxSTEPSxRECORDS each curve varies one of"
    )
    ap.add_argument("--point", default=None, help="one point only, RANKSxSTEPSxRECORDS (no curves)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help=f"of: {', '.join(COMMANDS)}")
    ap.add_argument(
        "--dir", default=None, help="where to write the stores (default: a new directory in /tmp)"
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument(
        "--write-only",
        action="store_true",
        help="write the points' stores under --dir and keep them, measure nothing; a later run with the "
        "same --dir measures them (with --keep, they stay for the next)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes writing the stores (default: 2 for a large one)",
    )
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument(
        "--measured",
        nargs="*",
        default=None,
        help="--json files of earlier runs: their points are not measured again (the curves take them)",
    )
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    commands = [c for c in args.commands.split(",") if c]
    unknown = set(commands) - set(COMMANDS)
    if unknown:
        raise SystemExit(f"unknown commands {sorted(unknown)}; of: {', '.join(COMMANDS)}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="disttrace-scale-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    r0, s0, n0 = (int(x) for x in args.base.split("x"))
    if args.point:
        curves = {"point": [tuple(int(x) for x in args.point.split("x"))]}
    else:
        curves = {  # in this order, each in the order given: the point to measure first, first
            "steps": [(r0, s, n0) for s in args.steps],
            "ranks": [(r, s0, n0) for r in args.ranks],
            "records": [(r0, s0, n) for n in args.records],
        }
    results: dict[str, list[dict]] = {}
    done: dict[tuple, dict] = {}  # a point two curves share is measured once
    for f in (
        args.measured or []
    ):  # points measured by an earlier run (its --json), not measured again
        for pts in json.loads(Path(f).read_text()).values():
            for p in pts:
                done[(p["ranks"], p["steps"], p["records"])] = p
    try:
        for name, pts in curves.items():
            print(f"{name}:", flush=True)
            results[name] = []
            for p in pts:
                if (
                    args.write_only
                    or p not in done
                    or not set(commands) <= set(done[p]["commands"])
                ):
                    done[p] = run_point(base, *p, commands, args.keep, args.jobs, args.write_only)
                else:
                    print(f"  {'x'.join(map(str, p))}: measured before", flush=True)
                results[name].append(done[p])
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.write_only:
        return
    print(
        "\ngrowth exponents (slope of log cost against log size; wall time / CPU time / added memory):"
    )
    dims = [d for d in ("ranks", "steps", "records") if len(results.get(d, [])) > 1]
    print(f"  {'command':<10} " + " ".join(f"{d:>22}" for d in dims))
    for c in commands:
        cells = []
        for d in dims:
            pts = results[d]
            xs = [p[d] for p in pts]
            t = slope(xs, [p["commands"][c]["seconds"] for p in pts])
            u = slope(xs, [p["commands"][c]["cpu_seconds"] for p in pts])
            m = slope(xs, [max(p["commands"][c]["added_mib"], 1.0) for p in pts])
            cells.append(f"{t:6.2f} / {u:5.2f} / {m:5.2f}  " if t is not None else f"{'-':>22}")
        print(f"  {c:<10} " + " ".join(cells))


if __name__ == "__main__":
    main()
