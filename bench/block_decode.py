"""What a block of v2 steps costs to decode (store/trajectory_decode.py `decode_steps`): CPU time per step-side,
in process, the C kernels (store/blockdecode.py) against the pyarrow path of this checkout (what
DISTTRACE_NATIVE=0 takes) and against another checkout's decoder (--against), each the minimum of
--passes alternating passes over the same blocks; and what the C kernels cost once a process (the C
module's import, store/blockdecode.py's import and its first call, measured in a fresh interpreter), which a
short diff pays.

Steps are the synthetic stores' (bench/synthetic.py: the writer's own layout, the recorder's record mix),
cut into blocks of diff's size (analysis/diff/blocks.py BLOCK_ROWS records) or of --block steps.

    .venv/bin/python bench/block_decode.py [--records 150,1000] [--steps 400] [--passes 7] [--block N]
        [--against DIR]
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
from disttrace.store import trajectory_decode, trajectory_write  # noqa: E402


def _store(d: Path, records: int, steps: int) -> list[bytes]:
    path = d / f"rank-00000-{records}.arrows"
    w = trajectory_write.TrajectoryWriter(path)
    layout = synthetic.Layout(records, w)
    out = [w.write_batch(layout.batch(s, 0)) for s in range(1, steps + 1)]
    w.close()
    return out


def _trajectory_at(checkout: Path):
    """Another checkout's decoder as a module of its own (its other imports are this one's): its
    store/trajectory_decode.py, or store/trajectory.py in a checkout from before the decoder had a module."""
    store = checkout / "disttrace" / "store"
    path = store / "trajectory_decode.py"
    spec = importlib.util.spec_from_file_location(
        "trajectory_against", path if path.exists() else store / "trajectory.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _once_cost() -> tuple[float, float, float]:
    """CPU seconds of the C module's import, of store/blockdecode.py's import with it, and of the first call,
    in a fresh interpreter, after numpy and pyarrow."""
    code = (
        "import time, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'bench')!r})\n"
        "import pathlib, tempfile, synthetic\n"
        "from disttrace.store import trajectory_write\n"
        "w = trajectory_write.TrajectoryWriter(pathlib.Path(tempfile.mkdtemp()) / 'r.arrows')\n"
        "layout = synthetic.Layout(150, w)\n"
        "steps = [w.write_batch(layout.batch(s, 0)) for s in (1, 2, 3)]\n"
        "c0 = time.process_time()\n"
        "import disttrace.native._blockdecode\n"
        "cm = time.process_time()\n"
        "from disttrace.store import blockdecode\n"
        "c1 = time.process_time()\n"
        "assert blockdecode.decode(steps) is not None\n"
        "c2 = time.process_time()\n"
        "print(cm - c0, c1 - c0, c2 - c1)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    m, a, b = out.split()
    return float(m), float(a), float(b)


def _decode_all(module, kernel, blocks, path) -> None:
    """Every block through `module`'s decode_steps; kernel: what trajectory_decode._kernel is set to (None: left)."""
    if kernel is not None:
        module._kernel = kernel
    for b in blocks:
        module.decode_steps(path, b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--records", default="150,1000", help="records a step, comma-separated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--passes", type=int, default=7)
    ap.add_argument("--block", type=int, help="steps a block (default: diff's, BLOCK_ROWS records)")
    ap.add_argument(
        "--against", type=Path, help="another checkout (e.g. `git archive main` unpacked)"
    )
    args = ap.parse_args()
    if trajectory_decode._compiled() is None:
        sys.exit("the C kernels are not built, or DISTTRACE_NATIVE=0: nothing to compare")
    from disttrace.store import blockdecode

    kernels = {"c": blockdecode.decode}
    other = _trajectory_at(args.against) if args.against else None
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")
    with tempfile.TemporaryDirectory() as d:
        for records in (int(x) for x in args.records.split(",")):
            steps = _store(Path(d), records, args.steps)[1:]  # not the first: it holds the schema
            per = args.block or max(1, BLOCK_ROWS // records)
            blocks = [
                [(s, f"step {i + j}") for j, s in enumerate(steps[i : i + per])]
                for i in range(0, len(steps), per)
            ]
            path = Path(d) / "x.arrows"

            ops = {
                k: partial(_decode_all, trajectory_decode, f, blocks, path)
                for k, f in kernels.items()
            }
            ops["pyarrow"] = partial(_decode_all, trajectory_decode, False, blocks, path)
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
            for k, f in kernels.items():  # the same batch every way
                trajectory_decode._kernel = f
                for b in blocks:
                    data = [s for s, _ in b]
                    got = trajectory_decode.decode_steps(path, b)[0]
                    want = trajectory_decode._decode_block(data)[0]
                    assert repr(got.to_pylist()) == repr(want.to_pylist()), k
            us = {k: v / len(steps) * 1e6 for k, v in best.items()}
            line = f"{records:>5} records a step, {per} steps a block, us a step-side: pyarrow {us['pyarrow']:.1f}"
            for k in kernels:
                line += f", {k} {us[k]:.1f} ({us[k] / us['pyarrow']:.2f}x)"
            if other is not None:
                line += f", {args.against} {us['against']:.1f}"
            print(line)
            print(
                "      a block: "
                + ", ".join(f"{k} {v * 1e6 / len(blocks):.0f} us" for k, v in best.items())
                + "; a record: "
                + ", ".join(f"{k} {us[k] / records * 1000:.0f} ns" for k in kernels)
            )
    module, imp, first = _once_cost()
    print(
        f"once a process: the C module's import {module * 1000:.1f} ms CPU; with store/blockdecode.py's "
        f"{imp * 1000:.1f} ms, the first call {first * 1000:.1f} ms"
    )
    print(f"load: {' '.join(f'{x:.2f}' for x in os.getloadavg())} (1, 5, 15 min)")


if __name__ == "__main__":
    main()
