"""Cross-engine equivalence: a DeepSpeed config imported with `freeze --from-deepspeed` and run by the harness
(FSDP2 for ZeRO-2) against the user's own DeepSpeed run of the same model and data (tests/scripts/
ds_harness_train.py: the harness's LLaMA built from the lock, the harness's token windows, DeepSpeed's engine
with that config). The oracles: the numeric diff's derived bound on the equivalent pair, and, for the
controls, the field each one changes by construction (an lr, a seed, a global batch).

The default tier checks the identity rules on locks alone; the end-to-end pairs are in the slow tier.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli, last_line
from launchers import launch, need_deepspeed, torchrun_cmd

from disttrace.config.deepspeed import freeze_from_deepspeed
from disttrace.config.freezing import read_lock
from disttrace.config.harness import harness_config
from disttrace.config.identity import CLAIM, experiment_differences, model_tensors
from disttrace.errors import BadInput
from disttrace.store.records import ATTACHED_SOURCE
from disttrace.store.rundir import Run

SCRIPT = str(ROOT / "tests" / "scripts" / "ds_harness_train.py")
SETS = ["training.steps=3", "checkpoint.interval=0"]


def ds_config(accum: int = 2, lr: float = 3e-3, stage: int = 2) -> dict:
    return {
        "train_batch_size": 4 * accum * 2,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": accum,
        "zero_optimization": {"stage": stage},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": lr,
                "betas": [0.9, 0.95],
                "eps": 1e-8,
                "weight_decay": 0.1,
                "torch_adam": True,
            },
        },
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
    }


def freeze_lock(tmp_path: Path, name: str, cfg: dict, sets=SETS) -> tuple[Path, Path]:
    ds = tmp_path / f"{name}.json"
    ds.write_text(json.dumps(cfg))
    lock = tmp_path / f"{name}.lock.json"
    proc = cli(
        "freeze", "--from-deepspeed", ds, *[x for s in sets for x in ("--set", s)], "-o", lock
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ds, lock


# ---------------------------------------------------------------- the default tier: locks only


def attached_like(lock: dict, lr_scale: float = 1.0, global_batch: int = 16) -> dict:
    """The lock attach writes for ds_harness_train.py's engine (its shape as tests/test_manifest_typed.py
    holds it), for the unit checks of the identity rule; the slow tier compares the real one."""
    m = lock["manifest"]
    t = m["training"]
    group = {
        "lr": t["lr"] * lr_scale,
        "betas": [t["beta1"], t["beta2"]],
        "eps": 1e-8,
        "weight_decay": t["weight_decay"],
        "amsgrad": False,
        "foreach": None,
        "maximize": False,
        "capturable": False,
        "differentiable": False,
        "fused": None,
    }
    return {
        "manifest": {
            "experiment": {
                "name": "ds-harness",
                "edition": "user",
                "seed": m["experiment"]["seed"],
            },
            "parallelism": {"dp": 2, "world_size": 2, "zero_stage": 2, "engine": "DeepSpeed"},
            "model": {
                "class": "Transformer",
                "parameters": 0,
                "tensors": {
                    n: {"shape": s, "dtype": "float32"}
                    for n, s in model_tensors(m["model"]).items()
                },
            },
            "optimizer": {"type": "torch.optim.adamw.AdamW", "param_groups": {"0": group}},
            "training": {
                "optimizer": "AdamW",
                "dtype": "float32",
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "beta1": t["beta1"],
                "beta2": t["beta2"],
                "steps": t["steps"],
            },
            "config": harness_config(lock),
        },
        "manifest_id": "0" * 64,
        "source": ATTACHED_SOURCE,
        "observed": {"global_batch": global_batch, "step": 1},
    }


@pytest.fixture
def locks(tmp_path):
    frozen, _ = freeze_from_deepspeed(_write(tmp_path, "ds", ds_config()), None, None, SETS)
    other, _ = freeze_from_deepspeed(
        _write(tmp_path, "ds-seed", ds_config()), None, None, [*SETS, "experiment.seed=7"]
    )
    return frozen.model_dump(), other.model_dump()


def _write(tmp_path: Path, name: str, cfg: dict) -> Path:
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(cfg))
    return p


def test_the_harness_model_shapes_are_the_built_models():
    """model_tensors (no torch) against the plain LLaMA itself: names, order and shapes."""
    from disttrace.config.freezing import freeze
    from disttrace.model.llama import build_model

    for sets in ([], ["model.n_kv_heads=4", "model.n_layers=3", "model.ffn_hidden=100"]):
        m = freeze(None, sets).model()
        built = {n: list(p.shape) for n, p in build_model(m.model).named_parameters()}
        want = model_tensors(m.model.model_dump())
        assert list(want.items()) == list(built.items()), sets


def test_an_attached_run_stating_the_harness_experiment_is_held_to_it(locks):
    """Equal where it is the experiment; each control names the field it changes, in either order."""
    harness, other = locks
    same = attached_like(harness)
    assert experiment_differences(harness, same) == ([], [])
    assert experiment_differences(same, harness) == ([], [])
    # the script's optimizer runs another lr than the one it states (1e-3 relative)
    diffs, _ = experiment_differences(harness, attached_like(harness, lr_scale=1.001))
    assert [k for k, _, _ in diffs] == ["optimizer.param_groups.0.lr"], diffs
    # it states another frozen experiment (another seed): the statement's field is named
    wrong = attached_like(other)
    diffs, _ = experiment_differences(harness, wrong)
    assert [k for k, _, _ in diffs] == ["experiment.seed"], diffs  # stated and given to attach
    assert diffs[0][1:] == (1234, 7)
    # another global batch, counted
    diffs, _ = experiment_differences(harness, attached_like(harness, global_batch=32))
    assert diffs == [("global_batch", 16, 32)]
    # a model with another shape than the statement's
    bad = attached_like(harness)
    bad["manifest"]["model"]["tensors"]["layers.0.attention.wk.weight"]["shape"] = [64, 64]
    diffs, _ = experiment_differences(harness, bad)
    assert [k for k, _, _ in diffs] == ["model.tensors.layers.0.attention.wk.weight.shape"]
    # another optimizer class, another eps, a config key the harness does not have
    bad = attached_like(harness)
    bad["manifest"]["training"]["optimizer"] = "Adam"
    bad["manifest"]["optimizer"]["param_groups"]["0"]["eps"] = 1e-6
    bad["manifest"]["config"]["schedule"] = "cosine"
    diffs, _ = experiment_differences(harness, bad)
    assert {k for k, _, _ in diffs} == {
        "training.optimizer",
        "optimizer.param_groups.0.eps",
        "config.schedule",
    }, diffs


def test_without_the_statement_a_harness_run_and_an_attached_one_stay_different(locks):
    harness, _ = locks
    plain = attached_like(harness)
    del plain["manifest"]["config"][CLAIM]
    diffs, _ = experiment_differences(harness, plain)
    assert "data.sha256" in {k for k, _, _ in diffs}
    # a statement between two attached runs is just config (compared as the lenient rule does)
    a, b = attached_like(harness), copy.deepcopy(attached_like(harness))
    assert experiment_differences(a, b) == ([], [])


def test_a_lock_runs_as_frozen_or_not_at_all(tmp_path, locks):
    harness, _ = locks
    lock = tmp_path / "lock.json"
    lock.write_bytes(orjson.dumps(harness))
    assert read_lock(lock).model_dump() == harness
    edited = copy.deepcopy(harness)
    edited["manifest"]["training"]["lr"] = 0.1
    lock.write_bytes(orjson.dumps(edited))
    with pytest.raises(BadInput) as e:
        read_lock(lock)
    assert e.value.field == "manifest_id"
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(harness["resolved"]["data_path"], corpus)
    with corpus.open("a") as f:
        f.write('{"id": "extra", "text": "one more"}\n')
    moved = copy.deepcopy(harness)
    moved["resolved"]["data_path"] = str(corpus)
    lock.write_bytes(orjson.dumps(moved))
    with pytest.raises(BadInput) as e:
        read_lock(lock)
    assert e.value.field == "manifest.data.sha256"
    lock.write_bytes(orjson.dumps(harness))
    proc = cli("run", lock, "--set", "training.steps=2", "--out", tmp_path / "runs")
    assert proc.returncode == 2 and "--set" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- end to end, on DeepSpeed itself


def _need_deepspeed():
    need_deepspeed("the cross-engine comparison")


def ds_run(out: Path, lock: Path, ds: Path, *args) -> Path:
    return launch(torchrun_cmd(SCRIPT), out, "--lock", lock, "--ds-config", ds, *args)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    _need_deepspeed()
    tmp = tmp_path_factory.mktemp("dscross")
    ds, lock = freeze_lock(tmp, "ds2", ds_config())
    harness = last_line(cli("run", lock, "--out", tmp / "runs", "--quiet", timeout=600, check=0))
    return tmp, ds, lock, harness, ds_run(tmp / "runs", lock, ds)


@pytest.mark.slow
def test_the_harness_fsdp2_run_equals_the_users_deepspeed_zero2_run(pair):
    """The imported ZeRO-2 config runs on FSDP2 in the harness and on DeepSpeed's engine in the script:
    every reduced gradient piece, clipped gradient, clip scalar, parameter and Adam moment of the 3 steps
    within the derived bound, and the losses of the micro-batches holding the same samples."""
    tmp, ds, lock, harness, deepspeed = pair
    assert read_lock(lock).manifest["parallelism"]["zero_stage"] == 2
    assert Run(harness).manifest_doc["parallelism"]["dp"] == 2  # FSDP2 over both ranks
    assert Run(deepspeed).manifest_doc["parallelism"]["engine"] == "DeepSpeed"
    assert Run(deepspeed).manifest_doc["parallelism"]["zero_stage"] == 2
    proc = cli("diff", harness, deepspeed, "--mode", "numeric", "--json")
    doc = orjson.loads(proc.stdout)
    assert proc.returncode == 0 and doc["equal"], (doc.get("first_divergence"), doc["warnings"])
    assert doc["compared_steps"]["count"] == 3 and doc["warnings"] == [], doc["warnings"]
    assert doc["compared_phases"] == ["reduce", "clip", "optimizer"]
    assert doc["tolerance"]["kind"] == "derived"
    by_phase = doc["numeric"]["by_phase"]
    assert {"loss", "reduce", "clip", "optimizer"} <= set(by_phase), by_phase
    # two engines, two summation orders: not the same bits, and well inside the bound
    assert by_phase["reduce"]["max_rel_err"] > 0
    assert all(p["max_ratio"] < 1 for p in by_phase.values()), by_phase


def _refused(proc, field: str) -> None:
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and f": {field}: not the same experiment" in last, proc.stderr[
        -2000:
    ]
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.slow
def test_a_deepspeed_run_at_another_lr_is_refused_naming_it(pair):
    """The script's DeepSpeed optimizer runs 1.001 x the lr the lock (and its statement) says."""
    tmp, ds, lock, harness, _ = pair
    other = ds_run(tmp / "runs", lock, ds, "--lr-scale", "1.001")
    _refused(cli("diff", harness, other, "--mode", "numeric"), "optimizer.param_groups.0.lr")


@pytest.mark.slow
def test_a_deepspeed_run_of_another_global_batch_is_refused_naming_it(pair):
    """Accumulation 4 instead of 2 (train_batch_size 32): the batch the run counted is 32, not 16."""
    tmp, _, _, harness, _ = pair
    ds, lock = freeze_lock(tmp, "ds2-accum4", ds_config(accum=4))
    other = ds_run(tmp / "runs", lock, ds)
    _refused(cli("diff", harness, other, "--mode", "numeric"), "global_batch")


@pytest.mark.slow
def test_a_deepspeed_run_that_builds_another_initialisation_diverges_at_step_1(pair):
    """What attach cannot see (the script built the model from another seed than it states) is found by
    the numbers: the first micro-batch's loss already differs beyond the bound."""
    tmp, ds, lock, harness, _ = pair
    other = ds_run(tmp / "runs", lock, ds, "--init-seed", "99")
    proc = cli("diff", harness, other, "--mode", "numeric", "--json")
    first = orjson.loads(proc.stdout)["first_divergence"]
    assert proc.returncode == 1 and first["step"] == 1, first
