"""Zooming into a step: depth recording (`record.depth`), `disttrace zoom A B` and `diff --zoom`
(docs/zoom.md)."""

from __future__ import annotations

import hashlib
import os

import orjson
import pytest
from conftest import DEFAULT, cli

from disttrace.config.freezing import canonical_json, freeze
from disttrace.errors import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK

DEPTH_OP = "record.depth={step = 2, level = 'op'}"


def test_a_manifest_without_depth_keeps_its_id():
    """The id is the sha256 of the canonical dump: an unset depth is left out of it, so every manifest
    frozen before the field existed keeps its id (and its stored runs still match it)."""
    frozen = freeze(None)
    assert "depth" not in frozen.manifest["record"]
    assert frozen.manifest_id == hashlib.sha256(canonical_json(frozen.manifest)).hexdigest()
    deep = freeze(None, [DEPTH_OP])
    assert deep.manifest["record"]["depth"] == {"level": "op", "step": 2}
    assert deep.manifest_id != frozen.manifest_id
    assert deep.model().record.depth.level == "op"
    # the dump without depth is the dump of the section's other fields, byte for byte
    rest = {k: v for k, v in deep.manifest["record"].items() if k != "depth"}
    assert orjson.dumps(rest) == orjson.dumps(frozen.manifest["record"])


@pytest.mark.parametrize(
    "sets, field",
    [
        (["record.depth={step = 0}"], "record.depth.step"),
        (["record.depth={step = 2, level = 'kernel'}"], "record.depth.level"),
        (["record.depth={step = 99}"], "record.depth.step"),
        (["record.depth={step = 2, op = true}"], "record.depth.op"),
        (["record.depth={step = 2}", "parallelism.pp=2"], "record.depth"),
    ],
)
def test_bad_depth_is_refused_naming_the_field(sets, field):
    from disttrace.errors import BadInput

    with pytest.raises(BadInput) as e:
        freeze(None, sets)
    assert e.value.field == field and "default.toml" in str(e.value)


def test_bad_depth_on_the_command_line_is_one_line_naming_file_and_field():
    proc = cli("freeze", DEFAULT, "--set", "record.depth={step = 0}")
    assert proc.returncode == EXIT_BAD_INPUT
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1 and "default.toml" in line and "record.depth.step" in line


# ---------------------------------------------------------------- zooming into planted faults
#
# The oracle is where the fault was planted (its module, direction, step, rank and micro-batch), never the
# zoom's own output: `corrupt-module` scales one element of an op's output inside one module's forward, or of
# the gradient arriving at the module's output in backward.

FFN = "layers.1.feed_forward.w1"
WQ = "layers.0.attention.wq"


def _zoom(a, b, *args, expect) -> dict:
    proc = cli("zoom", a, b, *args, "--json", timeout=600, check=expect)
    return orjson.loads(proc.stdout)


def _fault(runs, *params):
    extra = [x for p in params for x in ("--param", p)]
    return runs.fault("corrupt-module", 3, 1, *extra)


def test_zoom_names_the_module_a_forward_corruption_was_planted_in(runs, tmp_path):
    ref, bad = runs.reference(), _fault(runs, f"module={FFN}")
    doc = _zoom(ref, bad, "--depth", "module", expect=EXIT_DIVERGED)
    f = doc["first_divergence"]
    # diff's own fields first: the block output of layer 1 at the planted coordinates
    assert (f["step"], f["micro_batch"], f["phase"], f["rank"]) == (3, 0, "forward", 1)
    assert (f["module"], f["direction"]) == (FFN, "forward")
    assert "op" not in f and doc["step"] == 3 and doc["depth"] == "module"
    at = f["at_depth"]
    assert (at["micro_batch"], at["rank"], at["kind"]) == (0, 1, "module")
    assert at["a"]["digest"] != at["b"]["digest"] and at["a"]["shape"] == [4, 64, 192]
    # the depth re-run of the reference computes what the stored reference did, bit for bit
    deep_ref = doc["deep"]["a"]
    same = orjson.loads(cli("diff", ref, deep_ref, "--json", check=None).stdout)
    assert same["equal"] and same["mode"] == "bitwise", same["first_divergence"]
    assert same["compared_steps"]["last"] == 3
    # one result, three renderings (views/diffparts.py's rows): the terminal, --md (diff --zoom reuses the
    # depth runs) and the HTML report, which shows the zoom a `zoom` already recorded
    said = f"step 3: first differs at {FFN}, forward (output)"
    assert said in cli("diff", ref, bad, "--zoom", "--md", check=EXIT_DIVERGED).stdout
    from rich.console import Console

    from disttrace.lab.zoom import zoom
    from disttrace.report import build_report
    from disttrace.views.zoom import render_rich

    console = Console(record=True, width=200, file=open(os.devnull, "w"))  # noqa: SIM115
    render_rich(
        zoom(ref, bad, depth="module"), console
    )  # the depth runs are reused: nothing launched
    assert said in console.export_text()
    assert said in build_report([ref, bad], tmp_path / "report.html").read_text()


def test_a_run_without_depth_recording_writes_no_depth_records(runs):
    from pathlib import Path

    assert not (Path(runs.reference()) / "depth").exists()


@pytest.mark.slow
def test_op_depth_names_the_op_of_a_forward_corruption(runs):
    ref, bad = runs.reference(), _fault(runs, f"module={FFN}")
    f = _zoom(ref, bad, "--depth", "op", expect=EXIT_DIVERGED)["first_divergence"]
    assert (f["module"], f["direction"], f["op"]) == (FFN, "forward", "aten.mm")
    assert (f["at_depth"]["micro_batch"], f["at_depth"]["rank"]) == (0, 1)
    # the op's index among the module call's ops is what the same module runs in the reference
    assert isinstance(f["op_index"], int) and f["op_index"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("depth", ["module", "op"])
def test_zoom_names_the_module_a_backward_corruption_was_planted_in(runs, depth):
    ref, bad = runs.reference(), _fault(runs, f"module={WQ}", "direction=backward")
    f = _zoom(ref, bad, "--depth", depth, expect=EXIT_DIVERGED)["first_divergence"]
    assert (f["step"], f["phase"], f["rank"]) == (3, "backward", 1)
    # forward agrees everywhere; the first record that differs is the planted gradient's module
    assert (f["module"], f["direction"]) == (WQ, "backward")
    if depth == "op":  # the first op of that module's backward consumes the corrupted gradient
        assert f["op_index"] == 0 and f["op"].startswith("aten.")


# ---------------------------------------------------------------- across topologies

DP1 = ("--set", "parallelism.dp=1")
TP2 = ("--set", "parallelism.dp=1", "--set", "parallelism.tp=2")
ROW = "layers.0.feed_forward.w2"


@pytest.mark.slow
def test_an_unsummed_row_parallel_output_is_named_against_a_dp1_reference(runs):
    ref = runs.reference(*DP1)
    bad = runs.fault("tp-unsummed-row", 2, 0, *TP2, "--param", f"module={ROW}")
    doc = _zoom(ref, bad, expect=EXIT_DIVERGED)
    f = doc["first_divergence"]
    assert doc["mode"] == "numeric" and doc["deep"]["logical"] and f["step"] == 2
    assert (f["module"], f["direction"]) == (ROW, "forward")
    at = f["at_depth"]
    assert at["rel_err"] > at["bound"] > 0 and at["bound_kind"] == "derived"
    # op depth is for runs of one topology: refused, naming the option
    proc = cli("zoom", ref, bad, "--depth", "op", "--json")
    assert proc.returncode == EXIT_BAD_INPUT and "--depth" in proc.stderr and not proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "a_sets, b_sets",
    [
        (DP1, TP2),  # tensor parallel: every module's output as logical tensors, shards combined
        (("--set", "parallelism.dp=1", "--set", "training.micro_batch_size=8"), ()),  # dp=1 vs dp=2
    ],
    ids=["tp2-vs-dp1", "dp2-vs-dp1"],
)
def test_equivalent_layouts_zoom_equal(runs, a_sets, b_sets):
    a, b = runs.reference(*a_sets), runs.reference(*b_sets)
    doc = _zoom(a, b, "--step", "2", expect=EXIT_OK)
    assert doc["equal"] and doc["first_divergence"] is None and doc["deep"]["logical"]
    assert doc["deep"]["compared"] > 50  # every module, both directions


def test_zoom_refuses_an_unknown_depth(runs):
    ref = runs.reference()
    proc = cli("zoom", ref, ref, "--depth", "kernel", "--json")
    assert proc.returncode == EXIT_BAD_INPUT and "--depth" in proc.stderr and not proc.stdout


@pytest.mark.slow
def test_lab_zoom_adds_the_module_to_the_fault_path(tmp_path):
    proc = cli(
        "lab", DEFAULT, "--set", "training.steps=4", "--set", "checkpoint.interval=2",
        "--fault", "corrupt-module", "--step", 3, "--rank", 1, "--param", f"module={FFN}",
        "--zoom", "--json", "--out", tmp_path, timeout=900, check=0,
    )  # fmt: skip
    doc = orjson.loads(proc.stdout)
    f = doc["paths"]["fault"]["first_divergence"]
    assert doc["accepted"] and (f["step"], f["phase"], f["rank"]) == (3, "forward", 1)
    assert (f["module"], f["direction"]) == (FFN, "forward")


def test_the_lab_table_shows_a_zoomed_divergence_inside_its_step():
    from disttrace.analysis.result import BoundKind
    from disttrace.analysis.zoom import ZoomDivergence
    from disttrace.views.lab import fmt_first

    base = dict(step=3, micro_batch=0, phase="forward", rank=1, tensor="layers.1", index=1, a=None,
                b=None, rel_err=None, bound=0.0, missing_in=None, note=None,
                bound_kind=BoundKind.BITWISE)  # fmt: skip
    assert "in " not in fmt_first(ZoomDivergence(**base))  # not zoomed: diff's coordinates only
    text = fmt_first(
        ZoomDivergence(**base, module=FFN, direction="forward", op="aten.mm", op_index=2)
    )
    assert text.endswith(f"in {FFN} (forward)\nop aten.mm #2")
