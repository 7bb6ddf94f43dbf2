"""What a run store holds per record (docs/benchmarks.md, "What a run stores"): for each run named, the
records its step indexes count, and the bytes per record of each part: the trajectory's Arrow streams, the
magnitudes side file (binary frames, or an older store's JSON lines), the step index, the trajectory
directory as a whole, the collective trace, the rest of the run directory but checkpoints, and the run
directory without and with its checkpoints.

    .venv/bin/python bench/store_size.py RUN [RUN ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson


def _size(files) -> int:
    return sum(f.stat().st_size for f in files if f.is_file())


def measure(run: Path) -> dict[str, float]:
    traj = run / "trajectory"
    records = sum(
        orjson.loads(line)["records"]
        for f in traj.glob("rank-*.steps.jsonl")
        for line in f.read_bytes().splitlines()
        if line.strip()
    )
    every = [f for f in run.rglob("*") if f.is_file()]
    checkpoints = [f for f in every if "checkpoints" in f.relative_to(run).parts[:1]]
    parts = {
        "arrows": _size(traj.glob("rank-*.arrows")),
        "magnitudes": _size(traj.glob("rank-*.scales.*")),
        "step index": _size(traj.glob("rank-*.steps.jsonl")),
        "trajectory dir": _size(traj.glob("*")),
        "collectives": _size((run / "collectives").glob("*")),
        "run dir, no checkpoints": _size(every) - _size(checkpoints),
        "run dir": _size(every),
    }
    return {"records": records, **{k: v / records for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("runs", nargs="+", type=Path)
    args = ap.parse_args()
    for run in args.runs:
        m = measure(run)
        cells = ", ".join(f"{k} {v:.1f}" for k, v in m.items() if k != "records")
        print(f"{run}: {m['records']:,} records; bytes per record: {cells}")


if __name__ == "__main__":
    main()
