"""The magnitudes the numeric bound scales gradients by (run/record/scales.py, analysis/magnitudes.py): recorded
figures against a formula, and diff on pairs whose true answer is known.

* The recorder's ``||X|| ||dY||`` bounds every gradient it is recorded for (Cauchy-Schwarz), on a real model.
* A gradient that cancels (a sum over tokens of nearly equal inputs times output gradients summing to ~0):
  its float32 rounding against a float64 oracle is far above eps * its norm, and below eps * the magnitude.
* Synthetic stores of two layouts computing the same mean of the same per-micro-batch gradients in another
  order (float32, numpy): equal with magnitudes, a false divergence without them (the norm-relative bound),
  and a planted contribution scaled by (1 + 1e-3) found at its coordinates.
"""

from __future__ import annotations

import math
import shutil

import numpy as np
import orjson
import pytest
import xxhash
from test_diff_synthetic import manifest, write_run

from disttrace.analysis import tolerance
from disttrace.analysis.diff import diff_runs
from disttrace.store import scales as store_scales

torch = pytest.importorskip("torch")


def _cancelling(rng, tokens=64, d_in=8, d_out=16, spread=1e-3):
    """(X, dY) whose product dY^T X nearly cancels: X's rows share one component, dY's rows sum to 0."""
    x = np.ones((tokens, d_in)) + spread * rng.standard_normal((tokens, d_in))
    dy = rng.standard_normal((tokens, d_out))
    dy -= dy.mean(axis=0)
    return x.astype(np.float32), dy.astype(np.float32)


def test_magnitude_bounds_every_gradient_of_a_real_model(tmp_path):
    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model, lm_loss
    from disttrace.run.job.hooks import HookBus, grads_of, param_refs
    from disttrace.run.record.scales import Magnitudes

    m = freeze(None, ["model.dim=32", "model.n_layers=2", "model.max_seq_len=16"]).model()
    model = build_model(m.model, torch.float32, 0)
    bus = HookBus(0)
    mags = Magnitudes(tmp_path, 0, model).attach(bus)
    named = param_refs(model)
    bus.step, bus.micro_batch = 1, 0
    bus.emit("step_start")
    g = torch.Generator().manual_seed(0)
    for mb in range(2):
        bus.micro_batch = mb
        tokens = torch.randint(0, m.model.vocab_size, (2, 16), generator=g)
        (lm_loss(model(tokens[:, :-1]), tokens[:, 1:]) / 2).backward()
        bus.emit("backward" if mb == 0 else "reduce", grads=grads_of(named))
    bus.emit("step_end")
    mags.close()
    got = store_scales.read(tmp_path / f"trajectory/rank-00000{store_scales.SUFFIX}", tmp_path)
    assert set(got.step.tolist()) == {1}
    table = got.table(1)
    reduce = table["reduce"][1]
    assert set(reduce) == {i for i, _, _ in named}  # every parameter has its magnitude
    for i, name, p in named:
        norm = float(p.grad.double().norm())
        assert norm <= reduce[i] * (1 + 1e-5), name  # ||dW|| <= ||X|| ||dY||
        # accumulated like the gradient: after two micro-batches at least the first one's figure
        assert reduce[i] >= table["backward"][0][i]


def test_magnitude_bounds_biases_and_layer_norms(tmp_path):
    """A user's model of the usual parts (linear layers with biases, a LayerNorm, a 3-D input): every
    parameter's gradient, biases included (dB sums dY over positions: ||dB|| <= sqrt(positions) ||dY||),
    within its recorded magnitude (Cauchy-Schwarz), with the biases' inputs centred so that a bias bounded
    by ||X|| ||dY|| would not hold."""
    from disttrace.run.job.hooks import HookBus, grads_of, param_refs
    from disttrace.run.record.scales import Magnitudes

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Tanh(), torch.nn.Linear(12, 3)
    )
    bus = HookBus(0)
    mags = Magnitudes(tmp_path, 0, model).attach(bus)
    named = param_refs(model)
    bus.step, bus.micro_batch = 1, 0
    bus.emit("step_start")
    x = 1e-3 * torch.randn(4, 16, 6)  # small inputs: ||X|| ||dY|| far below a bias's gradient
    (model(x) ** 2).sum().backward()
    bus.emit("reduce", grads=grads_of(named))
    bus.emit("step_end")
    mags.close()
    got = store_scales.read(tmp_path / f"trajectory/rank-00000{store_scales.SUFFIX}", tmp_path)
    reduce = got.table(1)["reduce"][0]
    assert set(reduce) == {i for i, _, _ in named}
    for i, name, p in named:
        assert float(p.grad.double().norm()) <= reduce[i] * (1 + 1e-5), name


def test_cancelling_gradient_rounds_on_the_scale_of_its_magnitudes():
    rng = np.random.default_rng(1)
    x, dy = _cancelling(rng, tokens=512)
    exact = dy.astype(np.float64).T @ x.astype(np.float64)  # the float64 oracle
    # float32, summed over tokens in blocks (as another GEMM shape would)
    got = sum(dy[i : i + 64].T @ x[i : i + 64] for i in range(0, 512, 64)).astype(np.float64)
    err = np.linalg.norm(got - exact)
    mag = np.linalg.norm(x.astype(np.float64)) * np.linalg.norm(dy.astype(np.float64))
    u = tolerance.UNIT_ROUNDOFF["float32"]
    assert np.linalg.norm(exact) < 1e-2 * mag  # it cancels
    assert err > 20 * u * math.sqrt(512) * np.linalg.norm(exact)  # the norm-relative bound fails
    assert err < 2 * u * math.sqrt(512) * mag  # the magnitude bound holds


# ---------------------------------------------------------------- synthetic stores, known answer

NAMES = ["layers.0.attention.wk.weight", "layers.0.feed_forward.w1.weight"]


def _micro_batches(step: int, n: int):
    """Per micro-batch and tensor: (X, dY); tensor 0 cancels, tensor 1 does not."""
    rng = np.random.default_rng(step)
    out = []
    for _ in range(n):
        c = _cancelling(rng)
        x = rng.standard_normal((64, 8)).astype(np.float32)
        dy = rng.standard_normal((64, 16)).astype(np.float32)
        out.append([c, (x, dy)])
    return out


def _record(step, rank, index, arr, mb) -> dict:
    a64 = arr.astype(np.float64)
    return {
        "step": step,
        "micro_batch": mb,
        "phase": "reduce",
        "rank": rank,
        "index": index,
        "tensor": NAMES[index],
        "dtype": "float32",
        "shape": list(arr.shape),
        "numel": int(arr.size),
        "digest": xxhash.xxh3_128_hexdigest(np.ascontiguousarray(arr).tobytes()),
        "sum": float(a64.sum()),
        "norm": float(np.linalg.norm(a64)),
        "nonfinite": 0,
    }


def _layout(tmp_path, name, dp, accum, steps=3, plant=None, blocks=1, legacy=False):
    """A run of `dp` ranks x `accum` micro-batches over the same 4 micro-batches a step: each rank accumulates
    its micro-batches' gradients (loss / accum) in float32, each summed over the tokens in `blocks` blocks
    (another GEMM shape), the reduce averages the ranks (pairwise); the magnitudes file holds each rank's
    accumulated ||X|| ||dY|| (with the same 1/accum)."""
    m = manifest(**{"parallelism.dp": dp, "training.grad_accum_steps": accum})
    records = {r: [] for r in range(dp)}
    scales = {r: [] for r in range(dp)}
    for step in range(1, steps + 1):
        mbs = _micro_batches(step, 4)
        reduced, local_m = [], {r: {} for r in range(dp)}
        for t in range(len(NAMES)):
            local = []
            for r in range(dp):
                acc = np.zeros((16, 8), np.float32)
                mag = 0.0
                for j in range(accum):
                    x, dy = mbs[r * accum + j][t]
                    n = len(x) // blocks
                    g = sum(dy[i : i + n].T @ x[i : i + n] for i in range(0, len(x), n))
                    g = g / np.float32(accum)
                    if plant == (step, r * accum + j, t):
                        g = g * np.float32(1 + 1e-3)
                    acc = acc + g
                    mag += float(np.linalg.norm(x) * np.linalg.norm(dy)) / accum
                local.append(acc)
                local_m[r][str(t)] = mag
            red = local[0]
            for other in local[1:]:
                red = red + other
            reduced.append(red / np.float32(dp))
        for r in range(dp):
            records[r] += [_record(step, r, t, reduced[t], accum - 1) for t in range(len(NAMES))]
            scales[r].append({"step": step, "m": {"reduce": {str(accum - 1): local_m[r]}}})
    path = write_run(tmp_path / name, m, records)
    for r, lines in scales.items():
        if legacy:  # an older store's JSON-lines file
            (path / f"trajectory/rank-{r:05d}.scales.jsonl").write_bytes(
                b"".join(orjson.dumps(x) + b"\n" for x in lines)
            )
            continue
        frames = []
        for x in lines:
            ((mb, table),) = x["m"]["reduce"].items()
            idx = np.array([int(i) for i in table], np.int64)
            frames.append(
                store_scales.encode(
                    x["step"], [("reduce", int(mb), idx, np.array(list(table.values())))], None
                )
            )
        (path / f"trajectory/rank-{r:05d}{store_scales.SUFFIX}").write_bytes(b"".join(frames))
    return path


def test_same_mean_in_another_order_is_equal_only_on_the_magnitudes_scale(tmp_path):
    a = _layout(tmp_path, "a", dp=2, accum=2)
    b = _layout(tmp_path, "b", dp=1, accum=4, blocks=2)
    d = diff_runs(a, b).to_dict()
    assert d["mode"] == "numeric" and d["tolerance"]["scale"] == "magnitudes"
    assert d["equal"], d["first_divergence"]
    assert d["stats"]["tensors_compared"] > d["stats"]["bit_equal"]  # it did round differently
    # the same stores without magnitudes: the norm-relative bound calls the cancelling tensor divergent
    for p in b.glob("trajectory/*.scales.*"):
        p.unlink()
    d = diff_runs(a, b).to_dict()
    assert d["tolerance"]["scale"] == "norm" and not d["equal"]
    f = d["first_divergence"]
    assert (f["step"], f["phase"], f["tensor"]) == (1, "reduce", NAMES[0])


def test_planted_contribution_diverges_at_its_coordinates(tmp_path):
    a = _layout(tmp_path, "a", dp=2, accum=2)
    b = _layout(
        tmp_path, "b", dp=1, accum=4, plant=(2, 1, 1), blocks=2
    )  # step 2, micro-batch 1, tensor 1
    d = diff_runs(a, b).to_dict()
    f = d["first_divergence"]
    assert not d["equal"] and (f["step"], f["phase"], f["tensor"]) == (2, "reduce", NAMES[1])
    assert f["rel_err"] > f["bound"]
    shutil.rmtree(b)
    # the same planted change on the cancelling tensor is 1e-3 of a gradient 1e-3 of its magnitudes: inside
    # the rounding any layout may do, and no sound bound on these statistics can tell it from noise
    b = _layout(tmp_path, "b", dp=1, accum=4, plant=(2, 1, 0), blocks=2)
    assert diff_runs(a, b).to_dict()["equal"]


def test_a_calibration_beside_the_reference_is_used_by_default(tmp_path):
    a = _layout(tmp_path, "a", dp=2, accum=2)
    b = _layout(tmp_path, "b", dp=1, accum=4, blocks=2)
    mid = orjson.loads((a / "manifest.lock.json").read_bytes())["manifest_id"]
    cal = {
        "kind": "disttrace-calibration",
        "version": 1,
        "manifest_id": "0" * 64,  # another manifest's: not this reference's, left alone
        "safety": 10.0,
        "bounds": {"2": {"reduce": 1e-15}},
    }
    (tmp_path / "calibration.json").write_bytes(orjson.dumps(cal))
    assert diff_runs(a, b).to_dict()["tolerance"]["kind"] == "derived"
    # the reference's own (a measured noise far below what another layout rounds: the verdict shows it is used)
    (tmp_path / "calibration.json").write_bytes(orjson.dumps({**cal, "manifest_id": mid}))
    d = diff_runs(a, b).to_dict()
    assert d["tolerance"]["kind"] == "calibrated" and d["tolerance"]["found"] is True
    f = d["first_divergence"]
    assert (f["step"], f["phase"], f["bound_kind"]) == (2, "reduce", "calibrated")
    assert diff_runs(a, b, find_calibration=False).to_dict()["equal"]


def test_an_attached_runs_reduction_size_is_what_it_counted():
    """An attached manifest states no micro-batch size nor sequence length: T is the batch the run counted
    (its lock's `observed`), the tokens when it counted token ids, never a factor of 1 where a count exists;
    d is the widest matrix it holds. Oracle: the formula 2 u (sqrt(T) + sqrt(d)) with T and d written out."""
    attached = {
        "parallelism": {"dp": 2, "world_size": 2, "engine": "DDP"},
        "training": {"optimizer": "AdamW", "dtype": "float32", "grad_accum_steps": 2},
        "model": {
            "class": "m.Net",
            "parameters": 0,
            "tensors": {
                "emb.weight": {"shape": [96, 48], "dtype": "torch.float32"},
                "fc.weight": {"shape": [192, 48], "dtype": "torch.float32"},
                "fc.bias": {"shape": [192], "dtype": "torch.float32"},
            },
        },
    }
    u = 2.0**-24
    counted = {"global_batch": 16, "tokens": 16 * 31}
    for observed, t in ((counted, 16 * 31), ({"global_batch": 16}, 16), (None, 2 * 2)):
        got = tolerance.step_bound(attached, attached, "reduce", (observed, observed))
        assert got == pytest.approx(2 * u * (math.sqrt(t) + math.sqrt(192))), observed
    assert tolerance.explain(attached, attached, (counted, counted))["T"] == 16 * 31
    # the harness's manifest states every factor: an `observed` beside it changes nothing
    m = manifest()
    assert tolerance.step_bound(m, m, "reduce", (counted, counted)) == tolerance.step_bound(
        m, m, "reduce"
    )


def _class_noise(ref, other) -> dict:
    """The oracle of a calibration's noise, recomputed here from the raw records and the magnitudes files:
    per (step, class), the largest |d norm| / S and |d sum| / (S sqrt(numel)), S = max(norms, magnitude),
    the magnitude of a reduced record being the sum over ranks of each rank's figure / dp."""
    from disttrace.store.rundir import Run

    def mags(run):
        out: dict = {}
        for p in sorted(run.glob("trajectory/*.scales.*")):
            got = store_scales.read(p)
            for step, i, v in zip(got.step.tolist(), got.index.tolist(), got.m.tolist()):
                out[(step, i)] = out.get((step, i), 0.0) + v
        dp = orjson.loads((run / "manifest.lock.json").read_bytes())["manifest"]["parallelism"][
            "dp"
        ]
        return {k: v / dp for k, v in out.items()}

    ma, mb = mags(ref), mags(other)
    left = {(r["step"], r["index"]): r for r in Run(ref).records(0)}
    want: dict = {}
    for r in Run(other).records(0):
        a = left[(r["step"], r["index"])]
        s = max(a["norm"], r["norm"], ma[(r["step"], r["index"])], mb[(r["step"], r["index"])])
        e = max(
            abs(a["norm"] - r["norm"]) / s, abs(a["sum"] - r["sum"]) / (s * math.sqrt(r["numel"]))
        )
        cls = "attention" if "attention" in r["tensor"] else "mlp"
        want[(r["step"], cls)] = max(want.get((r["step"], cls), 0.0), e)
    return want


def test_a_calibration_per_tensor_class_both_directions(tmp_path):
    """`calibrate`'s document on stores whose noise is known (the perturbed reference sums each gradient over
    the tokens in another blocking): per step, phase and tensor class, safety x the noise recomputed here.
    Under it, a layout computing the same mean in another order is equal, and a contribution scaled by
    (1 + 1e-3) is found at its planted coordinates, against its own class's bound."""
    from disttrace.analysis.calibration import build

    ref = _layout(tmp_path, "ref", dp=1, accum=4)
    repeat = _layout(tmp_path, "repeat", dp=1, accum=4)
    perturbed = _layout(tmp_path, "perturbed", dp=1, accum=4, blocks=2)
    mid = orjson.loads((ref / "manifest.lock.json").read_bytes())["manifest_id"]
    runs = {"reference": str(ref), "repeat": str(repeat), "perturbed": str(perturbed)}
    doc = build(mid, runs, 2**-23, 10.0)
    assert doc.repeat_bit_identical and doc.scale == "magnitudes"
    want = _class_noise(ref, perturbed)
    got = {(int(s), c): v for s, ph in doc.bounds_by_class.items() for c, v in ph["reduce"].items()}
    assert got.keys() == want.keys() and len({c for _, c in got}) == 2
    for k, v in want.items():
        assert got[k] == pytest.approx(10.0 * v, rel=1e-12), k
    for (
        s,
        ph,
    ) in doc.bounds.items():  # the phase's bound is its loosest class's (what v1 readers read)
        assert ph["reduce"] == max(v for (t, _), v in got.items() if t == int(s))
    (tmp_path / "calibration.json").write_bytes(orjson.dumps(doc.to_dict()))

    same = _layout(tmp_path, "same", dp=2, accum=2, blocks=2)
    d = diff_runs(ref, same).to_dict()
    assert d["tolerance"]["kind"] == "calibrated" and d["tolerance"]["found"] is True
    assert d["equal"], d["first_divergence"]
    assert d["stats"]["tensors_compared"] > d["stats"]["bit_equal"]  # it did round differently

    planted = _layout(tmp_path, "planted", dp=2, accum=2, blocks=2, plant=(2, 1, 1))
    f = diff_runs(ref, planted).to_dict()["first_divergence"]
    assert (f["step"], f["phase"], f["tensor"], f["bound_kind"]) == (
        2,
        "reduce",
        NAMES[1],
        "calibrated",
    )
    assert f["bound"] == pytest.approx(got[(2, "mlp")]) and f["rel_err"] > f["bound"]

    # measured against the magnitudes: it says nothing of a store compared on its norms, and is not used
    for p in same.glob("trajectory/*.scales.*"):
        p.unlink()
    d = diff_runs(ref, same).to_dict()
    assert d["tolerance"]["kind"] == "derived"
    assert any("calibration" in w and "magnitudes" in w for w in d["warnings"])


def test_an_older_stores_json_lines_magnitudes_diff_the_same(tmp_path):
    """The same magnitudes in the JSON-lines file an older store holds and in the binary frames: the same
    diff, to the last field."""
    a = _layout(tmp_path, "a", dp=2, accum=2)
    b = _layout(tmp_path, "b", dp=1, accum=4, blocks=2)
    old_a = _layout(tmp_path, "old-a", dp=2, accum=2, legacy=True)
    old_b = _layout(tmp_path, "old-b", dp=1, accum=4, blocks=2, legacy=True)
    assert not list(old_a.glob(f"trajectory/*{store_scales.SUFFIX}"))
    new, old = diff_runs(a, b).to_dict(), diff_runs(old_a, old_b).to_dict()
    assert new["tolerance"]["scale"] == "magnitudes" and new["equal"]
    assert str(old).replace("old-", "") == str(new)


def test_magnitudes_frames_read_back_torn_rewritten_and_damaged(tmp_path):
    """Frames read back as written (float32 kept as float32, float64 as float64, the clip scalars); a frame
    cut short at the end is left out; a step written again keeps its last frame; bytes that are not a
    frame are refused."""
    from disttrace.errors import BadInput

    rng = np.random.default_rng(0)
    path = tmp_path / "run" / f"trajectory/rank-00000{store_scales.SUFFIX}"
    path.parent.mkdir(parents=True)
    f32 = rng.random(5).astype(np.float32)
    f64 = rng.random(3)
    frames = [
        store_scales.encode(
            1,
            [("backward", 0, np.arange(5), f32), ("reduce", 1, np.arange(5), 2 * f32)],
            (3.5, 1.0),
        ),
        store_scales.encode(2, [("reduce", 1, np.array([7, 2, 9]), f64)], None),
        store_scales.encode(1, [("reduce", 1, np.array([4]), np.array([0.25]))], (2.0, 0.5)),
    ]
    path.write_bytes(b"".join(frames) + frames[1][:-3])  # the last frame torn
    got = store_scales.read(path)
    # step 1 rewritten: its last frame, in its first one's place; the torn copy of step 2 left out
    assert got.step.tolist() == [1, 2, 2, 2]
    assert got.table(1) == {"reduce": {1: {4: 0.25}}}
    assert got.table(2) == {"reduce": {1: dict(zip([7, 2, 9], f64.tolist()))}}
    assert got.clip == {1: (2.0, 0.5)}
    path.write_bytes(frames[0])
    got = store_scales.read(path)
    assert got.table(1)["backward"][0] == dict(enumerate(f32.tolist()))  # float32, exactly
    assert got.clip == {1: (3.5, 1.0)}
    path.write_bytes(frames[0] + b"\x00" * 40)
    with pytest.raises(BadInput, match="not a magnitudes frame"):
        store_scales.read(path)
    grown = bytearray(frames[0])
    grown[8:12] = (10**6).to_bytes(4, "little")  # the first frame's entry count damaged
    path.write_bytes(bytes(grown) + frames[1])
    with pytest.raises(BadInput, match="runs past the next one"):
        store_scales.read(path)
    bad = bytearray(frames[1])
    bad[-8:] = np.array([-1.0]).tobytes()  # a negative magnitude
    path.write_bytes(bytes(bad))
    with pytest.raises(BadInput, match="finite number >= 0"):
        store_scales.read(path)


def test_the_clip_scalars_beside_the_magnitudes_are_the_recorded_ones(runs):
    """The magnitudes file's clip scalars of every step and rank are the trajectory's own `clip` records
    (grad_norm's and clip_coef's values), which the bound read from the trajectory before."""
    from disttrace.store.rundir import Run

    ref = runs.reference()
    run = Run(ref)
    for rank in run.ranks():
        got = store_scales.read(ref / f"trajectory/rank-{rank:05d}{store_scales.SUFFIX}").clip
        want: dict = {}
        for r in run.records(rank):
            if r["phase"] == "clip" and r["tensor"] in ("grad_norm", "clip_coef"):
                want.setdefault(r["step"], {})[r["tensor"]] = r["sum"]
        assert want and sorted(got) == sorted(want)
        for step, w in want.items():
            assert got[step] == (w["grad_norm"], w["clip_coef"])


def test_the_name_kinds_match_pyarrows_string_kernels():
    """The tensor-name kinds the magnitudes' lookup asks for, matched on a column's bytes, against
    pyarrow's own string kernels (equal, starts_with, ends_with, match_substring), nulls as no match, on
    whole, sliced, taken and empty columns."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from disttrace.analysis.diff.tol import _NameKinds

    words = ["grad_norm", "clip_coef", None, "", "w:exp_avg", "w:exp_avg_sq", "param_groups.0.lr"]
    words += ["a:b", "exp_avg", "xgrad_norm", "grad_norm2", ":", ":exp_avg", "param_groups.", "é:x"]
    col = pa.array(words * 3)
    kernels = {
        "grad_norm": lambda c: pc.equal(c, "grad_norm"),
        "clip_coef": lambda c: pc.equal(c, "clip_coef"),
        "param_groups": lambda c: pc.starts_with(c, "param_groups."),
        "colon": lambda c: pc.match_substring(c, ":"),
        "exp_avg": lambda c: pc.ends_with(c, ":exp_avg"),
        "exp_avg_sq": lambda c: pc.ends_with(c, ":exp_avg_sq"),
    }
    for c in (
        col,
        col.slice(5, 20),
        col.slice(8, 10),  # the row before holds a colon, the slice's first does not
        col.slice(0, 0),
        pa.array([None, None], pa.string()),
        col.take(pa.array([3, 1, 4, 1, 5, 9, 2, 6])),
        col.cast(pa.large_string()),
    ):
        kinds = _NameKinds(c)
        some = np.arange(len(c))[::2]
        for kind, f in kernels.items():
            want = f(c).fill_null(False).to_numpy(zero_copy_only=False)
            assert kinds.over(np.arange(len(c)))(kind).tolist() == want.tolist(), (kind, c)
            assert kinds.over(some)(kind).tolist() == want[some].tolist(), (kind, c)
