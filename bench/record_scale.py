"""How the cost of recording grows with ranks: world sizes 1, 2, 4 (and 8 with --max-world 8), step time
of each recording variant of bench/overhead.py on the tiny default model (off = record.enabled false;
recorder+ledger; default = + the Flight Recorder collective trace; +live = default + the live check;
values = the dispatch-mode tracer with payload digests), interleaved in the same processes, and the
run-store bytes per step of the default.

    python bench/record_scale.py [--steps 20] [--max-world 4]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import measure  # noqa: E402


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--max-world", type=int, default=4)
    args = ap.parse_args()
    print(
        f"{'world':>5} {'off ms':>8} {'rec+ledger':>10} {'default':>9} {'+live':>9} {'values':>9} {'KiB/step':>9}"
    )
    world = 1
    while world <= args.max_world:
        r = measure(world, args.steps, ["training.grad_accum_steps=1"])
        t = r["times"]
        print(
            f"{world:>5} {t['off'] * 1e3:>8.2f} {t['recorder+ledger'] / t['off']:>9.2f}x "
            f"{t['default'] / t['off']:>8.2f}x {t['default+live check'] / t['off']:>8.2f}x "
            f"{t['values'] / t['off']:>8.2f}x "
            f"{r['bytes_per_step']['default'] / 1024:>9.1f}",
            flush=True,
        )
        world *= 2


if __name__ == "__main__":
    main()
