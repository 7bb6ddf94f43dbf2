"""Attached runs through the training libraries' callbacks, both directions of diff's verdict: pairs that
compute the same training must compare as one experiment and diff equal; a control that must diverge must
diverge. Each a 2-rank CPU/gloo DDP job under torchrun (Lightning strategy="ddp"; an HF Trainer).

    python bench/equivalence_attached.py [--out DIR] [--only lightning|hf]

Pairs (A against B, 3 optimizer steps each):
  lightning 2x4 ~ 1x8        accumulate_grad_batches x batch_size: 16 samples a step both
  lightning 2x4 ~ 1x8 skew   control: rank 1's learning rate off by 1e-3 relative (rank 0's manifest shows
                             the configured one, so only the numbers can tell)
  hf 2x4 ~ 1x8               gradient_accumulation_steps x per_device_train_batch_size
  hf 2x4 ~ 2x4 per-mb-mean   control: each micro-batch's loss its own token mean (the normalisation
                             huggingface/transformers pull request 34191 replaced)
  hf 2x4 ~ 1x8 skew          control: rank 1's learning rate off by 1e-3 relative

It prints a confusion table (false divergences, missed controls, refusals) and the margins: the largest
err/bound over every compared record of an equivalent pair, and the first divergence's err/bound of each
control. The bound is diff's default (derived unless a calibration exists).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from disttrace.analysis.diff import diff_runs  # noqa: E402
from disttrace.errors import BadInput  # noqa: E402

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"

PAIRS = [
    ("lightning", ("2", "4"), ("1", "8"), True),
    ("lightning", ("2", "4"), ("1", "8", "skew-lr"), False),
    ("hf", ("2", "4"), ("1", "8"), True),
    ("hf", ("2", "4"), ("2", "4", "mean-per-micro-batch"), False),
    ("hf", ("2", "4"), ("1", "8", "skew-lr"), False),
]
SCRIPTS = {"lightning": "lightning_train.py", "hf": "hf_train.py"}


def torchrun(script: str, out: Path, args: tuple[str, ...]) -> Path:
    proc = subprocess.run(
        [
            TORCHRUN,
            "--nproc-per-node",
            "2",
            str(ROOT / "tests" / "scripts" / script),
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
    )
    if proc.returncode != 0:
        sys.exit(f"{script} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def worst_ratio(d) -> float | None:
    ratios = [p.max_ratio for p in (d.numeric.by_phase.values() if d.numeric else ())]
    ratios = [r for r in ratios if r is not None]
    return max(ratios) if ratios else None


def first_ratio(d) -> str:
    f = d.first_divergence
    err, bound = (f.rel_err, f.bound) if f is not None else (None, None)
    if err is None:
        return "-"
    return f"{err / bound:.3g}" if bound else f"{err:.3g} (bound 0)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", choices=sorted(SCRIPTS), default=None)
    opts = ap.parse_args()
    out = Path(opts.out or tempfile.mkdtemp(prefix="equivalence-attached-"))
    made: dict[tuple, Path] = {}
    rows = []
    false_div = missed = refused = 0
    for lib, a, b, equivalent in PAIRS:
        if opts.only and lib != opts.only:
            continue
        for args in (a, b):
            if (lib, args) not in made:
                made[(lib, args)] = torchrun(SCRIPTS[lib], out / lib, args)
        name = f"{lib} {'x'.join(a[:2])} ~ {'x'.join(b[:2])}{' ' + b[2] if len(b) > 2 else ''}"
        try:
            d = diff_runs(made[(lib, a)], made[(lib, b)], mode="numeric")
        except BadInput as e:
            refused += 1
            rows.append((name, "equal" if equivalent else "diverge", f"REFUSED: {e}", "-", "-"))
            continue
        verdict = "equal" if d.equal else "diverge"
        f = d.first_divergence
        where = "-" if f is None else f"step {f.step} mb {f.micro_batch} {f.phase} {f.tensor}"
        if equivalent and not d.equal:
            false_div += 1
        if not equivalent and d.equal:
            missed += 1
        margin = worst_ratio(d) if equivalent else first_ratio(d)
        margin = f"{margin:.3g}" if isinstance(margin, float) else str(margin)
        rows.append((name, "equal" if equivalent else "diverge", verdict, where, margin))
    head = ("pair", "expected", "diff", "first divergence", "err/bound")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    eq = [float(r[4]) for r in rows if r[1] == "equal" and r[2] in ("equal", "diverge")]
    ctl = [r[4] for r in rows if r[1] == "diverge"]
    print(
        f"false divergences {false_div}, missed controls {missed}, refused pairs {refused}; "
        f"largest err/bound of an equivalent pair {max(eq) if eq else '-'}; "
        f"controls' first-divergence err/bound {', '.join(ctl) or '-'}"
    )
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
