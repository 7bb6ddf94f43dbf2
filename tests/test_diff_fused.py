"""The compiled path of a diff (the C kernels: the block decoder, disttrace/native/blockdecode.c, and the
comparison, disttrace/native/compare.c; skipped where the extensions were not built) against the plain path
(pyarrow's decoding and analysis/columnar.py's numpy compare and by_step: the path without the extensions and
under DISTTRACE_NATIVE=0), as the oracle.

Random stores of every phase, float32- and float64-sketched dtypes, scalars, empty tensors and a matrix whose
statistics round in float32, with B's records perturbed around the bound (bit-equal, digest-only changes,
within, beyond), NaN and inf in sketches, non-finite tensors (sum and norm null), a sketch missing on one side,
a shape or dtype that differs; also the cross-topology (logical) comparison and stores with gradient
magnitudes. Each diff runs twice in one process, once per path: the `--json` documents must be the same bytes,
and the compiled pass must have run. The equal control: a store against its copy is equal on both paths.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest
import test_diff_columnar as tdc  # noqa: E402
import test_diff_synthetic as syn  # noqa: E402

from disttrace.analysis import block_summary  # noqa: E402
from disttrace.analysis.diff import diff_runs  # noqa: E402
from disttrace.store import trajectory_decode  # noqa: E402
from disttrace.store.records import PHASES  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import diff_speed  # noqa: E402

TENSORS = [
    ("tok_embeddings.weight", [64, 32], "float32"),
    ("layers.0.attention.wq.weight", [32, 32], "bfloat16"),
    ("layers.0.feed_forward.w1.weight", [48, 32], "float64"),
    ("norm.weight", [32], "float16"),
    ("loss_scale", [], "float32"),
    ("step_count", [], "int64"),
    ("empty.bias", [0, 4], "float32"),
    (
        "output.weight",
        [512, 64],
        "float32",
    ),  # > FLOAT64_STATS: its norm and sum round in float32 runs
]
SLOTS = ("", ":exp_avg", ":exp_avg_sq")  # exp_avg_sq: a bound twice as wide


def _record(rng, step, mb, phase, rank, index, name, shape, dtype) -> dict:
    numel = math.prod(shape) if shape else 1
    norm = rng.uniform(0.5, 20.0) if numel else 0.0
    sketch = [rng.uniform(-1, 1) * norm * math.sqrt(max(numel, 1)) for _ in range(4)]
    r = {
        "step": step,
        "micro_batch": mb,
        "phase": phase,
        "rank": rank,
        "index": index,
        "tensor": name,
        "dtype": dtype,
        "shape": list(shape),
        "numel": numel,
        "sum": rng.uniform(-5, 5) if numel else 0.0,
        "norm": norm,
        "sketch": sketch,
        "nonfinite": 0,
    }
    r["digest"] = syn.digest(r)
    return r


def _changed(rng, x: dict) -> dict:
    """B's record: one of the ways two records of one tensor differ (or do not)."""
    how = rng.choice(
        ["same"] * 3
        + ["bits"] * 2
        + ["noise"] * 8
        + ["beyond"] * 2
        + ["nan", "inf", "nonfinite", "both-nonfinite", "no-sketch", "shape", "dtype", "zero"]
    )
    y = dict(x)
    if how == "same":
        return y
    if how == "bits":  # the bits changed, the statistics equal
        y["digest"] = syn.digest({**x, "salt": rng.random()})
        return y
    e = {"noise": rng.choice([1e-12, 1e-10, 1e-8, 3e-7, 1e-6]), "beyond": 1e-3}.get(how, 1e-9)
    f = lambda v: v * (1 + e * rng.uniform(-1, 1))  # noqa: E731
    y.update(sum=f(x["sum"]), norm=f(x["norm"]), sketch=[f(v) for v in x["sketch"]])
    if how == "nan":
        y["sketch"] = [*y["sketch"][:2], math.nan, *y["sketch"][3:]]
    elif how == "inf":
        y["sketch"] = [math.inf, *y["sketch"][1:]]
        if rng.random() < 0.5:
            x["sketch"] = [math.inf, *x["sketch"][1:]]  # inf on both sides: inf - inf
    elif how in ("nonfinite", "both-nonfinite"):
        y.update(sum=None, norm=None, nonfinite=rng.choice([1, 3]))
        if how == "both-nonfinite":
            x.update(sum=None, norm=None, nonfinite=rng.choice([1, 3]))
            x["digest"] = syn.digest(x)
    elif how == "no-sketch":
        y["sketch"] = None
    elif how == "shape" and len(x["shape"]) == 2:
        y["shape"] = list(reversed(x["shape"]))
    elif how == "dtype":
        y["dtype"] = "float64" if x["dtype"] != "float64" else "float32"
    elif how == "zero":
        y.update(sum=0.0, norm=0.0, sketch=[0.0] * 4)
    y["digest"] = syn.digest(y)
    return y


def _random_runs(seed: int, steps: int = 3):
    rng = random.Random(seed)
    m = syn.manifest(**{"training.steps": steps})
    a, b = {}, {}
    for rank in (0, 1):
        ra, rb = [], []
        for step in range(1, steps + 1):
            for mb in (0, 1):
                for phase in PHASES:
                    if mb and phase not in ("data", "forward", "loss", "backward"):
                        continue
                    index = 0
                    for name, shape, dtype in TENSORS:
                        for slot in SLOTS if phase == "optimizer" else ("",):
                            x = _record(
                                rng, step, mb, phase, rank, index, name + slot, shape, dtype
                            )
                            index += 1
                            y = _changed(rng, x)
                            ra.append(x)
                            rb.append(y)
        a[rank], b[rank] = ra, rb
    for recs in list(a.values()) + list(b.values()):
        recs.sort(
            key=lambda r: (r["step"], r["micro_batch"], syn.PHASE_ORDER[r["phase"]], r["index"])
        )
    return m, a, b


@pytest.fixture
def both_paths(monkeypatch):
    """run(fn) -> (the plain path's document, the C kernels' document, compiled blocks): fn's DiffResult as
    `--json` bytes under each path: the plain one as under DISTTRACE_NATIVE=0 (blocks decoded by pyarrow,
    compared by numpy), the other with the C block decoder and the C comparison (`run.decoded`: the blocks
    the C decoder took); skips where the C extensions were not built."""
    monkeypatch.setattr(block_summary, "_native_module", None)
    kernels = block_summary.native_kernels()
    if kernels is None:
        pytest.skip(
            "the C extension disttrace.native._compare is not built (or DISTTRACE_NATIVE=0)"
        )
    calls = []
    kernel = kernels.compare_block

    def counted(*args):
        calls.append(len(args[0]))
        return kernel(*args)

    monkeypatch.setattr(kernels, "compare_block", counted)
    blockdecode = pytest.importorskip("disttrace.store.blockdecode", exc_type=ImportError)

    def decode(block):
        run.decoded.append(len(block))
        return blockdecode.decode(block)

    def run(fn):
        docs = []
        for module, decoder in ((False, False), (kernels, decode)):
            monkeypatch.setattr(block_summary, "_native_module", module)
            monkeypatch.setattr(trajectory_decode, "_kernel", decoder)
            docs.append(fn().to_json())
        return docs[0], docs[1], len(calls)

    run.decoded = []
    return run


MODES = [{}, {"mode": "numeric"}, {"mode": "numeric", "rtol": 2e-6, "atol": 1e-9}]


@pytest.mark.parametrize("seed", [11, 12])
def test_the_compiled_pass_gives_the_numpy_paths_document(tmp_path, seed, both_paths):
    m, a, b = _random_runs(seed)
    ra, rb = syn.write_run(tmp_path / "a", m, a), syn.write_run(tmp_path / "b", m, b)
    for kw in MODES:
        numpy_doc, fused_doc, n = both_paths(lambda: diff_runs(ra, rb, **kw))  # noqa: B023
        assert n > 0, "the compiled pass did not run"
        assert fused_doc == numpy_doc, kw
    assert both_paths.decoded, "the C decoder did not run"
    # the comparison had something to find: divergent records, and records within the bound
    r = diff_runs(ra, rb, mode="numeric")
    assert r.first_divergence is not None
    assert sum(e.ranks[k].inexact - e.ranks[k].differing for e in r.propagation for k in e.ranks)


@pytest.mark.parametrize("variant", ["two-projections", "bounds-per-row"])
def test_the_compiled_pass_gives_the_same_document_in_its_other_branches(
    tmp_path, variant, both_paths, monkeypatch
):
    """Runs sharing only two of the sketch's projections (two sketch versions: the others are not compared),
    and the base bound asked row by row of the caller (as with a calibration per tensor class) instead of
    from a table."""
    from disttrace.analysis.diff import prepare

    if variant == "two-projections":
        monkeypatch.setattr(prepare, "_shared_projections", lambda *args: 2)
    else:
        summarize = block_summary.summarize
        monkeypatch.setattr(
            block_summary,
            "summarize",
            lambda *a, **kw: summarize(*a, **{**kw, "bound_table": None}),
        )
    m, a, b = _random_runs(14)
    ra, rb = syn.write_run(tmp_path / "a", m, a), syn.write_run(tmp_path / "b", m, b)
    for kw in MODES[1:]:
        numpy_doc, fused_doc, n = both_paths(lambda: diff_runs(ra, rb, **kw))  # noqa: B023
        assert n > 0 and fused_doc == numpy_doc, kw


def test_the_compiled_pass_finds_a_store_equal_to_its_copy(tmp_path, both_paths):
    m, a, _ = _random_runs(13, steps=2)
    ra, rb = syn.write_run(tmp_path / "a", m, a), syn.write_run(tmp_path / "b", m, a)
    numpy_doc, fused_doc, _ = both_paths(lambda: diff_runs(ra, rb, mode="numeric", use_index=False))
    assert fused_doc == numpy_doc
    assert diff_runs(ra, rb, mode="numeric", use_index=False).equal


def test_the_compiled_pass_gives_the_same_document_across_topologies(tmp_path, both_paths):
    ma, mb, a, b = tdc._cross_topology_runs(4)
    ra, rb = syn.write_run(tmp_path / "a", ma, a), syn.write_run(tmp_path / "b", mb, b)
    numpy_doc, fused_doc, n = both_paths(lambda: diff_runs(ra, rb))
    assert n > 0 and fused_doc == numpy_doc


@pytest.mark.parametrize("seed", [6, 7])
def test_the_compiled_pass_gives_the_same_document_on_shards(tmp_path, both_paths, seed):
    ma, mb, a, b = tdc._sharded_runs(seed)
    ra, rb = syn.write_run(tmp_path / "a", ma, a), syn.write_run(tmp_path / "b", mb, b)
    for x, y in ((ra, rb), (rb, ra)):
        numpy_doc, fused_doc, n = both_paths(lambda: diff_runs(x, y))  # noqa: B023
        assert n > 0 and fused_doc == numpy_doc


def test_the_compiled_pass_gives_the_same_document_with_magnitudes(tmp_path, both_paths):
    """bench/diff_speed's stores with the gradients' magnitudes (the bound's scale), planted divergence and
    the noisy run (every record inexact), in blocks of several steps."""
    dirs, planted = diff_speed.write_runs(tmp_path, 2, 6, 120, (5, 1, 7), magnitudes=True)
    for other, kw in (("fault", {}), ("noisy", {"mode": "numeric"}), ("half", {})):
        numpy_doc, fused_doc, n = both_paths(
            lambda: diff_runs(dirs["reference"], dirs[other], **kw)  # noqa: B023
        )
        assert n > 0 and fused_doc == numpy_doc, other
    r = diff_runs(dirs["reference"], dirs["fault"])
    assert r.first_divergence is not None and r.first_divergence.step == planted[0]
