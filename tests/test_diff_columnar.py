"""The column-wise comparison (analysis/columnar.py) against the record path it replaces, as the oracle.

The same records are written twice: as an Arrow stream (diff compares aligned steps column-wise) and as the
JSON lines of a store written before it (diff compares them record by record, the original code). Every
record is perturbed by a random relative amount around the bound (some bit-equal, some within, some beyond),
with float32 and float64 tensors and their sketches, scalars, non-finite values, a changed shape and a
missing record (an unaligned step: the record path again). The result documents must be identical in every
mode: bitwise, numeric with the derived bound, numeric with a user's rtol/atol.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import test_diff_synthetic as syn

from disttrace.analysis.diff import diff_runs

TENSORS = [
    ("tok_embeddings.weight", [256, 64], "float32"),
    ("layers.0.attention.wq.weight", [64, 64], "float32"),
    ("layers.0.feed_forward.w1.weight", [192, 64], "float64"),
    ("norm.weight", [64], "float32"),
    ("loss_scale", [], "float32"),
    (
        "output.weight",
        [512, 64],
        "float32",
    ),  # > FLOAT64_STATS: its norm and sum round in float32 runs
]
PHASES = ["backward", "reduce", "optimizer"]


def _rec(rng, step, phase, rank, index, name, shape, dtype) -> dict:
    numel = math.prod(shape) if shape else 1
    norm = rng.uniform(0.5, 20.0)
    sketch = [rng.uniform(-1, 1) * norm * math.sqrt(numel) for _ in range(4)]
    if (
        dtype == "float32"
    ):  # what the Arrow store keeps of a float32-computed sketch: its float32 rounding
        sketch = [float(np.float32(v)) for v in sketch]
    return {
        "step": step,
        "micro_batch": 0,
        "phase": phase,
        "rank": rank,
        "index": index,
        "tensor": name,
        "dtype": dtype,
        "shape": list(shape),
        "numel": numel,
        "sum": rng.uniform(-5, 5),
        "norm": norm,
        "sketch": sketch,
        "nonfinite": 0,
    }


def _perturbed(rng, r: dict) -> dict:
    e = rng.choice([0.0, 0.0, 1e-10, 1e-8, 3e-7, 1e-6, 1e-5, 1e-3])
    if e == 0.0:
        return dict(r)
    f = lambda v: v * (1 + e * rng.uniform(-1, 1))  # noqa: E731
    out = {**r, "sum": f(r["sum"]), "norm": f(r["norm"]), "sketch": [f(v) for v in r["sketch"]]}
    if r["dtype"] == "float32":
        out["sketch"] = [float(np.float32(v)) for v in out["sketch"]]
    return out


def _runs(seed: int):
    rng = random.Random(seed)
    m = syn.manifest(**{"training.steps": 4})
    a, b = {}, {}
    for rank in (0, 1):
        ra, rb = [], []
        for step in range(1, 5):
            for phase in PHASES:
                for i, (name, shape, dtype) in enumerate(TENSORS):
                    for slot in ("",) if phase != "optimizer" else ("", ":exp_avg", ":exp_avg_sq"):
                        x = _rec(rng, step, phase, rank, len(ra) % 1000, name + slot, shape, dtype)
                        x["index"] = i * 3 + ("", ":exp_avg", ":exp_avg_sq").index(slot)
                        y = _perturbed(rng, x)
                        for rec in (x, y):
                            rec["digest"] = (
                                syn.digest(rec)
                                if rec is x or rec["sum"] != x["sum"]
                                else x["digest"]
                            )
                        ra.append(x)
                        rb.append(y)
        a[rank], b[rank] = ra, rb
    # the record path's special cases, each on a step of its own rank
    k = next(
        i for i, r in enumerate(b[0]) if r["step"] == 2 and r["phase"] == "reduce" and r["shape"]
    )
    b[0][k] = {
        **b[0][k],
        "sum": None,
        "norm": None,
        "nonfinite": 3,
        "digest": "0" * 32,
    }  # non-finite
    k = next(
        i
        for i, r in enumerate(b[1])
        if r["step"] == 3 and r["phase"] == "backward" and len(r["shape"]) == 2
    )
    b[1][k] = {
        **b[1][k],
        "shape": list(reversed(b[1][k]["shape"])),
        "digest": "1" * 32,
    }  # a shape that differs
    k = next(i for i, r in enumerate(b[1]) if r["step"] == 4 and r["phase"] == "optimizer")
    del b[1][k]  # a record missing: that step does not align
    return m, a, b


def _write(tmp_path, fmt: str, m, a, b):
    syn.FORMAT["suffix"] = fmt
    try:
        return (
            syn.write_run(tmp_path / f"{fmt[1:]}-a", m, a),
            syn.write_run(tmp_path / f"{fmt[1:]}-b", m, b),
        )
    finally:
        syn.FORMAT["suffix"] = ".arrows"


def _comparable(result) -> dict:
    doc = result.to_dict()
    out = {k: v for k, v in doc.items() if k not in ("a", "b", "warnings")}
    out["stats"] = {k: v for k, v in doc["stats"].items() if k != "steps_hash_checked"}
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize(
    "kw",
    [{}, {"mode": "numeric"}, {"mode": "numeric", "rtol": 2e-6, "atol": 1e-9}],
    ids=["bitwise", "numeric-derived", "numeric-user"],
)
def test_columns_and_records_give_the_same_result(tmp_path, seed, kw):
    m, a, b = _runs(seed)
    arrow = diff_runs(*_write(tmp_path, ".arrows", m, a, b), **kw)
    jsonl = diff_runs(*_write(tmp_path, ".jsonl", m, a, b), **kw)
    assert _comparable(arrow) == _comparable(jsonl)
    # the comparison had something to find: inexact records in every mode, and divergences
    assert arrow.stats.tensors_compared > arrow.stats.bit_equal > 0
    assert arrow.first_divergence is not None
    if kw.get("mode") == "numeric":
        within = sum(
            e.ranks[r].inexact - e.ranks[r].differing for e in arrow.propagation for r in e.ranks
        )
        assert within > 0  # some records differ within the bound: compared, not flagged


def _cross_topology_runs(seed: int):
    """A: dp=2, B: dp=4 with half the micro-batch (same global batch). Replicated tensors: each of B's copies
    is compared with A's lowest rank's. Planted: a replica of A that differs (a warning), a tensor only A has,
    one only B has, a phase only A records."""
    rng = random.Random(seed)
    ma = syn.manifest(**{"training.steps": 3})
    mb = syn.manifest(**{"training.steps": 3, "parallelism.dp": 4, "training.micro_batch_size": 2})
    a = {r: [] for r in range(2)}
    b = {r: [] for r in range(4)}
    for step in range(1, 4):
        for phase in ("reduce", "clip", "optimizer"):
            for i, (name, shape, dtype) in enumerate(TENSORS):
                x = _rec(rng, step, phase, 0, i, name, shape, dtype)
                x["digest"] = syn.digest(x)
                for r in range(2):
                    if (
                        phase == "clip" or name != "norm.weight" or step != 2
                    ):  # norm.weight at step 2: only B's
                        a[r].append({**x, "rank": r})
                if phase == "clip":
                    continue  # a phase only A records
                for r in range(4):
                    if name == "loss_scale" and step == 3:
                        continue  # only A's
                    y = _perturbed(rng, x)
                    y["digest"] = x["digest"] if y["sum"] == x["sum"] else syn.digest(y)
                    b[r].append({**y, "rank": r})
    odd = next(i for i, r in enumerate(a[1]) if r["step"] == 1 and r["phase"] == "optimizer")
    a[1][odd] = {
        **a[1][odd],
        "digest": "2" * 32,
    }  # A's replicas disagree: warned, A's rank 0 copy is the value
    for recs in list(a.values()) + list(b.values()):
        recs.sort(
            key=lambda r: (r["step"], r["micro_batch"], syn.PHASE_ORDER[r["phase"]], r["index"])
        )
    return ma, mb, a, b


def _in_both_formats(tmp_path, ma, a, mb, b):
    """(suffix, run A, run B): the records written as Arrow stores, then as JSON-lines stores (whose diff
    takes the record path: the columns' oracle)."""
    for fmt in (".arrows", ".jsonl"):
        syn.FORMAT["suffix"] = fmt
        try:
            ra = syn.write_run(tmp_path / f"{fmt[1:]}-a", ma, a)
            rb = syn.write_run(tmp_path / f"{fmt[1:]}-b", mb, b)
        finally:
            syn.FORMAT["suffix"] = ".arrows"
        yield fmt, ra, rb


@pytest.mark.parametrize("seed", [4, 5])
@pytest.mark.parametrize("kw", [{}, {"rtol": 2e-6, "atol": 1e-9}], ids=["derived", "user"])
def test_cross_topology_columns_and_records_give_the_same_result(tmp_path, seed, kw):
    ma, mb, a, b = _cross_topology_runs(seed)
    docs = {}
    for fmt, ra, rb in _in_both_formats(tmp_path, ma, a, mb, b):
        docs[fmt] = diff_runs(ra, rb, **kw)
    arrow, jsonl = docs[".arrows"], docs[".jsonl"]
    assert arrow.mode == "numeric" and not arrow.topology.same
    assert _comparable(arrow) == _comparable(jsonl)
    assert arrow.warnings == jsonl.warnings
    assert any("records no 'clip' phase" in w for w in arrow.warnings)
    assert any("copy differs" in w for w in arrow.warnings)
    missing = [e for e in arrow.propagation for r in e.ranks.values() if r.hard]
    assert arrow.first_divergence is not None and missing


def _split(rng, x: dict, k: int, parts=None) -> list[dict]:
    """x cut along dim 0 into k shards whose sums, squared norms and sketches add up to x's."""
    shape = x["shape"]
    rows = [shape[0] // k] * (k - 1) + [shape[0] - shape[0] // k * (k - 1)]
    w = parts or [rng.uniform(0.2, 1.0) for _ in range(k)]
    w = [v / sum(w) for v in w]
    out, at = [], 0
    for j in range(k):
        sshape = [rows[j], *shape[1:]]
        sk = [v * w[j] for v in x["sketch"]]
        if x["dtype"] == "float32":
            sk = [float(np.float32(v)) for v in sk]
        sh = {
            **x,
            "shape": sshape,
            "numel": math.prod(sshape),
            "sum": x["sum"] * w[j],
            "norm": x["norm"] * math.sqrt(w[j]),
            "sketch": sk,
            "shard": {"offset": [at] + [0] * (len(shape) - 1), "logical_shape": list(shape)},
        }
        sh["digest"] = syn.digest(sh)
        out.append(sh)
        at += rows[j]
    return out


def _sharded_runs(seed: int):
    """A: tp=2 x dp=2 (4 ranks), each tensor whole on every rank, or in 2 or 3 shards (a shard on two ranks:
    a replicated shard); B: dp=2, each tensor whole on both ranks or in the same 2 shards as A's (bit-equal
    where B's values are A's). Planted: a replicated shard of A that differs, a shard A lost (its tensor not
    covered), a non-finite shard on B, a tensor only A has, one only B has."""
    rng = random.Random(seed)
    ma = syn.manifest(**{"training.steps": 3, "parallelism.tp": 2})
    mb = syn.manifest(**{"training.steps": 3})
    a = {r: [] for r in range(4)}
    b = {r: [] for r in range(2)}
    tensors = [t for t in TENSORS if t[1]]  # scalars are not sharded
    for step in range(1, 4):
        for phase in ("reduce", "clip", "optimizer"):
            for i, (name, shape, dtype) in enumerate(tensors):
                k = (i + step) % 3 + 1
                x = _rec(rng, step, phase, 0, i, name, shape, dtype)
                x["digest"] = syn.digest(x)
                shards = _split(rng, x, k) if k > 1 else [x]
                for r in range(4):
                    if name == "norm.weight" and step == 3 and phase == "reduce":
                        continue  # only B's
                    sh = shards[r % k] if k < 4 else shards[r]
                    if step == 2 and phase == "optimizer" and k == 2 and r % k == 1:
                        continue  # A's last shard lost: the tensor is not covered
                    a[r].append({**sh, "rank": r})
                if step == 1 and phase == "reduce" and k > 1:
                    bad = next(
                        j for j, y in enumerate(a[3]) if y["tensor"] == name and y["step"] == 1
                    )
                    a[3][bad] = {**a[3][bad], "digest": "3" * 32}  # differs from its lower copy
                if name == "output.weight" and step == 2:
                    continue  # only A's
                y = _perturbed(rng, x) if (i + step) % 4 else x
                if y is not x:
                    y["digest"] = x["digest"] if y["sum"] == x["sum"] else syn.digest(y)
                halves = (i + step) % 2 == 0
                if halves and y is x and k == 2:
                    yb = shards  # the same shards as A's: bit-equal
                elif halves:
                    yb = _split(rng, y, 2)
                else:
                    yb = [y, y]
                for r in range(2):
                    rec = dict(yb[r], rank=r)
                    if step == 3 and phase == "optimizer" and i == 0 and r == 1:
                        rec.update(sum=None, norm=None, nonfinite=2)
                        rec["digest"] = syn.digest(rec)
                    b[r].append(rec)
    for recs in list(a.values()) + list(b.values()):
        recs.sort(
            key=lambda r: (r["step"], r["micro_batch"], syn.PHASE_ORDER[r["phase"]], r["index"])
        )
    return ma, mb, a, b


@pytest.mark.parametrize("seed", [6, 7, 8])
@pytest.mark.parametrize("kw", [{}, {"rtol": 2e-6, "atol": 1e-9}], ids=["derived", "user"])
@pytest.mark.parametrize("reverse", [False, True], ids=["sharded-a", "sharded-b"])
def test_sharded_columns_and_records_give_the_same_result(tmp_path, seed, kw, reverse):
    """Logical tensors combined from shards as columns (the Arrow store) against the record path's
    `_Logical.value` (the JSON-lines store): the same document, the same warnings, in both directions."""
    ma, mb, a, b = _sharded_runs(seed)
    docs = {}
    for fmt, ra, rb in _in_both_formats(tmp_path, ma, a, mb, b):
        docs[fmt] = diff_runs(rb, ra, **kw) if reverse else diff_runs(ra, rb, **kw)
    arrow, jsonl = docs[".arrows"], docs[".jsonl"]
    assert arrow.mode == "numeric" and not arrow.topology.same
    assert _comparable(arrow) == _comparable(jsonl)
    assert arrow.warnings == jsonl.warnings
    assert any("do not cover" in w for w in arrow.warnings)
    assert any("copy differs" in w for w in arrow.warnings)
    assert any(r.hard for e in arrow.propagation for r in e.ranks.values())


def test_a_block_with_steps_without_records_aligns_and_sums_up_per_step():
    """A step with no rows (first, middle or last in a block) starts where the next one does: the block still
    aligns, and each row is summed up into its own step (a last empty step raised IndexError)."""
    import pyarrow as pa

    from disttrace.analysis import columnar
    from disttrace.store import trajectory, trajectory_write

    def batch(step, n):
        recs = [
            {
                "step": step,
                "micro_batch": 0,
                "phase": "reduce",
                "rank": 0,
                "index": i,
                "tensor": f"w{i}",
                "dtype": "float64",
                "shape": [2],
                "numel": 2,
                "digest": f"{step:02x}{i:030x}",
                "sum": 1.0 + i,
                "norm": 2.0,
                "sketch": [0.5] * 4,
                "nonfinite": 0,
            }
            for i in range(n)
        ]
        return (
            pa.RecordBatch.from_arrays(trajectory_write._columns(recs), schema=trajectory.SCHEMA)
            if recs
            else pa.RecordBatch.from_pylist([], schema=trajectory.SCHEMA)
        )

    for counts in ([0, 2, 3], [2, 0, 3], [2, 3, 0], [0, 0, 1]):
        ca, starts = _concat([batch(s + 1, n) for s, n in enumerate(counts)])
        cb, _ = _concat([batch(s + 1, n) for s, n in enumerate(counts)])
        assert columnar.aligned_block(ca, cb, starts), counts
        c = columnar.compare(
            ca,
            cb,
            bitwise=True,
            user=None,
            base_bound=lambda rows, order, names: np.zeros(len(rows)),
        )
        s = columnar.by_step(c, starts)
        assert s.inexact.tolist() == [0, 0, 0] and s.first_divergent.tolist() == [-1, -1, -1], (
            counts
        )
        cb, _ = _concat(
            [batch(s + 1 + 10 * (s == 2), n) for s, n in enumerate(counts)]
        )  # step 3's digests differ
        c = columnar.compare(
            ca,
            cb,
            bitwise=True,
            user=None,
            base_bound=lambda rows, order, names: np.zeros(len(rows)),
        )
        s = columnar.by_step(c, starts)
        assert s.differing.tolist() == [0, 0, counts[2]], counts


def _concat(batches):
    """Several steps' batches of one side as one Columns, with each step's first row (a block as the diff's
    block reader hands it to aligned_block and compare)."""
    import pyarrow as pa

    from disttrace.analysis import columnar

    counts = np.array([b.num_rows for b in batches], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    return columnar.Columns(pa.concat_batches(batches)), starts


def test_the_record_path_resolves_tied_errors_the_same_in_every_process(tmp_path):
    """Bits-only differences tie at relative error 0; the record path iterated its keys as a set, so which
    tensor's bound it reported depended on PYTHONHASHSEED (w's or w:exp_avg_sq's, twice as large). It now
    goes in the recorder's order, as the column-wise path does."""
    import os
    import subprocess
    import sys

    m = syn.manifest(**{"training.steps": 1, "parallelism.dp": 1})
    a, b = [], []
    for i, name in enumerate(["w", "w:exp_avg_sq", "v", "v:exp_avg_sq"]):
        r = {
            "step": 1,
            "micro_batch": 0,
            "phase": "optimizer",
            "rank": 0,
            "index": i,
            "tensor": name,
            "dtype": "float64",
            "shape": [4],
            "numel": 4,
            "sum": 1.0,
            "norm": 2.0,
            "nonfinite": 0,
        }
        r["digest"] = syn.digest(r)
        a.append(r)
        b.append({**r, "digest": r["digest"][::-1]})  # other bits, the same statistics
    bounds = set()
    for fmt in (".jsonl", ".arrows"):
        ra, rb = _write(tmp_path / fmt[1:], fmt, m, {0: a}, {0: b})
        code = (
            f"from disttrace.analysis.diff import diff_runs; "
            f"print(diff_runs({str(ra)!r}, {str(rb)!r}, mode='numeric').numeric.by_phase['optimizer'].bound)"
        )
        for seed in ("1", "2", "3", "4"):
            out = subprocess.run(
                [sys.executable, "-c", code],
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONHASHSEED": seed},
            )
            assert out.returncode == 0, out.stderr[-2000:]
            bounds.add(out.stdout.strip())
    assert len(bounds) == 1, bounds


@pytest.mark.parametrize("window", [None, 1], ids=["one-window", "a-window-a-step"])
def test_a_window_of_mixed_steps_gives_each_step_its_own_result(tmp_path, monkeypatch, window):
    """One window of steps compared together across topologies (analysis/diff/window.py) holding steps
    where a tensor is sharded, one where every tensor is whole, and one with a record that lacks a value the
    columns read (that step alone through the record path): the same document and warnings as the record
    path's on the same records (the JSON-lines store), and the same whether the steps share a window or
    each has its own."""
    from disttrace.analysis.diff import prepare
    from disttrace.analysis.diff import window as window_mod

    if window is not None:
        monkeypatch.setattr(prepare, "WINDOW_ROWS", window)
    by_records = []  # the steps the record path compared
    record_path = window_mod._compare_logical_records

    def spied(step, *args):
        by_records.append(step)
        return record_path(step, *args)

    monkeypatch.setattr(window_mod, "_compare_logical_records", spied)
    ma, mb, a, b = _sharded_runs(10)
    ma = syn.manifest(**{"training.steps": 4, "parallelism.tp": 2})
    mb = syn.manifest(**{"training.steps": 4})
    for r in a:  # step 4: every tensor whole on every rank (B's values, one bit off here and there)
        a[r] += [
            {**x, "step": 4, "rank": r} for x in b[r % 2] if x["step"] == 1 and "shard" not in x
        ]
    for r in b:
        b[r] += [{**x, "step": 4} for x in b[r] if x["step"] == 1 and "shard" not in x]
    odd = next(i for i, x in enumerate(a[1]) if x["step"] == 2 and x["phase"] == "reduce")
    del a[1][odd]["nonfinite"]  # a value the columns read, absent
    docs = {}
    for fmt, ra, rb in _in_both_formats(tmp_path, ma, a, mb, b):
        by_records.clear()
        docs[fmt] = diff_runs(ra, rb)
        if fmt == ".arrows":
            assert by_records == [2]  # that step alone; the others column-wise
    arrow, jsonl = docs[".arrows"], docs[".jsonl"]
    assert not arrow.topology.same
    assert _comparable(arrow) == _comparable(jsonl)
    assert arrow.warnings == jsonl.warnings
    assert any("do not cover" in w for w in arrow.warnings)
    assert [e.step for e in arrow.propagation] == [1, 2, 3, 4]
