"""Issue 13, item 5: `disttrace calibrate` measures run-to-run noise (reference twice, once perturbed by one
ulp), and diff says of every bound whether it is derived or calibrated."""

from __future__ import annotations

import math

import orjson
import pytest
from conftest import DEFAULT, SHORT, cli, last_line, raw_records

from disttrace.model.names import tensor_class

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

DP1 = ["--set", "parallelism.dp=1", "--set", "training.grad_accum_steps=4"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal")
    path = last_line(cli("calibrate", DEFAULT, *SHORT, *DP1, "--out", out, timeout=400, check=0))
    zero3 = last_line(
        cli("run", DEFAULT, *SHORT, "--set", "parallelism.zero_stage=3", "--out", out, check=0)
    )
    return path, orjson.loads(path.read_bytes()), zero3


def _records(run):
    return {(r["step"], r["micro_batch"], r["phase"], r["index"]): r for r in raw_records(run, 0)}


def test_calibration_noise_is_the_measured_difference(calibrated):
    path, doc, _ = calibrated
    assert doc["repeat_bit_identical"] is True  # determinism: two references, the same bits
    assert doc["scale"] == "magnitudes"  # the runs record them: the scale diff compares on
    ref, pert = (
        _records(__import__("pathlib").Path(doc["runs"][k])) for k in ("reference", "perturbed")
    )
    # recomputed here from the raw records on the norm's scale: largest of |dnorm|/norm and
    # |d<x,v>|/(norm sqrt(numel)) over v = ones and the sketch's vectors, per (step, phase[, class]).
    # The calibration divides by max(norm, magnitude) >= norm: equal where a record has no magnitude (the
    # loss), at most this elsewhere, and never zero where this is not (the perturbation reached it)
    want: dict = {}
    want_cls: dict = {}
    for k, a in ref.items():
        b = pert[k]
        if a["sum"] is None or b["sum"] is None:
            continue
        n = max(a["norm"], b["norm"], 1e-300)
        scale = n * math.sqrt(max(a["numel"], 1))
        terms = [abs(a["norm"] - b["norm"]) / n, abs(a["sum"] - b["sum"]) / scale]
        terms += [abs(x - y) / scale for x, y in zip(a.get("sketch") or [], b.get("sketch") or [])]
        cur = want.setdefault(str(k[0]), {})
        cur[k[2]] = max(cur.get(k[2], 0.0), max(terms))
        if k[2] == "reduce":
            cls = tensor_class(a["tensor"])
            c = want_cls.setdefault(str(k[0]), {})
            c[cls] = max(c.get(cls, 0.0), max(terms))
    assert want.keys() == doc["noise"].keys()
    for step, phases in want.items():
        got = doc["noise"][step]
        for phase, v in phases.items():
            if phase in ("loss", "data", "forward"):
                assert math.isclose(got.get(phase, 0.0), v, rel_tol=1e-9, abs_tol=1e-300), (
                    step,
                    phase,
                )
            elif phase in ("backward", "reduce", "clip"):
                assert (got.get(phase, 0.0) > 0) == (v > 0), (step, phase)
                assert got.get(phase, 0.0) <= v * (1 + 1e-9), (step, phase)
        for cls, v in want_cls[step].items():
            c = doc["noise_by_class"][step]["reduce"].get(cls, 0.0)
            assert c <= v * (1 + 1e-9) and (c > 0) == (v > 0), (step, cls)
    assert set(doc["noise_by_class"]["1"]["reduce"]) == {
        "embedding",
        "attention",
        "mlp",
        "norm",
        "output",
    }
    assert doc["noise"]["1"]["reduce"] > 0  # the one-ulp perturbation reached the gradients
    assert doc["bounds"]["2"]["reduce"] == pytest.approx(
        doc["safety"] * doc["noise"]["2"]["reduce"]
    )
    for cls, v in doc["noise_by_class"]["2"]["reduce"].items():
        assert doc["bounds_by_class"]["2"]["reduce"][cls] == pytest.approx(doc["safety"] * v)


def test_diff_says_which_bounds_are_calibrated(calibrated):
    path, doc, zero3 = calibrated
    one = doc["runs"]["reference"]
    plain = orjson.loads(cli("diff", one, zero3, "--no-calibration", "--json").stdout)
    cal = orjson.loads(cli("diff", one, zero3, "--calibration", path, "--json").stdout)
    assert plain["tolerance"]["kind"] == "derived" and cal["tolerance"]["kind"] == "calibrated"
    # the reference carries its calibration (written beside it): used by default, and said so
    found = orjson.loads(cli("diff", one, zero3, "--json").stdout)
    assert found["tolerance"]["kind"] == "calibrated" and found["tolerance"]["found"] is True
    assert found["tolerance"]["file"] == str(path)
    kinds = {e.get("bound_kind") for e in cal["numeric"]["by_phase"].values()}
    assert kinds and kinds <= {"calibrated", "derived"} and "calibrated" in kinds
    for e in plain["numeric"]["by_phase"].values():
        assert e["bound_kind"] == "derived"
    human = cli("diff", one, zero3, "--calibration", path).stdout
    assert "(calibrated)" in human
    assert "(calibrated)" in cli("diff", one, zero3).stdout
    assert "(derived)" in cli("diff", one, zero3, "--no-calibration").stdout


def test_a_calibration_of_another_manifest_is_refused(calibrated, tmp_path):
    path, doc, zero3 = calibrated
    other = tmp_path / "c.json"
    other.write_bytes(orjson.dumps({**doc, "manifest_id": "0" * 64}))
    proc = cli("diff", doc["runs"]["reference"], zero3, "--calibration", other)
    assert proc.returncode == 2 and "manifest_id" in proc.stderr


def test_run_calibrate_writes_the_references_calibration_in_one_go(tmp_path):
    """`run --calibrate`: the reference run, reported as `run` reports it (its directory the last stdout
    line), and its calibration.json beside it, naming it as the reference; diff then uses it by default. A
    safety below 1 is refused before anything runs."""
    bad = cli("run", DEFAULT, *SHORT, "--calibrate", "--safety", "0.5", "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "--safety" in bad.stderr and not (tmp_path / "bad").exists()
    out = tmp_path / "runs"
    proc = cli("run", DEFAULT, *SHORT, *DP1, "--calibrate", "--out", out, timeout=400, check=0)
    ref = last_line(proc)
    path = ref.parent / "calibration.json"
    doc = orjson.loads(path.read_bytes())
    assert doc["runs"]["reference"] == str(ref) and doc["repeat_bit_identical"] is True
    assert doc["bounds_by_class"]["1"]["reduce"] and "calibrated bound" in proc.stderr
    zero3 = last_line(
        cli("run", DEFAULT, *SHORT, "--set", "parallelism.zero_stage=3", "--out", out, check=0)
    )
    d = orjson.loads(cli("diff", ref, zero3, "--json").stdout)
    assert d["tolerance"]["kind"] == "calibrated" and d["tolerance"]["file"] == str(path)
    assert d["equal"]
