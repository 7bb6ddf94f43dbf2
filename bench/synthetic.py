"""Synthetic run stores in the recorder's format, fast enough for 10^8 records a run (bench/scale.py,
bench/diff_speed.py, bench/diff_jobs.py and tests/test_diff_synthetic.py write theirs here).

What the readers see is what a recorder writes: each rank's trajectory through store/trajectory_write.py's
TrajectoryWriter (the layout, the per-step stream, the LZ4 framing), each step's index line sealed by
store/seal.py's StepChain (sha256, xxh3, the chain), COMPLETE holding the seal `verify` checks. A rank-step is
handed to the writer as one record batch (`TrajectoryWriter.write_batch`, the same encoding `write_step` ends
in): the columns that do not change from step to step (phase, index, tensor, dtype, shape) are encoded once,
by the writer's own column function on the records as dicts, and per rank-step only step, rank, digest, sum,
norm and sketch are built, from numpy arrays. `step_records` gives the same records as dicts; the test
`tests/test_trajectory.py::test_write_batch_*` holds the two paths to the same bytes.

Ranks are written in `jobs` processes (each rank's files are its own; the seal's parts come back to the
caller, which writes COMPLETE).

Values (per rank-step, record j of the template, `who` the rank or 0 for the replicated phases):
x = ((step * 1,000,003 + who * 7,919 + j * 104,729) mod 10^6) / 10^6, sum = 3x - 1.5, norm = 10 + x, sketch
(x, -x, 2x, 0.5 - x) in float32, digest two splitmix64 lanes of (step, who, j): distinct, incompressible like
a real one. Replicated phases (reduce, optimizer) are equal on every rank, data and local gradients differ.
`noisy`: every value but the data phase's off by ~1e-12 relative and every such digest different (what another
rounding gives): a numeric diff reads and compares every record.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import xxhash

from disttrace.store import scales as store_scales
from disttrace.store import seal
from disttrace.store.trajectory import SUFFIX
from disttrace.store.trajectory_write import TrajectoryWriter

# per 1,000 records of a rank-step, the default run's mix
PHASE_PLAN = [
    ("data", 1),
    ("forward", 24),
    ("loss", 1),
    ("backward", 300),
    ("reduce", 300),
    ("optimizer", 374),
]
REPLICATED = ("reduce", "optimizer")  # the same on every data-parallel rank (check's "agree" rules)

_BASE = {
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
        "dp": 2,
        "tp": 1,
        "pp": 1,
        "zero_stage": 0,
        "pp_schedule": "gpipe",
        "architecture": "allreduce",
        "staleness": 0,
        "world_size": 2,
        "backend": "auto",
    },
    "training": {
        "steps": 10,
        "micro_batch_size": 4,
        "grad_accum_steps": 1,
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


def manifest(
    ranks: int = 2, steps: int = 10, accumulation: int = 1, name: str = "scale", **over
) -> dict:
    """A data-parallel manifest; `over`: dotted overrides, e.g. manifest(**{"model.dim": 64})."""
    return overridden(
        _BASE,
        **{
            "experiment.name": name,
            "parallelism.dp": ranks,
            "training.steps": steps,
            "training.grad_accum_steps": accumulation,
            **over,
        },
    )


def overridden(m: dict, **over) -> dict:
    """A copy of manifest `m` with dotted overrides ({"parallelism.dp": 1}), its world size recomputed."""
    m = copy.deepcopy(m)
    for k, v in over.items():
        sec, key = k.split(".")
        m[sec][key] = v
    p = m["parallelism"]
    p["world_size"] = p["dp"] * p["tp"] * p["pp"]
    return m


def write_shared(
    run: Path,
    m: dict,
    kind: str = "reference",
    fault: dict | None = None,
    resume: dict | None = None,
    replicas: bool = True,
) -> None:
    """The files every rank's share: manifest.lock.json, run.json, and for a data-parallel world the replica
    rules (`check`) and the topology (`show`)."""
    for sub in ("trajectory", "steps"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    mid = xxhash.xxh3_128_hexdigest(orjson.dumps(m, option=orjson.OPT_SORT_KEYS)) * 2
    lock = {"manifest": m, "manifest_id": mid, "source": "bench", "overrides": [], "resolved": {}}
    (run / "manifest.lock.json").write_bytes(orjson.dumps(lock))
    (run / "run.json").write_bytes(orjson.dumps({"path": kind, "fault": fault, "resume": resume}))
    if not replicas:
        return
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


def complete(run: Path, parts: list | None) -> None:
    """COMPLETE, holding the seal over `parts` (seal.rank_part of every rank); None: no seal (a store of
    before the seal, which the readers still take)."""
    body = {} if parts is None else {"seal": seal.build_seal(run, parts).doc()}
    (run / "COMPLETE").write_bytes(orjson.dumps(body))


def digest_of_digests(digests: Iterable[str]) -> str:
    """The step index's `digest` (run/record/digest.py's, which imports torch: the readers' tests import none)."""
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


class RankFiles:
    """One rank's files of one store as the recorder writes them: the trajectory, its step index (each line
    sealed), the step times, optionally the gradient magnitudes (run/record/scales.py's lines)."""

    def __init__(self, run: Path, rank: int, sealed: bool = True, times: bool = True):
        self.run, self.rank = Path(run), rank
        self.writer = TrajectoryWriter(self.run / f"trajectory/rank-{rank:05d}{SUFFIX}")
        self.chain = seal.StepChain(rank) if sealed else None
        self.index = bytearray()
        self.times = bytearray() if times else None
        self.scales = bytearray()

    def step(self, step: int, data: list[dict] | pa.RecordBatch, time: dict | None = None) -> None:
        """One step: its records as dicts (`write_step`, the recorder's call) or as one record batch in the
        writer's layout (`write_batch`)."""
        offset = self.writer.offset
        if isinstance(data, pa.RecordBatch):
            blob = self.writer.write_batch(data)
            n = data.num_rows
            raw = data.column("digest").buffers()[1].to_pybytes()[: 16 * n]
            dod = xxhash.xxh3_128_hexdigest(raw.hex().encode())
        else:
            blob = self.writer.write_step(data)
            n = len(data)
            dod = digest_of_digests(r["digest"] for r in data)
        if time is None:
            t0 = 10.0 * step
            time = {
                "start": t0,
                "collective_issue": t0 + 0.01 * (1 + self.rank % 3),
                "end": t0 + 1,
            }
        entry = {
            "step": step,
            "offset": offset,
            "length": len(blob),
            "records": n,
            "digest": dod,
            "time": time,
        }
        if self.chain is not None:
            entry = self.chain.seal_entry(entry, blob)
        self.index += orjson.dumps(entry) + b"\n"
        if self.times is not None:
            self.times += orjson.dumps({"step": step, "seconds": 1.0}) + b"\n"

    def close(self) -> dict:
        """Close the files; returns this rank's part of the seal."""
        self.writer.close()
        (self.run / f"trajectory/rank-{self.rank:05d}.steps.jsonl").write_bytes(bytes(self.index))
        if self.scales:
            (self.run / f"trajectory/rank-{self.rank:05d}{store_scales.SUFFIX}").write_bytes(
                bytes(self.scales)
            )
        if self.times is not None:
            (self.run / "steps").mkdir(exist_ok=True)
            (self.run / f"steps/rank-{self.rank:05d}.jsonl").write_bytes(bytes(self.times))
        return seal.rank_part(
            self.run, self.rank, self.chain.last if self.chain else None, self.steps
        )

    @property
    def steps(self) -> int:
        return self.index.count(b"\n")


# ---------------------------------------------------------------- the records of a rank-step


def templates(n: int) -> list[tuple[str, int, str]]:
    """(phase, index, tensor name) of the n records of a rank-step, in the recorder's order."""
    if n < len(PHASE_PLAN):
        raise ValueError(f"{n} records a rank-step: at least one a phase, {len(PHASE_PLAN)}")
    plan = [[phase, max(1, round(k * n / 1000))] for phase, k in PHASE_PLAN]
    while sum(k for _, k in plan) > n:  # the rounding's excess taken from the largest phase
        max(plan, key=lambda p: p[1])[1] -= 1
    plan[-1][1] += n - sum(k for _, k in plan)
    return [
        (
            phase,
            i,
            f"layers.{i // 4}.attention.w{'qkvo'[i % 4]}.weight" if phase != "data" else "inputs",
        )
        for phase, k in plan
        for i in range(k)
    ]


_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


class Layout:
    """The n records of a rank-step: their constant columns, encoded once by the writer's own column
    function (for the writer's layout), and the values of any rank-step."""

    def __init__(self, n: int, writer: TrajectoryWriter | None = None):
        self.n = n
        self.tmpl = templates(n)
        self.phase = np.array([p for p, _, _ in self.tmpl])
        self.j = np.arange(n, dtype=np.int64)
        self.index = np.array([i for _, i, _ in self.tmpl], dtype=np.int64)
        self.replicated = np.isin(self.phase, REPLICATED)
        self.data = self.phase == "data"
        self.e = 1e-12 * (1 + self.index % 7)
        self._columns = None
        if writer is not None:
            first = writer.encode(self.records(1, 0))
            self._columns, self.schema = first.columns, first.schema
            self._at = {name: i for i, name in enumerate(self.schema.names)}

    def values(self, step: int, rank: int, noisy: bool = False, flip: int | None = None):
        """(digest as n x 16 big-endian bytes, sum, norm, sketch n x 4 float32) of one rank-step; `flip`:
        the position of the one record whose digest loses its lowest bit."""
        who = np.where(self.replicated, 0, rank).astype(np.int64)
        x = ((step * 1_000_003 + who * 7919 + self.j * 104_729) % 1_000_000) / 1e6
        s, nm = x * 3.0 - 1.5, 10.0 + x
        sk = np.stack([x, -x, 2 * x, 0.5 - x], axis=1)
        key = (
            (np.uint64(step) << np.uint64(40))
            ^ (who.astype(np.uint64) << np.uint64(20))
            ^ self.j.astype(np.uint64)
        )
        hi = _mix(key ^ np.uint64(0x9E3779B97F4A7C15))
        lo = _mix(key ^ np.uint64(0xC2B2AE3D27D4EB4F))
        if noisy:
            on = ~self.data
            e = np.where(on, self.e, 0.0)
            lo = np.where(on, lo ^ np.uint64(0x5555), lo)
            s, nm, sk = s * (1 + e), nm * (1 - e), sk * (1 + e)[:, None]
        if flip is not None:
            lo[flip] ^= np.uint64(1)
        digest = np.stack([hi, lo], axis=1).astype(">u8").tobytes()
        return digest, s, nm, sk.astype(np.float32)

    def records(
        self, step: int, rank: int, noisy: bool = False, flip: int | None = None
    ) -> list[dict]:
        """The rank-step's records as the recorder hands them to `write_step`."""
        digest, s, nm, sk = self.values(step, rank, noisy, flip)
        s, nm, sk = s.tolist(), nm.tolist(), sk.tolist()
        return [
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
                "digest": digest[16 * j : 16 * j + 16].hex(),
                "sum": s[j],
                "norm": nm[j],
                "sketch": sk[j],
                "nonfinite": 0,
            }
            for j, (phase, i, name) in enumerate(self.tmpl)
        ]

    def batch(
        self, step: int, rank: int, noisy: bool = False, flip: int | None = None
    ) -> pa.RecordBatch:
        """The same rank-step as one record batch in the writer's layout (`write_batch`)."""
        digest, s, nm, sk = self.values(step, rank, noisy, flip)
        n, cols, at = self.n, list(self._columns), self._at
        cols[at["step"]] = pa.array(np.full(n, step, np.uint32))
        cols[at["rank"]] = pa.array(np.full(n, rank, np.uint32))
        cols[at["digest"]] = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(16), n, [None, pa.py_buffer(digest)]
        )
        cols[at["sum"]] = pa.array(s)
        cols[at["norm"]] = pa.array(nm)
        cols[at["sketch"]] = pa.FixedSizeListArray.from_arrays(pa.array(sk.ravel()), 4)
        return pa.RecordBatch.from_arrays(cols, schema=self.schema)

    def scales_frame(self, step: int, norm: np.ndarray) -> bytes:
        """What run/record/scales.py writes for the step: each gradient's ||X|| ||dY|| (here 10x its norm)."""
        groups = []
        for phase in ("backward", "reduce"):
            at = np.flatnonzero(self.phase == phase)
            if len(at):
                groups.append((phase, 0, np.asarray(self.index)[at], 10 * np.asarray(norm)[at]))
        return store_scales.encode(step, groups, None)


# ---------------------------------------------------------------- whole stores, ranks in processes


@dataclass(frozen=True)
class Variant:
    """One store's rank files: `noisy` values, a digest bit flipped at (step, position) on rank `flip_rank`
    (None: the last rank), only `ranks` (None: all), with the gradient magnitudes (`scales`)."""

    run: str
    noisy: bool = False
    flip: tuple[int, int] | None = None
    flip_rank: int | None = None
    ranks: tuple[int, ...] | None = None
    scales: bool = False


def planted(n: int, step: int, rank: int, pos: int) -> list:
    """The coordinates diff reports for a flip at `pos`: [step, rank, phase, index]."""
    phase, index, _ = templates(n)[pos]
    return [step, rank, phase, index]


def _write_ranks(variants: list[Variant], ranks: list[int], world: int, steps: int, n: int):
    parts: list[dict[int, dict]] = [{} for _ in variants]
    for rank in ranks:
        files = {}
        for k, v in enumerate(variants):
            if v.ranks is None or rank in v.ranks:
                files[k] = RankFiles(Path(v.run), rank)
        if not files:
            continue
        layout = Layout(n, next(iter(files.values())).writer)
        for step in range(1, steps + 1):
            for k, f in files.items():
                v = variants[k]
                at = v.flip_rank if v.flip_rank is not None else world - 1
                flip = v.flip[1] if v.flip and v.flip[0] == step and rank == at else None
                f.step(step, layout.batch(step, rank, v.noisy, flip))
                if v.scales:
                    f.scales += layout.scales_frame(step, layout.values(step, rank, v.noisy)[2])
        for k, f in files.items():
            parts[k][rank] = f.close()
    return parts


def write_ranks(
    variants: list[Variant], world: int, steps: int, n: int, jobs: int | None = None
) -> list[list[dict]]:
    """Every rank's files of every variant (write_shared first); returns each variant's seal parts, by rank.
    `jobs` processes (default: 2, or 1 for a small store)."""
    wanted = sorted({r for v in variants for r in (v.ranks or range(world))})
    if jobs is None:
        jobs = 1 if len(wanted) * steps * n < 2_000_000 else min(2, os.cpu_count() or 1)
    if jobs <= 1:
        got = [_write_ranks(variants, wanted, world, steps, n)]
    else:
        chunk = max(1, len(wanted) // (8 * jobs))
        pieces = [wanted[i : i + chunk] for i in range(0, len(wanted), chunk)]
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            got = list(
                pool.map(_write_ranks, *zip(*[(variants, p, world, steps, n) for p in pieces]))
            )
    out: list[dict[int, dict]] = [{} for _ in variants]
    for g in got:
        for k, d in enumerate(g):
            out[k].update(d)
    return [[d[r] for r in sorted(d)] for d in out]


def _main() -> None:
    """What a rank-step costs to write both ways, in one run: records as dicts through `write_step` (the
    recorder's call, what the benches did before) against one batch through `write_batch`; the same bytes."""
    import argparse
    import tempfile
    import time

    ap = argparse.ArgumentParser(description=_main.__doc__)
    ap.add_argument("--records", type=int, default=1000, help="records a rank-step")
    ap.add_argument("--steps", type=int, default=100, help="rank-steps written each way")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = {}
        for way in ("records", "batch"):
            f = RankFiles(Path(d) / way, 0)
            layout = Layout(args.records, f.writer)
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(1, args.steps + 1):
                f.step(s, layout.records(s, 3) if way == "records" else layout.batch(s, 3))
            out[way] = (time.perf_counter() - t0, time.process_time() - c0)
            f.close()
        same = (Path(d) / "records/trajectory/rank-00000.arrows").read_bytes() == (
            Path(d) / "batch/trajectory/rank-00000.arrows"
        ).read_bytes()
    for way, (wall, cpu) in out.items():
        print(
            f"{way:>8}: {wall / args.steps * 1e3:7.2f} ms wall, {cpu / args.steps * 1e3:7.2f} ms CPU "
            f"a rank-step of {args.records} records"
        )
    ratio = out["records"][1] / out["batch"][1]
    print(f"batch {ratio:.1f}x the speed of records by CPU time; the same bytes: {same}")


if __name__ == "__main__":
    _main()
