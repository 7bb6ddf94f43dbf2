"""The readers' cost at scale: how `diff`, `check`, `verify`, `show` and `report` grow with ranks, steps and
records a rank-step (docs/design.md, "Where the readers' cost goes"; figures in docs/benchmarks.md).

Synthetic run stores, written with the recorder's own writer (store/trajectory.py's TrajectoryWriter, each step
index line sealed by store/seal.py's StepChain, COMPLETE holding the seal `verify` checks, replicas.json for
`check`, a step-time line per step for `show`); per point (ranks x steps x records):

  ref    the reference: reduced gradients and optimizer state equal on every rank, data and local gradients not
  same   ref's files again (hard links): no divergence
  early  ref with one bit of one digest changed at step 1 on the last rank (bits changed, statistics equal)
  late   the same at the last step
  noisy  every value rounded differently (~1e-12 relative, every digest different): a numeric diff reads and
         compares every record
  half   noisy's first half of the ranks as a run of half the data-parallel ranks and twice the accumulation:
         the diff across topologies

Each command runs through the CLI (`disttrace.cli`) in a fresh process, the import not timed, and prints:
wall seconds, peak RSS of that process and how much of it the command added (ru_maxrss before and after),
bytes read (read calls: /proc/self/io rchar; plus the size of each file the readers map, which a scan
pages in), and microseconds per record of one run. Then, per command, the growth exponent along each
curve: the least-squares slope of log(seconds) and of log(added memory) against log(ranks), log(steps) or
log(records); 1 is linear, a fixed cost pulls it below 1, above ~1.15 is a defect. Commands:

  diff-late    disttrace diff ref late        bitwise, by the index, to a divergence in the last step
  diff-early   disttrace diff ref early       the same at step 1, then propagation over every later step
  diff-none    disttrace diff ref same        nothing differs: every step skipped by the index
  numeric      disttrace diff ref noisy --mode numeric   every record read and held to the derived bound
  cross        disttrace diff ref half        numeric across topologies (logical tensors)
  check        disttrace check ref            the replica rules, every step of every rank
  verify       disttrace verify ref           every step's sha256, the chain, every file against the seal
  show         disttrace show ref             the summary (step index, step times, stragglers)
  report       disttrace report ref late      the HTML page (a diff and its rendering)

    python bench/scale.py                                  # the default curves: a few minutes on 2 cores
    python bench/scale.py --ranks 2,8,64,256,1024          # the ranks curve to 1,024 ranks
    python bench/scale.py --point 1024x100x1000 --commands diff-late,numeric,check   # one large point

Stores go to a temporary directory under /tmp (or --dir) and are deleted after each point (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from disttrace.store import seal  # noqa: E402
from disttrace.store.trajectory import SUFFIX, TrajectoryWriter  # noqa: E402

# per 1,000 records of a rank-step, the default run's mix (bench/diff_speed.py's)
PHASE_PLAN = [
    ("data", 1),
    ("forward", 24),
    ("loss", 1),
    ("backward", 300),
    ("reduce", 300),
    ("optimizer", 374),
]
REPLICATED = ("reduce", "optimizer")  # the same on every data-parallel rank (check's "agree" rules)
COMMANDS = (
    "diff-late",
    "diff-early",
    "diff-none",
    "numeric",
    "cross",
    "check",
    "verify",
    "show",
    "report",
)


def manifest(ranks: int, steps: int, accumulation: int = 1) -> dict:
    return {
        "experiment": {"name": "scale", "edition": "v1", "seed": 0, "description": ""},
        "data": {
            "path": "corpus.jsonl",
            "sha256": "a" * 64,
            "eval_percent": 10,
            "split_salt": "disttrace-v1",
        },
        "tokenizer": {"kind": "byte", "path": None, "sha256": "b" * 64},
        "model": {
            "dim": 256,
            "n_layers": 24,
            "n_heads": 8,
            "n_kv_heads": 8,
            "vocab_size": 4096,
            "max_seq_len": 256,
            "multiple_of": 32,
            "ffn_hidden": 704,
            "norm_eps": 1e-5,
            "rope_theta": 10000.0,
        },
        "parallelism": {
            "dp": ranks,
            "tp": 1,
            "pp": 1,
            "zero_stage": 0,
            "pp_schedule": "gpipe",
            "architecture": "allreduce",
            "staleness": 0,
            "world_size": ranks,
            "backend": "auto",
        },
        "training": {
            "steps": steps,
            "micro_batch_size": 4,
            "grad_accum_steps": accumulation,
            "lr": 1e-3,
            "optimizer": "adamw",
            "weight_decay": 0.0,
            "beta1": 0.9,
            "beta2": 0.95,
            "dtype": "float32",
        },
        "checkpoint": {"interval": 0},
        "debug": {"deterministic": True, "collective_timeout_s": 60.0},
        "eval": {"max_batches": 16, "batch_size": 4, "loss_rtol": 0.02},
    }


def templates(n: int) -> list[tuple[str, int, str]]:
    """(phase, index, tensor name) of the n records of a rank-step, in the recorder's order."""
    plan, total = [], 0
    for phase, k in PHASE_PLAN:
        k = max(1, round(k * n / 1000))
        plan.append([phase, k])
        total += k
    plan[-1][1] += n - total
    return [
        (
            phase,
            i,
            f"layers.{i // 4}.attention.w{'qkvo'[i % 4]}.weight" if phase != "data" else "inputs",
        )
        for phase, k in plan
        for i in range(k)
    ]


_M1, _M2, _M3 = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9


def step_records(step: int, rank: int, tmpl, noisy: bool = False) -> list[dict]:
    """One rank-step's records; noisy: every value off by ~1e-12 relative and every digest different (the
    data phase apart: the same token ids in any rounding)."""
    out = []
    for j, (phase, i, name) in enumerate(tmpl):
        who = 0 if phase in REPLICATED else rank
        d = (step * _M1 + who * _M2 + j * _M3 + 1) % (1 << 128)
        x = ((step * 1_000_003 + who * 7919 + j * 104_729) % 1_000_000) / 1e6
        s, nm, sk = x * 3.0 - 1.5, 10.0 + x, [x, -x, 2 * x, 0.5 - x]
        if noisy and phase != "data":
            e = 1e-12 * (1 + i % 7)
            d ^= 0x5555
            s, nm, sk = s * (1 + e), nm * (1 - e), [v * (1 + e) for v in sk]
        out.append(
            {
                "step": step,
                "micro_batch": 0,
                "phase": phase,
                "rank": rank,
                "index": i,
                "tensor": name,
                "dtype": "float32",
                "shape": [256, 256],
                "numel": 65536,
                "digest": format(d, "032x"),
                "sum": s,
                "norm": nm,
                "sketch": sk,
                "nonfinite": 0,
            }
        )
    return out


def _dod(recs: list[dict]) -> str:
    h = xxhash.xxh3_128()
    for r in recs:
        h.update(r["digest"].encode())
    return h.hexdigest()


class _Rank:
    """One rank's files of one store, written as the recorder writes them."""

    def __init__(self, run: Path, rank: int):
        self.run, self.rank = run, rank
        self.writer = TrajectoryWriter(run / f"trajectory/rank-{rank:05d}{SUFFIX}")
        self.chain = seal.StepChain(rank)
        self.index = bytearray()
        self.times = bytearray()

    def step(self, step: int, recs: list[dict]) -> None:
        offset = self.writer.offset
        blob = self.writer.write_step(recs)
        t0 = 10.0 * step
        entry = {
            "step": step,
            "offset": offset,
            "length": len(blob),
            "records": len(recs),
            "digest": _dod(recs),
            "time": {
                "start": t0,
                "collective_issue": t0 + 0.01 * (1 + self.rank % 3),
                "end": t0 + 1,
            },
        }
        self.index += orjson.dumps(self.chain.seal_entry(entry, blob)) + b"\n"
        self.times += orjson.dumps({"step": step, "seconds": 1.0}) + b"\n"

    def close(self) -> dict:
        self.writer.close()
        (self.run / f"trajectory/rank-{self.rank:05d}.steps.jsonl").write_bytes(bytes(self.index))
        (self.run / f"steps/rank-{self.rank:05d}.jsonl").write_bytes(bytes(self.times))
        return seal.rank_part(self.run, self.rank, self.chain.last, self.chain.steps)


def _shared(run: Path, m: dict, kind: str, fault: dict | None = None) -> None:
    for sub in ("trajectory", "steps"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    mid = xxhash.xxh3_128_hexdigest(orjson.dumps(m, option=orjson.OPT_SORT_KEYS)) * 2
    lock = {"manifest": m, "manifest_id": mid, "source": "bench", "overrides": [], "resolved": {}}
    (run / "manifest.lock.json").write_bytes(orjson.dumps(lock))
    (run / "run.json").write_bytes(orjson.dumps({"path": kind, "fault": fault, "resume": None}))
    ranks = m["parallelism"]["world_size"]
    groups = {"dp": [list(range(ranks))]}
    rules = [
        {"phase": "data", "dim": "dp", "relation": "differ"},
        {"phase": "reduce", "dim": "dp", "relation": "agree"},
        {"phase": "optimizer", "dim": "dp", "relation": "agree"},
    ]
    (run / "replicas.json").write_bytes(orjson.dumps({"groups": groups, "rules": rules}))
    where = [
        {
            "rank": r,
            "host": f"node{r // 8}",
            "node_rank": r // 8,
            "local_rank": r % 8,
            "coords": {"dp": r},
        }
        for r in range(ranks)
    ]
    topology = {"groups": groups, "mesh_dims": ["dp"], "mesh_shape": {"dp": ranks}, "ranks": where}
    (run / "topology.json").write_bytes(orjson.dumps(topology))


def _complete(run: Path, parts: list[dict]) -> None:
    (run / "COMPLETE").write_bytes(orjson.dumps({"seal": seal.build_seal(run, parts)}))


def _link_tree(src: Path, dst: Path, skip: set[str] = frozenset()) -> None:
    for p in src.rglob("*"):
        rel = p.relative_to(src)
        if p.is_dir():
            (dst / rel).mkdir(parents=True, exist_ok=True)
        elif str(rel) not in skip:
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(p, dst / rel)


def write_point(root: Path, ranks: int, steps: int, n: int, need: set[str]) -> dict:
    """The stores of one point; returns their paths and the planted coordinates."""
    tmpl = templates(n)
    runs = {k: root / k for k in ("ref", "same", "early", "late", "noisy", "half")}
    m = manifest(ranks, steps)
    _shared(runs["ref"], m, "reference")
    numeric = bool(need & {"numeric", "cross"})
    if numeric:
        _shared(runs["noisy"], m, "reference")
    parts = []
    for rank in range(ranks):
        ref = _Rank(runs["ref"], rank)
        noisy = _Rank(runs["noisy"], rank) if numeric else None
        for step in range(1, steps + 1):
            ref.step(step, step_records(step, rank, tmpl))
            if noisy is not None:
                noisy.step(step, step_records(step, rank, tmpl, noisy=True))
        parts.append(ref.close())
        if noisy is not None:
            noisy.close()
    _complete(runs["ref"], parts)
    _link_tree(runs["ref"], runs["same"])
    # one bit of one digest of the last rank, at step 1 and at the last step: that rank's files rewritten
    last, pos = ranks - 1, n // 2
    planted = {}
    for kind, at in (("early", 1), ("late", steps)):
        if f"diff-{kind}" not in need and not (kind == "late" and "report" in need):
            continue
        rel = {f"trajectory/rank-{last:05d}{SUFFIX}", f"trajectory/rank-{last:05d}.steps.jsonl"}
        rel |= {f"steps/rank-{last:05d}.jsonl", "COMPLETE", "run.json"}
        _link_tree(runs["ref"], runs[kind], rel)
        fault = {"name": "bench", "step": at, "rank": last}
        (runs[kind] / "run.json").write_bytes(
            orjson.dumps({"path": "fault", "fault": fault, "resume": None})
        )
        w = _Rank(runs[kind], last)
        for step in range(1, steps + 1):
            recs = step_records(step, last, tmpl)
            if step == at:
                r = recs[pos]
                recs[pos] = {**r, "digest": format(int(r["digest"], 16) ^ 1, "032x")}
                planted[kind] = [step, last, r["phase"], r["index"]]
            w.step(step, recs)
        w.close()
        (runs[kind] / "COMPLETE").write_bytes(b"{}")
    if "cross" in need:  # noisy's first half of the ranks, another topology (the same global batch)
        half = max(1, ranks // 2)
        _shared(runs["half"], manifest(half, steps, ranks // half), "reference")
        for rank in range(half):
            for rel in (
                f"trajectory/rank-{rank:05d}{SUFFIX}",
                f"trajectory/rank-{rank:05d}.steps.jsonl",
                f"steps/rank-{rank:05d}.jsonl",
            ):
                os.link(runs["noisy"] / rel, runs["half"] / rel)
        (runs["half"] / "COMPLETE").write_bytes(b"{}")
    if numeric:
        (runs["noisy"] / "COMPLETE").write_bytes(b"{}")
    return {"runs": {k: str(v) for k, v in runs.items()}, "planted": planted}


def argv_of(command: str, runs: dict, out: Path) -> tuple[list[str], tuple[int, ...]]:
    """The CLI's arguments and the exit codes it must end with."""
    r = runs
    return {
        "diff-late": (["diff", r["ref"], r["late"], "--json"], (1,)),
        "diff-early": (["diff", r["ref"], r["early"], "--json"], (1,)),
        "diff-none": (["diff", r["ref"], r["same"], "--json"], (0,)),
        "numeric": (["diff", r["ref"], r["noisy"], "--mode", "numeric", "--json"], (0,)),
        "cross": (["diff", r["ref"], r["half"], "--json"], (0,)),
        "check": (["check", r["ref"], "--json"], (0,)),
        "verify": (["verify", r["ref"], "--json"], (0,)),
        "show": (["show", r["ref"], "--json"], (0,)),
        "report": (["report", r["ref"], r["late"], "-o", str(out / "report.html")], (0, 1)),
    }[command]


def _rchar() -> int:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def child(argv: list[str]) -> None:
    """Run one CLI command in this (fresh) process, stdout to a file; print one JSON line on stderr's last line."""
    import contextlib
    import importlib
    import io

    from disttrace import cli
    from disttrace.store import safeio

    # what the commands import when they start, imported before the clock does: the cost measured is the
    # reading, not Python's import of the readers
    for name in (
        "disttrace.analysis.diff",
        "disttrace.analysis.consistency",
        "disttrace.analysis.facts",
        "disttrace.analysis.magnitudes",
        "disttrace.store.verify",
        "disttrace.report",
        "disttrace.views.diff",
        "disttrace.views.show",
        "disttrace.views.report",
        "disttrace.analysis.timeline",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass

    mapped = [0]
    real_mapped = safeio.mapped

    def counting(path, root):
        m = real_mapped(path, root)
        mapped[0] += len(m)
        return m

    safeio.mapped = counting
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = io.StringIO()
    sys.argv = ["disttrace", *argv]
    r0, t0 = _rchar(), time.perf_counter()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    dt = time.perf_counter() - t0
    read = _rchar() - r0 + mapped[0]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc = None
    try:
        doc = json.loads(out.getvalue())
    except ValueError:
        pass
    first = (doc or {}).get("first_divergence") if isinstance(doc, dict) else None
    sys.__stderr__.write(
        "\n"
        + json.dumps(
            {
                "code": code,
                "seconds": dt,
                "rss_mib": peak / 1024,
                "added_mib": (peak - base_rss) / 1024,
                "read_bytes": read,
                "first": [first[k] for k in ("step", "rank", "phase", "index")] if first else None,
            }
        )
        + "\n"
    )


def measure(command: str, point: dict, out: Path) -> dict:
    argv, codes = argv_of(command, point["runs"], out)
    p = subprocess.run(
        [sys.executable, __file__, "--child", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    try:
        r = json.loads(p.stderr.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SystemExit(f"{command}: the child printed no result:\n{p.stderr[-3000:]}") from None
    if r["code"] not in codes:
        raise SystemExit(f"{command}: exit {r['code']}, expected {codes}:\n{p.stderr[-3000:]}")
    kind = command.split("-")[-1]
    if command.startswith("diff-") and kind in point["planted"]:
        assert r["first"] == point["planted"][kind], (command, r["first"], point["planted"])
    return r


def slope(xs: list[float], ys: list[float]) -> float | None:
    pts = [(math.log(x), math.log(max(y, 1e-9))) for x, y in zip(xs, ys)]
    if len(pts) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def run_point(base: Path, ranks: int, steps: int, n: int, commands, keep: bool) -> dict:
    root = base / f"p{ranks}x{steps}x{n}"
    root.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        point = write_point(root, ranks, steps, n, set(commands))
        size = sum(p.stat().st_size for p in Path(point["runs"]["ref"]).glob("trajectory/*.arrows"))
        records = ranks * steps * n
        print(
            f"  {ranks:>5} ranks x {steps:>5} steps x {n:>5} records = {records:>12,} records a run, "
            f"{size / 2**20:9.1f} MiB a run; written in {time.perf_counter() - t0:6.1f} s",
            flush=True,
        )
        res = {}
        for c in commands:
            r = measure(c, point, root)
            res[c] = r
            print(
                f"      {c:<10} {r['seconds']:9.3f} s  {r['seconds'] / records * 1e6:8.3f} us/record  "
                f"peak RSS {r['rss_mib']:7.0f} MiB (+{r['added_mib']:6.0f})  read {r['read_bytes'] / 2**20:9.1f} MiB",
                flush=True,
            )
        return {"ranks": ranks, "steps": steps, "records": n, "bytes": size, "commands": res}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--ranks", type=_ints, default=[2, 8, 64], help="the ranks curve (steps 10, records 100)"
    )
    ap.add_argument(
        "--steps",
        type=_ints,
        default=[10, 100, 1000],
        help="the steps curve (2 ranks, records 100)",
    )
    ap.add_argument(
        "--records",
        type=_ints,
        default=[100, 1000, 5000],
        help="the records curve (2 ranks, 10 steps)",
    )
    ap.add_argument(
        "--base", default="2x10x100", help="RANKSxSTEPSxRECORDS each curve varies one of"
    )
    ap.add_argument("--point", default=None, help="one point only, RANKSxSTEPSxRECORDS (no curves)")
    ap.add_argument("--commands", default=",".join(COMMANDS), help=f"of: {', '.join(COMMANDS)}")
    ap.add_argument(
        "--dir", default=None, help="where to write the stores (default: a new directory in /tmp)"
    )
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child)
        return
    commands = [c for c in args.commands.split(",") if c]
    unknown = set(commands) - set(COMMANDS)
    if unknown:
        raise SystemExit(f"unknown commands {sorted(unknown)}; of: {', '.join(COMMANDS)}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="disttrace-scale-", dir="/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    r0, s0, n0 = (int(x) for x in args.base.split("x"))
    if args.point:
        curves = {"point": [tuple(int(x) for x in args.point.split("x"))]}
    else:
        curves = {
            "ranks": [(r, s0, n0) for r in args.ranks],
            "steps": [(r0, s, n0) for s in args.steps],
            "records": [(r0, s0, n) for n in args.records],
        }
    results: dict[str, list[dict]] = {}
    try:
        for name, pts in curves.items():
            print(f"{name}:", flush=True)
            results[name] = [run_point(base, *p, commands, args.keep) for p in pts]
    finally:
        if not args.keep and not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print("\ngrowth exponents (slope of log cost against log size; time / added memory):")
    dims = [d for d in ("ranks", "steps", "records") if len(results.get(d, [])) > 1]
    print(f"  {'command':<10} " + " ".join(f"{d:>16}" for d in dims))
    for c in commands:
        cells = []
        for d in dims:
            pts = results[d]
            xs = [p[d] for p in pts]
            t = slope(xs, [p["commands"][c]["seconds"] for p in pts])
            m = slope(xs, [max(p["commands"][c]["added_mib"], 1.0) for p in pts])
            cells.append(f"{t:7.2f} / {m:5.2f}  " if t is not None else f"{'-':>16}")
        print(f"  {c:<10} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
