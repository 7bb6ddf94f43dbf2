"""Both directions of diff's numeric verdict, measured: pairs of runs that compute the same training (another
layout of the same global batch, same seed and data order) must compare equal against dp=1, and planted
controls must diverge. Prints a confusion table and the margins: the largest err/bound of any equivalent
pair (below 1: equal) and the smallest of any control (above 1: divergent).

    python bench/equivalence_sweep.py                      # the default sample (a few minutes)
    python bench/equivalence_sweep.py --full               # every pair x every model (long)
    python bench/equivalence_sweep.py --models deep --pairs "dp=2 x accum 2" --controls ""
    python bench/equivalence_sweep.py --calibrate          # also under the reference's calibrated bound

The reference is dp=1, micro-batch 4, accumulation 4 (16 sequences a step). Controls run dp=2 x accumulation
2 with one fault at step 2 on rank 1 and are compared with the same reference, numerically, as a user
comparing a new layout would. With --calibrate the reference is run by `disttrace run --calibrate` (its
measured noise, per step, phase and tensor class, written beside it) and every case is compared twice: under
the derived bound (`find_calibration=False`) and under the calibrated one (found beside the reference, as
diff does by default); both confusion tables are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrace.analysis.diff import diff_runs  # noqa: E402

BASE = ["training.micro_batch_size=4", "parallelism.dp=1", "training.grad_accum_steps=4"]
PAIRS = {
    "dp=2 x accum 2": ["parallelism.dp=2", "training.grad_accum_steps=2"],
    "dp=1 x accum 4 (repeat)": [],
    "micro-batch 8, no accum": [
        "parallelism.dp=2",
        "training.micro_batch_size=8",
        "training.grad_accum_steps=1",
    ],
    "ZeRO-1": ["parallelism.dp=2", "training.grad_accum_steps=2", "parallelism.zero_stage=1"],
    "ZeRO-2": ["parallelism.dp=2", "training.grad_accum_steps=2", "parallelism.zero_stage=2"],
    "ZeRO-3": ["parallelism.dp=2", "training.grad_accum_steps=2", "parallelism.zero_stage=3"],
    "tp=2": ["parallelism.tp=2"],
    "pp=2 1f1b": ["parallelism.pp=2", 'parallelism.pp_schedule="1f1b"'],
    "dp2 x tp2": ["parallelism.dp=2", "parallelism.tp=2", "training.grad_accum_steps=2"],
}
MODELS = {
    "default": ["training.steps=6"],
    "deep-narrow": [
        "model.dim=32",
        "model.n_layers=24",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.max_seq_len=32",
        "training.steps=16",
    ],
    "wide": ["model.dim=256", "training.steps=4"],
    "long": ["training.steps=100"],
}
# (name, fault, params): fired at step 2 on rank 1 of a dp=2 x accumulation 2 run. NOISE: controls that no
# sound bound on a tensor's aggregate statistics can tell from the rounding of another layout (see
# docs/tolerance.md, "What cannot be seen"): counted apart, never by loosening or tightening anything.
NOISE = {"bit 10 flipped, one gradient element"}
CONTROLS = {
    "bf16 all-reduce": ("bf16-reduce", []),
    "lr x (1 + 1e-3), one rank": ("lr-skew", ["k=1.001"]),
    "loss x (1 + 1e-4), one micro-batch": ("loss-scale", ["factor=1.0001", "micro_batch=0"]),
    "bit 10 flipped, one gradient element": (
        "bitflip-grad",
        ["bit=10", "tensor=layers.0.feed_forward.w1.weight"],
    ),
}
CONTROL_BASE = ["parallelism.dp=2", "training.grad_accum_steps=2"]
SAMPLE = {
    "models": ["default", "deep-narrow"],
    "pairs": ["dp=2 x accum 2", "micro-batch 8, no accum", "ZeRO-1", "tp=2", "pp=2 1f1b"],
    "controls": list(CONTROLS),
}


def launch(out: Path, sets: list[str], fault: tuple | None = None, calibrate: bool = False) -> Path:
    args = [a for s in sets for a in ("--set", s)]
    cmd = [sys.executable, "-m", "disttrace"]
    if fault is None:
        cmd += ["run", "manifests/default.toml", *args] + (["--calibrate"] if calibrate else [])
    else:
        name, params = fault
        cmd += ["inject", "manifests/default.toml", "--fault", name, "--step", "2", "--rank", "1"]
        cmd += [a for p in params for a in ("--param", p)] + args
    proc = subprocess.run(
        [*cmd, "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if (
        proc.returncode == 2
    ):  # a layout this model cannot take (tp must divide the heads): not a result
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "bad input"
    if proc.returncode:
        raise SystemExit(f"run failed ({sets} {fault}):\n{proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def worst(d: dict) -> tuple[float, dict | None]:
    """The largest err/bound of a diff, and where (first divergence first: it is what the verdict names)."""
    best, at = 0.0, None
    for phase, v in (d.get("numeric", {}) or {}).get("by_phase", {}).items():
        r = v.get("max_ratio")
        if r is not None and r > best:
            best, at = r, {"phase": phase, **(v.get("max_ratio_at") or {})}
    f = d.get("first_divergence")
    if f and f.get("bound"):
        if f.get("rel_err") is not None and f["rel_err"] / f["bound"] >= best:
            best = f["rel_err"] / f["bound"]
            at = {k: f.get(k) for k in ("step", "phase", "rank", "tensor", "rel_err", "bound")}
    if f and f.get("rel_err") is None:  # missing, non-finite, a replica that differs: no ratio
        best, at = float("inf"), {k: f.get(k) for k in ("step", "phase", "rank", "tensor", "note")}
    return best, at


def _first(d: dict) -> dict | None:
    f = d["first_divergence"]
    keys = ("step", "phase", "rank", "tensor", "rel_err", "bound", "bound_kind")
    return {k: f.get(k) for k in keys} if f else None


def _table(rows: list[dict], title: str) -> None:
    """The confusion table and the margins of `rows` (each with equivalent, equal, worst_ratio)."""
    eq = [r for r in rows if r["equivalent"]]
    ct = [r for r in rows if not r["equivalent"] and not r["noise_floor"]]
    floor = [r for r in rows if r["noise_floor"]]
    print()
    print(f"{title}:")
    print("                      verdict equal   verdict divergent")
    print(
        f"equivalent pairs      {sum(r['equal'] for r in eq):13d}   {sum(not r['equal'] for r in eq):17d}"
        "   (false divergences: right column)"
    )
    print(
        f"controls              {sum(r['equal'] for r in ct):13d}   {sum(not r['equal'] for r in ct):17d}"
        "   (missed controls: left column)"
    )
    if eq:
        w = max(eq, key=lambda r: r["worst_ratio"])
        print(
            f"largest err/bound of an equivalent pair: {w['worst_ratio']:.3g} ({w['model']}, {w['case']})"
        )
    if ct:
        w = min(ct, key=lambda r: r["worst_ratio"])
        print(
            f"smallest err/bound of a control:         {w['worst_ratio']:.3g} ({w['model']}, {w['case']})"
        )
    for r in floor:
        print(
            f"below the noise floor of any sound bound ({r['model']}, {r['case']}): "
            f"{'equal' if r['equal'] else 'divergent'}, err/bound {r['worst_ratio']:.3g}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--full", action="store_true", help="every pair x every model, every control")
    ap.add_argument("--models", help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--pairs", help="comma-separated (';' also): " + "; ".join(PAIRS))
    ap.add_argument("--controls", help="semicolon-separated: " + "; ".join(CONTROLS))
    ap.add_argument("--control-models", default="default", help="models the controls run on")
    ap.add_argument("--steps", type=int, help="override every model's training.steps")
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--out", help="keep the runs here (default: a temporary directory)")
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="calibrate each reference (run --calibrate) and compare under both bounds",
    )
    args = ap.parse_args()
    pick = {"models": list(MODELS), "pairs": list(PAIRS), "controls": list(CONTROLS)}
    if not args.full:
        pick = {k: list(v) for k, v in SAMPLE.items()}
    if args.models:
        pick["models"] = args.models.split(",")
    if args.pairs is not None:
        pick["pairs"] = [p for p in args.pairs.split(";") if p]
    if args.controls is not None:
        pick["controls"] = [c for c in args.controls.split(";") if c]
    control_models = [m for m in args.control_models.split(",") if m]
    models = {
        k: [*v, f"training.steps={args.steps}"] if args.steps else v for k, v in MODELS.items()
    }

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.out or tmp)
        for model in pick["models"]:
            t0 = time.time()
            base = launch(out, [*BASE, *models[model]], calibrate=args.calibrate)
            cases = [(p, PAIRS[p], None, True) for p in pick["pairs"]]
            if model in control_models:
                cases += [(c, CONTROL_BASE, CONTROLS[c], False) for c in pick["controls"]]
            for name, sets, fault, equivalent in cases:
                t = time.time()
                r = launch(out, [*BASE, *models[model], *sets], fault)
                if isinstance(r, str):
                    print(f"{model:12} {name:38} n/a: {r}", flush=True)
                    continue
                d = diff_runs(base, r, mode="numeric", find_calibration=False).to_dict()
                ratio, at = worst(d)
                cal = None
                if args.calibrate:
                    dc = diff_runs(base, r, mode="numeric").to_dict()
                    assert dc["tolerance"]["kind"] == "calibrated", dc["tolerance"]
                    cal = {
                        "equal": dc["equal"],
                        "correct": dc["equal"] == equivalent or name in NOISE,
                        "worst_ratio": worst(dc)[0],
                        "at": worst(dc)[1],
                        "first_divergence": _first(dc),
                    }
                row = {
                    "model": model,
                    "case": name,
                    "equivalent": equivalent,
                    "equal": d["equal"],
                    "correct": d["equal"] == equivalent or name in NOISE,
                    "noise_floor": name in NOISE,
                    "worst_ratio": ratio,
                    "at": at,
                    "first_divergence": _first(d),
                    "scale": d["tolerance"].get("scale"),
                    "calibrated": cal,
                    "seconds": round(time.time() - t, 1),
                }
                rows.append(row)
                fd = row["first_divergence"]
                print(
                    f"{model:12} {name:38} {'equiv' if equivalent else 'control':7} "
                    f"{'equal' if d['equal'] else 'DIVERGED':8} {'ok' if row['correct'] else 'WRONG':5} "
                    f"err/bound {ratio:9.3g}"
                    + (f"  first: step {fd['step']} {fd['phase']} {fd['tensor']}" if fd else "")
                    + (
                        f"  | calibrated: {'equal' if cal['equal'] else 'DIVERGED'} "
                        f"{'ok' if cal['correct'] else 'WRONG'} err/bound {cal['worst_ratio']:.3g}"
                        if cal
                        else ""
                    ),
                    flush=True,
                )
            print(f"  ({model}: {time.time() - t0:.0f} s)", flush=True)

    _table(rows, "derived bound")
    if args.calibrate:
        _table(
            [{**r, **r["calibrated"]} for r in rows if r.get("calibrated")],
            "calibrated bound (the reference's calibration.json)",
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    if any(
        not r["correct"] or (r.get("calibrated") and not r["calibrated"]["correct"]) for r in rows
    ):
        sys.exit(1)


if __name__ == "__main__":
    main()
