"""Whether the readers' peak memory grows with the number of steps: the numeric diff and `check` at one rank
count and several step counts, this checkout against another revision (default `main`) in the same run, each
command in a fresh process, the two revisions in turn (docs/benchmarks.md, "Peak memory and the steps").

Stores: bench/scale.py's (`write_point`, the recorder's writer), kept under --dir so that a second run reuses
them. Each command through the CLI, stdout to a file; printed: the peak RSS it added to its process
(ru_maxrss after less before, the imports left out), its wall and CPU seconds, and whether its `--json`
document is byte-identical to the other revision's. Then, per command and revision, what the peak added grew
by from the fewest steps to the most.

    python bench/steps_memory.py --dir /tmp/steps-mem --ranks 64 --records 1000 --steps 10,100,400
    python bench/steps_memory.py --dir D --base 3f67a33          # against another revision
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import resource
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(tree: str, argv: list[str]) -> None:
    """One CLI command with the disttrace of `tree`, in this fresh process; one JSON line on stderr."""
    sys.path.insert(0, tree)
    import importlib

    from disttrace import cli

    for name in (
        "disttrace.analysis.diff",
        "disttrace.analysis.consistency",
        "disttrace.views.diff",
    ):
        importlib.import_module(name)
    import disttrace

    assert Path(disttrace.__file__).resolve().is_relative_to(Path(tree).resolve()), (
        disttrace.__file__
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = tempfile.TemporaryFile("w+b")
    text = open(out.fileno(), "w", encoding="utf-8", closefd=False)
    sys.argv = ["disttrace", *argv]
    u0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    code = 0
    with contextlib.redirect_stdout(text):
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 0
    text.flush()
    dt, u1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out.seek(0)
    h = hashlib.sha256()
    while chunk := out.read(1 << 20):
        h.update(chunk)
    cpu = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    sys.__stderr__.write(
        "\n"
        + json.dumps(
            {
                "code": code,
                "seconds": dt,
                "cpu_seconds": cpu,
                "added_mib": (peak - base) / 1024,
                "sha256": h.hexdigest(),
                "bytes": out.tell(),
            }
        )
        + "\n"
    )


def measure(tree: Path, argv: list[str]) -> dict:
    p = subprocess.run(
        [sys.executable, __file__, "--child", str(tree), *argv],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": ""},
    )
    try:
        return json.loads(p.stderr.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{argv}: the child printed no result:\n{p.stderr[-3000:]}") from None


def revision_tree(rev: str, into: Path) -> Path:
    """`disttrace/` as it was at `rev`, unpacked under `into`."""
    data = subprocess.run(
        ["git", "-C", str(ROOT), "archive", rev, "disttrace"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryFile() as f:
        f.write(data)
        f.seek(0)
        with tarfile.open(fileobj=f) as t:
            t.extractall(into, filter="data")
    return into


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--steps", default="10,100,400")
    ap.add_argument("--base", default="main", help="the revision to hold this checkout against")
    ap.add_argument("--commands", default="numeric,check")
    ap.add_argument("--dir", help="where the stores are written (and kept)")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child[0], args.child[1:])
        return
    if not args.dir:
        ap.error("--dir is needed (the stores are kept there)")
    sys.path.insert(0, str(ROOT / "bench"))
    import scale

    steps = [int(s) for s in args.steps.split(",") if s]
    commands = [c for c in args.commands.split(",") if c]
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="disttrace-base-") as d:
        trees = {f"this ({head})": ROOT, f"{args.base}": revision_tree(args.base, Path(d))}
        got: dict[tuple, dict] = {}
        for s in steps:
            point, how = scale._stores(
                base / f"p{args.ranks}x{s}x{args.records}", args.ranks, s, args.records, commands
            )
            print(f"{args.ranks} ranks x {s} steps x {args.records} records: {how}", flush=True)
            for c in commands:
                argv, codes = scale.argv_of(c, point["runs"], base)
                for name, tree in trees.items():
                    r = got[(c, s, name)] = measure(tree, argv)
                    if r["code"] not in codes:
                        raise SystemExit(f"{name} {c}: exit {r['code']}, expected {codes}")
                    print(
                        f"  {c:<8} {name:<16} +{r['added_mib']:6.1f} MiB  {r['seconds']:7.1f} s "
                        f"({r['cpu_seconds']:6.1f} s CPU)  --json {r['bytes']:>10,} bytes "
                        f"{r['sha256'][:12]}",
                        flush=True,
                    )
                a, b = (got[(c, s, n)]["sha256"] for n in trees)
                print(f"  {c:<8} --json byte-identical: {'yes' if a == b else 'NO'}", flush=True)
    print(f"\npeak RSS added (MiB) at {args.ranks} ranks x {args.records} records a rank-step:")
    print(
        f"  {'command':<8} {'revision':<16} " + " ".join(f"{s:>7} st" for s in steps) + "   growth"
    )
    for c in commands:
        for name in trees:
            row = [got[(c, s, name)]["added_mib"] for s in steps]
            print(
                f"  {c:<8} {name:<16} "
                + " ".join(f"{x:10.1f}" for x in row)
                + f"   {row[-1] - row[0]:+7.1f}"
            )


if __name__ == "__main__":
    main()
