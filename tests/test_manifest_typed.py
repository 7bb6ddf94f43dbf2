"""The job reads its manifest as the typed model: validated once where the job starts, read by
attribute, so a misspelt field is an error, never a silent `.get` default. Attached runs write a manifest of
their own shape: `AttachedManifest` states it, and what attach writes must validate against it."""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEFAULT, ROOT, run_snippet

from disttrace.config.attached import AttachedManifest
from disttrace.config.freezing import canonical_json, freeze
from disttrace.config.manifest import Manifest
from disttrace.errors import BadInput
from disttrace.store.jsonlines import read_json
from disttrace.store.rundir import LOCK
from disttrace.store.writers import write_json_atomic

JOB_MODULES = [
    "job/worker",
    "job/launch",
    "job/loop",
    "record/memory",
    "job/topology",
    "record/flightrec",
    "job/checkpoint",
    "job/recovery",
    "record/livecheck",
    "job/usercmd",
]
JOB_FILES = [ROOT / "disttrace" / "run" / f"{m}.py" for m in JOB_MODULES] + sorted(
    p
    for pkg in ("parallel", "faults")  # faults/ holds perturb.py too
    for p in (ROOT / "disttrace" / "run" / pkg).glob("*.py")
)
SECTIONS = set(Manifest.model_fields)


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return freeze(DEFAULT).model()


def _section_lookups(source: str, name: str) -> list[str]:
    """`manifest["training"]`, `ctx.manifest.get("debug")`, `get_field(...)` in a file: dict access to a
    manifest (a section name looked up on an expression that names a manifest)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        key, on = None, ""
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key, on = node.slice.value, ast.unparse(node.value)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key, on = node.args[0].value, ast.unparse(node.func.value)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "get_field":
            key, on = "training", "manifest"
        if key in SECTIONS and "manifest" in on:
            found.append(f"{name}:{node.lineno} {on}[{key!r}]")
    return found


def test_job_modules_read_the_manifest_by_attribute_only():
    """(The token windows still get the stored JSON, `lock["manifest"]`: they are shared with the gate's
    evaluation, a reader of the store.)"""
    planted = 'steps = ctx.manifest["training"]["steps"]\nlive = manifest.get("debug", {})\n'
    assert len(_section_lookups(planted, "planted")) == 2  # the scan finds what it looks for
    found = [hit for f in JOB_FILES for hit in _section_lookups(f.read_text(), f.name)]
    assert found == []


def test_a_misspelt_field_is_an_error_not_a_default(manifest):
    with pytest.raises(AttributeError):
        manifest.training.max_grad_nrom  # noqa: B018 (a typo a dict's .get would have hidden)
    from disttrace.run import faults
    from disttrace.run.job import topology
    from disttrace.run.record import flightrec

    assert topology.mesh_shape(manifest) == ((1, 2, 1), ("pp", "dp", "tp"))
    assert flightrec.trace_mode(manifest, "gloo") == "metadata"
    assert faults.capabilities(manifest) == {"backward", "collective_hook"}


def test_worker_refuses_a_lock_the_model_refuses_naming_file_and_field(tmp_path):
    from disttrace.run.job.launch import prepare

    run_dir = prepare(freeze(DEFAULT), tmp_path, "reference")
    lock = read_json(run_dir / LOCK)
    lock["manifest"]["training"]["stepz"] = lock["manifest"]["training"].pop("steps")
    write_json_atomic(run_dir / LOCK, lock)
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace.worker", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert LOCK in line and "training." in line, line


def test_memory_ledger_layout_reads_a_manifest_and_the_attached_ledger_dict(manifest):
    from disttrace.run.record.memory import LedgerLayout

    typed = LedgerLayout.model_validate(manifest)
    assert (typed.parallelism.dp, typed.parallelism.zero_stage, typed.training.optimizer) == (
        2,
        0,
        "adamw",
    )
    attached = LedgerLayout.model_validate(
        {
            "parallelism": {"dp": 2, "world_size": 2, "engine": "DDP"},
            "training": {"dtype": "float32", "optimizer": "sgd"},
        }
    )
    assert (attached.parallelism.tp, attached.training.optimizer) == (1, "sgd")


# ---------------------------------------------------------------- attached runs


def _attached_manifest(run_dir: Path) -> tuple[dict, str]:
    lock = read_json(Path(run_dir) / LOCK)
    return lock["manifest"], lock["manifest_id"]


def _assert_validates_and_round_trips(stored: dict, manifest_id: str) -> AttachedManifest:
    m = AttachedManifest.model_validate(stored)
    # built through the model, attach would write the same bytes: the same manifest id
    assert m.document() == stored
    assert hashlib.sha256(canonical_json(m.document())).hexdigest() == manifest_id
    return m


def test_a_plain_attached_run_writes_a_manifest_of_the_attached_shape(tmp_path):
    code = (
        "import torch, disttrace.api as d\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))\n"
        "o = torch.optim.SGD(m.parameters(), lr=1, momentum=0.5)\n"
        f"r = d.attach(m, o, out={str(tmp_path)!r}, config={{'grad_accum_steps': 2, 'data': 'x'}})\n"
        "for _ in range(2):\n"
        "    o.zero_grad(); r.loss(m(torch.ones(3, 4)).sum()).backward(); o.step()\n"
        "r.close(); print(r.run_dir)\n"
    )
    proc = run_snippet(code)
    assert proc.returncode == 0, proc.stderr
    stored, manifest_id = _attached_manifest(Path(proc.stdout.strip().splitlines()[-1]))
    m = _assert_validates_and_round_trips(stored, manifest_id)
    assert m.parallelism.engine == "plain" and m.world_size == 1
    assert m.training.lr == 1 and isinstance(
        m.training.lr, int
    )  # the script's int stays an int (same id)
    assert m.training.grad_accum_steps == 2 and m.config == {"data": "x"}
    assert (
        m.model.tensors["0.weight"].shape == [3, 4] and m.model.parameters == 4 * 3 + 3 + 3 * 2 + 2
    )


def test_a_ddp_attached_run_writes_a_manifest_of_the_attached_shape(tmp_path):
    script = ROOT / "tests" / "scripts" / "accum_train.py"
    proc = subprocess.run(
        [sys.executable, script, "--out", tmp_path, "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    stored, manifest_id = _attached_manifest(Path(proc.stdout.strip().splitlines()[-1]))
    m = _assert_validates_and_round_trips(stored, manifest_id)
    assert (m.parallelism.engine, m.parallelism.dp, m.world_size) == ("DDP", 2, 2)
    assert (
        m.training.optimizer == "AdamW"
        and m.training.grad_accum_steps == 2
        and m.training.steps == 1
    )


def test_attached_manifest_refuses_an_unknown_field():
    stored = {
        "experiment": {"name": "n", "edition": "user", "seed": 0},
        "parallelism": {"dp": 1, "world_size": 1, "engine": "plain"},
        "model": {
            "class": "Linear",
            "parameters": 2,
            "tensors": {"w": {"shape": [2], "dtype": "float32"}},
        },
        "optimizer": {"type": "torch.optim.sgd.SGD", "param_groups": {"0": {"lr": 0.1}}},
        "training": {"optimizer": "SGD", "dtype": "float32"},
    }
    assert AttachedManifest.model_validate(stored).training.grad_accum_steps is None
    stored["training"]["learning_rate"] = 0.1
    with pytest.raises(ValueError, match="learning_rate"):
        AttachedManifest.model_validate(stored)


def test_fault_checks_read_an_attached_stand_in_manifest():
    """attach.build_fault checks a fault against its stored dict plus clipping and a checkpoint per step;
    without an accumulation count the check fails with TypeError, which attach turns into its advice."""
    from disttrace.run import faults

    stand_in = {
        "experiment": {"name": "n", "edition": "user", "seed": 0},
        "parallelism": {"dp": 2, "world_size": 2, "engine": "DDP", "architecture": "allreduce"},
        "model": {"class": "M", "parameters": 0, "tensors": {}},
        "optimizer": {"type": "torch.optim.adamw.AdamW", "param_groups": {}},
        "training": {"optimizer": "AdamW", "dtype": "float32", "max_grad_norm": 1.0, "steps": 3},
        "checkpoint": {"interval": 1},
        "config": {},
    }
    late = faults.get("late-microbatch")
    with pytest.raises(TypeError):
        late.check(3, {}, stand_in)
    stand_in["training"]["grad_accum_steps"] = 1
    with pytest.raises(BadInput, match="grad_accum_steps"):
        late.check(3, {}, stand_in)
    stand_in["training"]["grad_accum_steps"] = 2
    late.check(3, {}, stand_in)  # accepted
    faults.get("clip-local-norm").check(3, {}, stand_in)  # clipping is on in the stand-in
