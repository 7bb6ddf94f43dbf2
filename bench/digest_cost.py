"""What a step's digests cost in process, with and without the random-projection sketch, on the tensors the
recorder digests every step (each parameter's gradient, the parameter, Adam's exp_avg and exp_avg_sq and
its step counter), after one real forward/backward/AdamW step so the values are realistic.

    python bench/digest_cost.py [--repeats 15] [--set model.dim=768 ...] [--against REV] [--fused]

Models: the tiny default manifest's and a realistic CPU one (dim 512, 4 layers). With and without the
sketch are interleaved repeat by repeat, so machine noise hits both alike; prints median ms per step and
the ratio with / without the sketch (the sketch's share of the digest), in one run. One thread, as the
workers run. `--against REV` instead times this checkout's `digest_many` (what the recorder calls) against
run/record/digest.py as git revision REV had it, loaded beside it, a step's tensors each, interleaved repeat by
repeat, in CPU time (time.thread_time: the figure other jobs on shared cores disturb least), and prints the
ratio. `--fused` times digest_many with run/record/fused.py's compiled pass (numba, the `fast` extra) against the
numpy path (DISTTRACE_FUSED=0's) the same way, in one process, and checks the hashes are the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

REALISTIC = ["model.dim=512", "model.n_layers=4", "model.max_seq_len=256"]


def tensors_of_a_step(sets: list[str]):
    import torch

    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model, lm_loss

    m = freeze(ROOT / "manifests" / "default.toml", sets).manifest
    model = build_model(SimpleNamespace(**m["model"]), torch.float32, m["experiment"]["seed"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    seq, vocab = m["model"]["max_seq_len"], m["model"]["vocab_size"]
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=g)
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    out = []
    for p in model.parameters():
        out += [p.grad, p.detach(), *(v for v in opt.state[p].values() if torch.is_tensor(v))]
    n = sum(p.numel() for p in model.parameters())
    return (
        out,
        f"dim {m['model']['dim']}, {m['model']['n_layers']} layers, {n / 1e6:.2f}M parameters",
    )


def measure(tensors, repeats: int) -> dict[str, float]:
    from disttrace.run.record.digest import digest_tensor

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for with_sketch in (False, True):
            t = time.perf_counter()
            for x in tensors:
                digest_tensor(x, with_sketch=with_sketch)
            times[with_sketch].append(time.perf_counter() - t)
    # the median, and the best repeat (the figure the shared cores' noise disturbs least)
    return {
        "without": statistics.median(times[False]),
        "with": statistics.median(times[True]),
        "best without": min(times[False]),
        "best with": min(times[True]),
    }


def against(rev: str, sets: list[str], repeats: int) -> None:
    """This checkout's digest_many against REV's, on the realistic model's step tensors."""
    import cputime

    from disttrace.run.record import digestmany as now

    then = cputime.digest_at(rev)
    tensors, what = tensors_of_a_step(sets)
    items = [(t, None, None) for t in tensors]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    med = cputime.medians(
        {rev: lambda: then.digest_many(items), "this checkout": lambda: now.digest_many(items)},
        repeats,
    )
    a, b = med[rev], med["this checkout"]
    print(
        f"{what}; {len(tensors)} tensors, {mb:.1f} MB a step; {repeats} repeats, CPU time medians: "
        f"{rev} {a * 1e3:.1f} ms, this checkout {b * 1e3:.1f} ms, ratio {b / a:.3f}"
    )


def fused_against_numpy(sets: list[str], repeats: int) -> None:
    """digest_many with run/record/fused.py's compiled pass (numba) against the numpy path DISTTRACE_FUSED=0 keeps,
    on the realistic model's step tensors, in one process, interleaved: the hashes must be the same."""
    import cputime

    from disttrace.run.record import digest, digestmany

    kernel = digest._fused()
    if kernel is None:
        raise SystemExit("numba is not installed (the `fast` extra): nothing to compare")
    tensors, what = tensors_of_a_step(sets)
    items = [(t, None, None) for t in tensors]
    mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6

    def run(k):
        def go():
            digest._kernel = k
            return digestmany.digest_many(items)

        return go

    got = {name: run(k)() for name, k in (("numba", kernel), ("numpy", False))}
    pairs = list(zip(got["numba"], got["numpy"]))
    assert all(a["digest"] == b["digest"] for a, b in pairs), "the two paths' hashes differ"
    # the statistics are float32 sums in another order: equal to their rounding, not bit for bit
    rel = max(abs(a["norm"] - b["norm"]) / max(abs(b["norm"]), 1e-30) for a, b in pairs)
    med = cputime.medians({"numba": run(kernel), "numpy": run(False)}, repeats)
    a, b = med["numpy"], med["numba"]
    print(
        f"{what}; {len(tensors)} tensors, {mb:.1f} MB a step; {repeats} repeats, CPU time medians: "
        f"numpy path {a * 1e3:.1f} ms, numba's pass {b * 1e3:.1f} ms, ratio {b / a:.3f}; hashes equal, "
        f"norms within {rel:.1e} of each other"
    )


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="override the realistic model (section.key=value)",
    )
    ap.add_argument(
        "--against", metavar="REV", help="time digest_many against REV's run/record/digest.py"
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="time run/record/fused.py's numba pass against the numpy path",
    )
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.fused:
        fused_against_numpy(REALISTIC + args.set, max(args.repeats, 25))
        return
    if args.against:
        against(args.against, REALISTIC + args.set, max(args.repeats, 25))
        return
    for title, sets, reps in (
        ("tiny default model", [], args.repeats * 4),
        ("realistic CPU model", REALISTIC + args.set, args.repeats),
    ):
        tensors, what = tensors_of_a_step(sets)
        mb = sum(t.numel() * t.element_size() for t in tensors) / 1e6
        r = measure(tensors, reps)
        print(
            f"{title} ({what}; {len(tensors)} tensors, {mb:.1f} MB per step; {reps} repeats):",
            flush=True,
        )
        for label, (w, wo) in (
            ("median", (r["with"], r["without"])),
            ("best", (r["best with"], r["best without"])),
        ):
            w, wo = w * 1e3, wo * 1e3
            print(
                f"  {label:6s} digest without sketch {wo:7.2f} ms/step, with sketch {w:7.2f} ms/step, ratio "
                f"{w / wo:.3f} (the sketch {w - wo:6.2f} ms, {(w - wo) / w:.0%} of the digest)",
                flush=True,
            )


if __name__ == "__main__":
    main()
