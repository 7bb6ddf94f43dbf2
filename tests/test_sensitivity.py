"""What an EQUAL could not have seen: `diff --mode numeric` reports its sensitivity (per phase, the largest
bound its records were held to), a planted change above it is found, one below it is not, and the gate can
require a sensitivity (docs/tolerance.md, "Sensitivity"; docs/gate.md).

The pair: dp=2 x accumulation 2 against dp=1 x accumulation 4 of a 32-wide model (its
`layers.0.attention.wq.weight` has 1,024 elements), SGD, so a parameter is held to a bound at the optimizer
phase (under Adam it has none). The planted changes flip one mantissa bit of that weight's element 0 on
rank 0 after step 2's update (`bitflip-param`): bit 16 and bit 22. The oracle of each change's size is the
flipped bit itself, applied to the element's value with numpy, and the weight's recorded norm and size:
the most it can move the weight's norm and sum relative to that norm (the statistics diff compares;
rel_err is relative to a scale at least the norm), never a figure diff computed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import orjson
import pytest
from conftest import DEFAULT, cli, raw_records

from disttrace.analysis.diff import diff_runs
from disttrace.errors import BadInput
from disttrace.gate.policy import read_policy

SMALL = (
    "--set",
    "model.dim=32",
    "--set",
    "training.steps=3",
    "--set",
    "checkpoint.interval=0",
    "--set",
    "training.optimizer=sgd",
    "--set",
    "training.lr=0.1",
)
REFERENCE = ("--set", "parallelism.dp=1", "--set", "training.grad_accum_steps=4")
TENSOR, STEP, RANK = "layers.0.attention.wq.weight", 2, 0


@pytest.fixture(scope="module")
def pair(runs) -> tuple[Path, Path]:
    """(A: dp=1 x accumulation 4, B: dp=2 x accumulation 2), the same experiment."""
    return runs.get("run", DEFAULT, *SMALL, *REFERENCE), runs.get("run", DEFAULT, *SMALL)


def flipped(runs, bit: int) -> Path:
    return runs.get(
        "inject",
        DEFAULT,
        *SMALL,
        "--fault",
        "bitflip-param",
        "--step",
        STEP,
        "--rank",
        RANK,
        "--param",
        f"bit={bit}",
    )


def planted_change(clean: Path, fault: Path) -> float:
    """The planted change in rel_err's terms, from the bit: the element's value before the flip (the fault's
    event), flipped here, against the clean run's record of the weight at that step (norm, size). The larger
    of the change of the norm and of the sum (|delta| / (norm sqrt(numel))), both relative to the norm."""
    events = [orjson.loads(x) for x in (fault / "events.jsonl").read_bytes().splitlines()]
    (ev,) = [x for x in events if x.get("event") == "fault_fired"]
    x = np.float32(ev["before"])
    y = (x.view(np.uint32) ^ np.uint32(1 << ev["bit"])).view(np.float32)
    assert float(y) == ev["after"], "the fault flipped the bit it names"
    (rec,) = [
        r
        for r in raw_records(clean, RANK)
        if r["step"] == STEP and r["phase"] == "optimizer" and r["tensor"] == TENSOR
    ]
    norm, n = rec["norm"], rec["numel"]
    assert n == 1024
    d = float(y) - float(x)
    norm_term = abs(math.sqrt(norm * norm + 2 * float(x) * d + d * d) - norm) / norm
    return max(norm_term, abs(d) / (norm * math.sqrt(n)))


def test_the_sensitivity_is_in_the_json_and_the_summary(pair):
    a, b = pair
    proc = cli("diff", a, b, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = orjson.loads(proc.stdout)
    assert doc["equal"] and doc["mode"] == "numeric"
    sens = doc["numeric"]["sensitivity"]
    assert {"reduce", "optimizer"} <= set(sens)
    for s in sens.values():
        assert s["bound_kind"] == "derived" and 0 < s["median"] <= s["max"] and s["steps"] == 3
        # the bound grows with the steps since the runs agreed: the worst is the last step's
        assert s["step"] == 3
    # SGD: the parameters are held to the phase's bound, and there is no second moment
    assert "classes" not in sens["optimizer"]
    # the largest bound any record was held to at a step (the per-step table) is the phase's figure there
    held = [e["bound_by_phase"] for e in doc["numeric"]["by_step"]]
    for phase, s in sens.items():
        assert s["max"] == max(h[phase] for h in held if phase in h)
    text = cli("diff", a, b).stdout
    worst = max(s["max"] for s in sens.values())
    assert f"equal to within {worst:.1e}" in text, text


def test_a_change_below_the_sensitivity_is_equal_and_one_above_it_is_found(runs, pair):
    a, b = pair
    s = diff_runs(a, b).numeric.sensitivity["optimizer"]
    low, high = flipped(runs, 16), flipped(runs, 22)
    small, large = planted_change(b, low), planted_change(b, high)
    assert small < s.max < large, (small, s.max, large)

    d = diff_runs(a, low)
    assert d.equal, d.first_divergence
    # what the diff says it could not see is larger than what it did not see
    assert d.numeric.sensitivity["optimizer"].max == s.max > small

    d = diff_runs(a, high)
    f = d.first_divergence
    assert f is not None
    assert (f.step, f.phase, f.rank, f.tensor) == (STEP, "optimizer", RANK, TENSOR)
    assert f.rel_err > s.max


def _policy(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(text + '\n[checks]\nrequired = ["gradient_equivalence"]\n')
    return p


def _gate(run, ref, policy):
    proc = cli("gate", run, "--reference", ref, "--policy", policy, "--json", timeout=300)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    (check,) = [
        c for c in orjson.loads(proc.stdout)["checks"] if c["name"] == "gradient_equivalence"
    ]
    return proc.returncode, check


def test_the_gate_requires_a_sensitivity(pair, tmp_path):
    a, b = pair
    sens = diff_runs(a, b).numeric.sensitivity
    worst = max(s.max for s in sens.values())
    # coarser than required: the equivalence is not accepted (exit 1, docs/gate.md)
    rc, check = _gate(
        b, a, _policy(tmp_path, "strict", f"[equivalence]\nmax_sensitivity = {worst / 2!r}")
    )
    assert rc == 1 and check["passed"] is False, check
    assert "only to within" in check["reason"], check
    # met: accepted
    rc, check = _gate(b, a, _policy(tmp_path, "met", f"[equivalence]\nmax_sensitivity = {worst!r}"))
    assert rc == 0 and check["passed"] is True, check
    # a phase's own figure replaces the global one there
    by_phase = ", ".join(f"{p} = {s.max!r}" for p, s in sens.items())
    text = f"[equivalence]\nmax_sensitivity = {worst / 2!r}\nmax_sensitivity_by_phase = {{ {by_phase} }}"
    rc, check = _gate(b, a, _policy(tmp_path, "phases", text))
    assert rc == 0 and check["passed"] is True, check
    # a tensor class's figure: under the derived bound every class of a phase has the phase's figure
    text = f"[equivalence]\nmax_sensitivity_by_class = {{ attention = {worst / 2!r} }}"
    rc, check = _gate(b, a, _policy(tmp_path, "class", text))
    assert rc == 1 and check["passed"] is False and " attention " in check["reason"], check
    # bitwise (one layout): any bit would have been seen, so even a sensitivity of 0 is met
    rc, check = _gate(b, b, _policy(tmp_path, "zero", "[equivalence]\nmax_sensitivity = 0.0"))
    assert rc == 0 and check["passed"] is True, check


@pytest.mark.parametrize(
    "text,field",
    [
        ("max_sensitivity = -1.0", "equivalence.max_sensitivity"),
        ("max_sensitivity_by_phase = { reduction = 1e-5 }", "equivalence.max_sensitivity_by_phase"),
        ("max_sensitivity_by_phase = { reduce = -1e-5 }", "equivalence.max_sensitivity_by_phase"),
        ("max_sensitivity = 1e-5\nmax_sensitivty = 1e-5", "equivalence.max_sensitivty"),
        ("max_sensitivity_by_class = { attn = 1e-5 }", "equivalence.max_sensitivity_by_class"),
    ],
)
def test_a_bad_sensitivity_policy_names_the_field(tmp_path, text, field):
    p = tmp_path / "p.toml"
    p.write_text(f"[equivalence]\n{text}\n")
    with pytest.raises(BadInput) as e:
        read_policy(p)
    assert e.value.field == field, str(e.value)


def test_a_calibration_per_tensor_class_gives_each_class_its_figure(runs):
    """Under AdamW with the reference's calibration: each tensor class's figure at a phase is the largest of
    the calibration file's bounds for that class there (read from the file, not from diff), the phase's is
    the largest class's, and the parameters at the optimizer phase have none."""
    adam = SMALL[:-4]  # the same model and steps, AdamW at its default learning rate
    a = runs.get("run", DEFAULT, *adam, *REFERENCE)
    b = runs.get("run", DEFAULT, *adam)
    cal = runs.get("calibrate", DEFAULT, *adam, *REFERENCE)
    assert cal.name == "calibration.json" and cal.parent == a.parent, cal
    d = diff_runs(a, b)
    assert d.equal and d.tolerance.kind == "calibrated"
    by_class = orjson.loads(cal.read_bytes())["bounds_by_class"]
    for phase, s in d.numeric.sensitivity.items():
        want: dict[str, float] = {}
        for step in {e.step for e in d.numeric.by_step}:
            for cls, v in by_class.get(str(step), {}).get(phase, {}).items():
                want[cls] = max(want.get(cls, 0.0), v)
        got = {c: v for c, v in (s.classes or {}).items() if c in want}
        assert got == pytest.approx(want, rel=1e-12), phase
        assert s.max == max(want.values())
    assert d.numeric.sensitivity["optimizer"].classes["parameters"] == "none"
