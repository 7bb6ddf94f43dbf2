"""What a block of v2 steps costs to decode (store/trajectory.py `decode_steps`): CPU time per step-side,
in process, the compiled path (store/blockdecode.py, numba) against the pyarrow path of this checkout
(DISTTRACE_BLOCK=0) and against another checkout's trajectory.py (--against), each the minimum of
--passes alternating passes over the same blocks; and what the compiled path costs once a process (numba's
import and the kernels loaded from its cache, measured in a fresh interpreter), which a short diff pays.

Steps are the synthetic stores' (bench/synthetic.py: the writer's own layout, the recorder's record mix),
cut into blocks of diff's size (analysis/diff/blocks.py BLOCK_ROWS records).

    .venv/bin/python bench/block_decode.py [--records 150,1000] [--steps 400] [--passes 7] [--against DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import synthetic  # noqa: E402

from disttrace.analysis.diff.blocks import BLOCK_ROWS  # noqa: E402
from disttrace.store import trajectory  # noqa: E402


def _store(d: Path, records: int, steps: int) -> list[bytes]:
    path = d / f"rank-00000-{records}.arrows"
    w = trajectory.TrajectoryWriter(path)
    layout = synthetic.Layout(records, w)
    out = [w.write_batch(layout.batch(s, 0)) for s in range(1, steps + 1)]
    w.close()
    return out


def _trajectory_at(checkout: Path):
    """Another checkout's store/trajectory.py as a module of its own (its other imports are this one's)."""
    spec = importlib.util.spec_from_file_location(
        "trajectory_against", checkout / "disttrace" / "store" / "trajectory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _once_cost() -> tuple[float, float]:
    """CPU seconds of numba's import, and of the kernels' first call (loaded from numba's cache), in a fresh
    interpreter (the cache warmed by this process first)."""
    code = (
        "import time, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        "import pathlib, tempfile, synthetic\n"
        "from disttrace.store import trajectory\n"
        "w = trajectory.TrajectoryWriter(pathlib.Path(tempfile.mkdtemp()) / 'r.arrows')\n"
        "layout = synthetic.Layout(150, w)\n"
        "steps = [w.write_batch(layout.batch(s, 0)) for s in (1, 2, 3)]\n"
        "c0 = time.process_time()\n"
        "import numba\n"
        "from disttrace.store import blockdecode\n"
        "c1 = time.process_time()\n"
        "assert blockdecode.decode(steps) is not None\n"
        "c2 = time.process_time()\n"
        "print(c1 - c0, c2 - c1)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    a, b = out.split()
    return float(a), float(b)


def _decode_all(module, kernel, blocks, path) -> None:
    """Every block through `module`'s decode_steps; kernel: what trajectory._kernel is set to (None: left)."""
    if kernel is not None:
        module._kernel = kernel
    for b in blocks:
        module.decode_steps(path, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", default="150,1000", help="records a step, comma-separated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument(
        "--against", type=Path, help="another checkout (e.g. `git archive main` unpacked)"
    )
    args = ap.parse_args()
    kernel = trajectory._compiled()
    trajectory.COMPILED_AFTER = 0  # every block of this bench is a large job's
    if kernel is None:
        sys.exit(
            "numba is not installed (the `fast` extra) or DISTTRACE_BLOCK=0: nothing to compare"
        )
    other = _trajectory_at(args.against) if args.against else None
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    with tempfile.TemporaryDirectory() as d:
        for records in (int(x) for x in args.records.split(",")):
            steps = _store(Path(d), records, args.steps)[1:]  # not the first: it holds the schema
            per = max(1, BLOCK_ROWS // records)
            blocks = [
                [(s, f"step {i + j}") for j, s in enumerate(steps[i : i + per])]
                for i in range(0, len(steps), per)
            ]
            path = Path(d) / "x.arrows"

            ops = {
                "compiled": partial(_decode_all, trajectory, kernel, blocks, path),
                "pyarrow": partial(_decode_all, trajectory, False, blocks, path),
            }
            if other is not None:
                ops["against"] = partial(_decode_all, other, None, blocks, path)
            for f in ops.values():  # warm: the kernels loaded, pyarrow's pools filled
                f()
            best = {k: float("inf") for k in ops}
            for _ in range(args.passes):
                for k, f in ops.items():
                    c = time.process_time()
                    f()
                    best[k] = min(best[k], time.process_time() - c)
            trajectory._kernel = kernel
            for b in blocks:  # the same batch both ways
                data = [s for s, _ in b]
                got = trajectory.decode_steps(path, b)[0]
                assert repr(got.to_pylist()) == repr(trajectory._decode_block(data)[0].to_pylist())
            us = {k: v / len(steps) * 1e6 for k, v in best.items()}
            line = (
                f"{records:>5} records a step, {per} steps a block: compiled {us['compiled']:.1f} us a "
                f"step-side, pyarrow path {us['pyarrow']:.1f} ({us['compiled'] / us['pyarrow']:.2f}x)"
            )
            if other is not None:
                line += (
                    f", {args.against} {us['against']:.1f} ({us['compiled'] / us['against']:.2f}x)"
                )
            print(line + f"; {us['compiled'] / records * 1000:.0f} ns a record compiled")
    imp, first = _once_cost()
    print(
        f"once a process: numba's import and blockdecode {imp:.2f} s CPU, the kernels' first call (from "
        f"numba's cache) {first:.2f} s"
    )
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")


if __name__ == "__main__":
    main()
