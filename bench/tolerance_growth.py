"""How the difference between two equivalent runs grows with the steps since they last agreed: per step and
phase, the largest relative error diff measured (relative to the records' magnitudes when both runs
recorded them, else to their norms), divided by the one-step bound eps_1 of analysis/tolerance.py (the optimizer column includes parameters,
which have no bound under Adam: their errors are reported, never judged), and the largest err/bound of
any bounded record. The
compounding rule `tolerance.growth(k)` must stay above every figure printed here, for every equivalent pair
(bench/equivalence_sweep.py); this prints the measurement it was chosen from.

    python bench/tolerance_growth.py RUN_A RUN_B [--norm]   # --norm: as if no magnitudes were recorded
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrace.analysis import diff as diffmod  # noqa: E402
from disttrace.analysis import tolerance  # noqa: E402
from disttrace.store.rundir import Run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--norm", action="store_true", help="ignore the recorded magnitudes")
    args = ap.parse_args()
    if args.norm:
        from disttrace.analysis import magnitudes

        real = magnitudes.Magnitudes.__init__

        def without(self, run, since=0):
            real(self, run, since)
            self.available = False

        magnitudes.Magnitudes.__init__ = without
    d = diffmod.diff_runs(args.a, args.b, mode="numeric").to_dict()
    ma, mb = Run(args.a).manifest_doc, Run(args.b).manifest_doc
    eps1 = {p: tolerance.step_bound(ma, mb, p) for p in ("loss", "reduce", "clip", "optimizer")}
    entries = d["numeric"]["by_step"] + d["propagation"]
    print(f"scale: {d['tolerance'].get('scale')}; eps_1 = {eps1['reduce']:.3g}")
    print(
        f"{'step':>5} "
        + " ".join(f"{p + ' err/eps1':>18}" for p in eps1)
        + f" {'max err/bound':>14}   equal"
    )
    peak = dict.fromkeys(eps1, 0.0)
    for e in sorted(entries, key=lambda e: e["step"]):
        k = e["step"] - d["tolerance"].get("since_step", 0)
        cells = []
        for p in eps1:
            rel = max(
                (rs.get("max_rel_err_by_phase", {}).get(p, 0.0) for rs in e["ranks"].values()),
                default=0.0,
            )
            g = rel / eps1[p] if eps1[p] else 0.0
            peak[p] = max(peak[p], g / tolerance.growth(k))
            cells.append(f"{g:18.3g}")
        ratio = max((rs.get("max_ratio") or 0.0 for rs in e["ranks"].values()), default=0.0)
        print(f"{e['step']:>5} " + " ".join(cells) + f" {ratio:14.3g}   {e['equal']}")
    print("largest (err/eps_1) / growth(k): " + ", ".join(f"{p} {v:.3g}" for p, v in peak.items()))


if __name__ == "__main__":
    main()
