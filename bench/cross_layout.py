"""The numeric diff on real runs of two layouts of one training, the work it exists for (docs/benchmarks.md).

Writes, through the CLI (`disttrace run manifests/default.toml --set ...`), the default model at --layers layers
for --steps steps in four layouts of one global batch: dp=1 x accumulation 4 (the reference), dp=2 x
accumulation 2, ZeRO-3 at dp=2 x accumulation 2, and tp=2 x accumulation 4. Then, for each layout against the
reference, `disttrace diff LAYOUT REFERENCE --mode numeric --json` in fresh processes, --repeat times each,
interleaved with its baselines: the same diff on the plain path (DISTTRACE_NATIVE=0: numpy and pyarrow, no C
kernels) and, with --against, the same diff by another checkout's code. Each child imports disttrace first and
times the diff alone (the CLI's own call: what follows start-up), so a figure is records read (both runs) per
second of that call, by CPU time (the machine is shared: wall time is printed beside it) and as a ratio against
the baseline measured in the same run. The `--json` of every path must be the same bytes (but for the runs'
paths). With --against-dir, the other checkout's code reads its own copies of the runs (written by that code,
in its store format: runs.json there names them), so a change of format is measured against the format before.

    .venv/bin/python bench/cross_layout.py [--layers 32] [--steps 60] [--repeat 3] [--against ../main]
        [--against-dir D2] [--dir D]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {
    "dp1xacc4": {"parallelism.dp": 1, "training.grad_accum_steps": 4},
    "dp2xacc2": {"parallelism.dp": 2, "training.grad_accum_steps": 2},
    "zero3": {"parallelism.dp": 2, "parallelism.zero_stage": 3, "training.grad_accum_steps": 2},
    "tp2": {"parallelism.dp": 1, "parallelism.tp": 2, "training.grad_accum_steps": 4},
}

CHILD = r"""
import contextlib, hashlib, io, json, sys, time
code = sys.argv[3]
if code:
    sys.path.insert(0, code)
from disttrace.cli.shared import app
import disttrace.analysis.diff  # noqa: F401  (start-up: the imports the diff needs)
sys.argv = ["disttrace", "diff", sys.argv[1], sys.argv[2], "--mode", "numeric", "--json"]
out = io.StringIO()
t0, c0 = time.perf_counter(), time.process_time()
with contextlib.redirect_stdout(out):
    try:
        app()
    except SystemExit:
        pass
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
doc = json.loads(out.getvalue())
n = sum(doc["records_read"].values())
for side in ("a", "b"):  # where the runs lie is the one field two copies of the same runs differ in
    doc[side].pop("path")
digest = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()
print(json.dumps({"wall": wall, "cpu": cpu, "records": n, "sha256": digest}))
"""


def write(out: Path, layers: int, steps: int, runs: dict[str, Path]) -> dict[str, Path]:
    """The layouts' runs, each written unless `runs` has it already."""
    for name, over in LAYOUTS.items():
        if name in runs:
            continue
        sets = [f"model.n_layers={layers}", f"training.steps={steps}"]
        sets += [f"{k}={v}" for k, v in over.items()]
        cmd = [sys.executable, "-m", "disttrace", "run", str(ROOT / "manifests/default.toml")]
        cmd += [x for s in sets for x in ("--set", s)] + ["--quiet", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        runs[name] = Path(proc.stdout.strip().splitlines()[-1])
        print(f"wrote {name}: {runs[name]}  ({' '.join(cmd[2:])})", flush=True)
    return runs


def child(a: Path, b: Path, native: bool, code: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "DISTTRACE_NATIVE"}
    if not native:
        env["DISTTRACE_NATIVE"] = "0"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(a), str(b), code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--against", type=Path, default=None, help="another checkout's code as a baseline"
    )
    ap.add_argument("--dir", type=Path, default=None, help="write (or reuse) the runs here")
    ap.add_argument(
        "--against-dir",
        type=Path,
        default=None,
        help="the runs --against's code reads (runs.json there; default: the same runs)",
    )
    args = ap.parse_args()
    out = args.dir or Path(tempfile.mkdtemp(prefix="cross-layout-"))
    marker = out / "runs.json"  # the runs written so far (a layout's run is reused)
    runs = {}
    if marker.is_file():
        runs = {k: Path(v) for k, v in json.loads(marker.read_text()).items()}
    runs = write(out, args.layers, args.steps, runs)
    marker.write_text(json.dumps({k: str(v) for k, v in runs.items()}))
    paths = {"C": (True, "", runs), "plain": (False, "", runs)}
    if args.against is not None:
        theirs = runs
        if args.against_dir is not None:
            theirs = json.loads((args.against_dir / "runs.json").read_text())
            theirs = {k: Path(v) for k, v in theirs.items()}
        paths["against"] = (True, str(args.against.resolve()), theirs)
    for name in ("dp2xacc2", "zero3", "tp2"):
        got: dict[str, list[dict]] = {p: [] for p in paths}
        for _ in range(args.repeat):
            for p, (native, code, rs) in paths.items():
                got[p].append(child(rs[name], rs["dp1xacc4"], native, code))
        digests = {r["sha256"] for rs in got.values() for r in rs}
        assert len(digests) == 1, f"{name}: the paths' --json differ"
        n = got["C"][0]["records"]
        print(
            f"{name} against dp1xacc4: {n:,} records, --json the same on every path (the runs' paths aside)"
        )
        for p, rs in got.items():
            rate = sorted(n / r["cpu"] / 1e6 for r in rs)
            wall = sorted(n / r["wall"] / 1e6 for r in rs)
            ratio = sorted(
                r["cpu"] / c["cpu"] for r, c in zip(rs, got["C"])
            )  # this path's CPU over C's, run by run
            print(
                f"  {p:>8}: {rate[len(rate) // 2]:.2f} M records/s by CPU (runs {rate[0]:.2f}-{rate[-1]:.2f}), "
                f"{wall[len(wall) // 2]:.2f} M by wall; CPU {ratio[0]:.2f}-{ratio[-1]:.2f}x the C path's"
            )


if __name__ == "__main__":
    main()
