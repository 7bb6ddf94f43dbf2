"""`freeze --from-deepspeed`: a DeepSpeed config read into a manifest. No job is launched here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrace.config.deepspeed import (
    BatchAssertion,
    freeze_from_deepspeed,
    identity_message,
    manifest_from_deepspeed,
    resolve_batch,
)
from disttrace.config.freezing import freeze, freeze_doc, read_toml
from disttrace.config.manifest import DEFAULT_MANIFEST
from disttrace.errors import BadInput

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "manifests" / "deepspeed" / "ds_config.json"

# DeepSpeedConfig._batch_assertion (deepspeed/runtime/config.py), verbatim with the values filled in
DS_IDENTITY = (
    "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
    "gradient_acc_step * world_size {} != {} * {} * {}"
)


def write(tmp_path: Path, cfg, name: str = "ds.json") -> Path:
    p = tmp_path / name
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg), encoding="utf-8")
    return p


def cfg(**over):
    base = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


def keys(warnings: list[str]) -> set[str]:
    return {w.split(":", 1)[0] for w in warnings}


# ---------------------------------------------------------------- the example


def test_example_maps_onto_the_default_manifest():
    doc, warnings = manifest_from_deepspeed(EXAMPLE, None, 2)
    t, p = doc["training"], doc["parallelism"]
    assert (t["micro_batch_size"], t["grad_accum_steps"], p["dp"], p["zero_stage"]) == (4, 2, 2, 1)
    assert (t["optimizer"], t["lr"], t["beta1"], t["beta2"], t["weight_decay"], t["dtype"]) == (
        "adamw",
        3e-3,
        0.9,
        0.95,
        0.0,
        "float32",
    )
    assert (
        doc["experiment"] == read_toml(DEFAULT_MANIFEST)["experiment"]
    )  # the rest comes from the base
    assert keys(warnings) == {"steps_per_print", "wall_clock_breakdown"}
    assert t["max_grad_norm"] == 1.0  # gradient_clipping -> the clip phase's global norm


def test_example_freezes_to_the_default_with_zero_1():
    frozen, warnings = freeze_from_deepspeed(EXAMPLE)  # world size from the base: dp*tp*pp = 2
    assert (
        frozen.manifest_id
        == freeze(None, ["parallelism.zero_stage=1", "training.max_grad_norm=1.0"]).manifest_id
    )
    assert frozen.source == str(EXAMPLE)
    assert "gradient_clipping" not in keys(warnings)


def test_freeze_is_unchanged_by_the_freeze_doc_refactor():
    a = freeze(None, ["training.steps=4"])
    b = freeze_doc(read_toml(DEFAULT_MANIFEST), DEFAULT_MANIFEST, ["training.steps=4"])
    assert a == b


def test_overrides_apply_and_cannot_break_the_identity(tmp_path):
    frozen, _ = freeze_from_deepspeed(EXAMPLE, overrides=["training.steps=4"])
    assert frozen.manifest["training"]["steps"] == 4 and frozen.overrides == ["training.steps=4"]
    with pytest.raises(BadInput) as e:
        freeze_from_deepspeed(EXAMPLE, overrides=["training.micro_batch_size=8"])
    assert (e.value.where, e.value.field) == (str(EXAMPLE), "train_batch_size")
    assert e.value.reason == DS_IDENTITY.format(16, 8, 2, 2)


def test_world_size_sets_dp(tmp_path):
    p = write(tmp_path, cfg(train_batch_size=32))
    doc, _ = manifest_from_deepspeed(p, None, 4)
    assert doc["parallelism"]["dp"] == 4
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p, None, 2)  # 32 != 4 * 2 * 2
    assert e.value.reason == DS_IDENTITY.format(32, 4, 2, 2)
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p, None, 0)
    assert e.value.where == "--world-size"


# ---------------------------------------------------------------- DeepSpeed's batch rules, DeepSpeed's words


def test_identity_failure_has_deepspeeds_exact_wording(tmp_path):
    p = write(tmp_path, cfg())
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p, None, 4)
    msg = (
        "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
        "gradient_acc_step * world_size 16 != 4 * 2 * 4"
    )
    assert e.value.reason == msg == identity_message(16, 4, 2, 4)
    assert (e.value.where, e.value.field) == (str(p), "train_batch_size")
    assert str(e.value) == f"{p}: train_batch_size: {msg}"


@pytest.mark.parametrize(
    "train, micro, accum, world, want",
    [
        (16, 4, None, 2, (16, 4, 2)),  # grad_acc = train // micro // world
        (16, None, 2, 2, (16, 4, 2)),  # micro = train // world // grad_acc
        (None, 4, 2, 2, (16, 4, 2)),  # train = micro * grad_acc * world
        (8, None, None, 2, (8, 4, 1)),  # only train: grad_acc 1, micro = train // world
        (None, 4, None, 2, (8, 4, 1)),  # only micro: grad_acc 1, train = micro * world
        (32, 4, None, 4, (32, 4, 2)),
    ],
)
def test_two_of_three_inference(train, micro, accum, world, want):
    got = resolve_batch(train, micro, accum, world)
    assert got[:3] == want
    assert len(got[3]) == (0 if None not in (train, micro, accum) else 1)  # one note per inference


def test_inference_mapped_into_the_manifest(tmp_path):
    p = write(tmp_path, cfg(gradient_accumulation_steps=None))
    doc, warnings = manifest_from_deepspeed(p, None, 2)
    assert doc["training"]["grad_accum_steps"] == 2
    assert any(
        w.startswith("gradient_accumulation_steps: not given; DeepSpeed infers 2") for w in warnings
    )


@pytest.mark.parametrize(
    "train, micro, accum, world, message, field",
    [
        # floor division as DeepSpeed does, then its assertion
        (17, 4, None, 2, DS_IDENTITY.format(17, 4, 2, 2), "train_batch_size"),
        (
            16,
            4,
            None,
            8,
            "Gradient accumulation steps: 0 has to be greater than 0",
            "gradient_accumulation_steps",
        ),
        (0, 4, 2, 2, "Train batch size: 0 has to be greater than 0", "train_batch_size"),
        (
            16,
            -4,
            -2,
            2,
            "Micro batch size per gpu: -4 has to be greater than 0",
            "train_micro_batch_size_per_gpu",
        ),
        (
            16,
            4,
            0,
            2,
            "Gradient accumulation steps: 0 has to be greater than 0",
            "gradient_accumulation_steps",
        ),
        (
            16,
            0,
            None,
            2,
            "Micro batch size per gpu: 0 has to be greater than 0",
            "train_micro_batch_size_per_gpu",
        ),
        (
            16,
            None,
            0,
            2,
            "Gradient accumulation steps: 0 has to be greater than 0",
            "gradient_accumulation_steps",
        ),
        (
            None,
            None,
            2,
            2,
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            "train_batch_size",
        ),
    ],
)
def test_batch_assertions(train, micro, accum, world, message, field):
    with pytest.raises(BatchAssertion) as e:
        resolve_batch(train, micro, accum, world)
    assert (str(e.value), e.value.field) == (message, field)


@pytest.mark.parametrize("value", ["auto", 4.0, True, "4", [4]])
def test_batch_values_must_be_integers(tmp_path, value):
    p = write(tmp_path, cfg(train_micro_batch_size_per_gpu=value))
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p, None, 2)
    assert (e.value.where, e.value.field) == (str(p), "train_micro_batch_size_per_gpu")


# ---------------------------------------------------------------- refused, unsupported, ignored


@pytest.mark.parametrize("key", ["fp16", "bf16", "bfloat16", "amp"])
@pytest.mark.parametrize("enabled", [True, "auto"])
def test_mixed_precision_enabled_is_refused_naming_the_key(tmp_path, key, enabled):
    p = write(tmp_path, cfg(**{key: {"enabled": enabled}}))
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p, None, 2)
    assert (e.value.where, e.value.field) == (str(p), f"{key}.enabled")
    assert f"{p}: {key}.enabled: " in str(e.value)


def test_mixed_precision_disabled_is_fine_and_its_options_are_listed(tmp_path):
    p = write(tmp_path, cfg(fp16={"enabled": False, "loss_scale": 0}, bf16={"enabled": False}))
    doc, warnings = manifest_from_deepspeed(p, None, 2)
    assert doc["training"]["dtype"] == "float32"
    assert keys(warnings) == {
        "fp16.loss_scale",
        "optimizer",
    }  # optimizer: not given, the base's kept


def test_unsupported_and_unknown_keys_are_listed(tmp_path):
    p = write(
        tmp_path,
        cfg(
            zero_optimization={
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "overlap_comm": True,
            },
            optimizer={
                "type": "Adam",
                "params": {"lr": 1e-3, "eps": 1e-6, "betas": [0.9, 0.99], "foo": 1},
            },
            scheduler={"type": "WarmupLR", "params": {}},
            gradient_clipping=1.0,
            prescale_gradients=False,
            tensorboard={"enabled": True},
            my_own_key=3,
        ),
    )
    doc, warnings = manifest_from_deepspeed(p, None, 2)
    assert doc["parallelism"]["zero_stage"] == 2 and doc["training"]["optimizer"] == "adamw"
    by_key = {w.split(":", 1)[0]: w for w in warnings}
    assert set(by_key) == {
        "zero_optimization.offload_optimizer",
        "zero_optimization.overlap_comm",
        "optimizer.params.eps",
        "optimizer.params.foo",
        "optimizer.params.weight_decay",
        "scheduler",
        "prescale_gradients",
        "tensorboard",
        "my_own_key",
    }
    assert doc["training"]["max_grad_norm"] == 1.0
    for k in ("zero_optimization.offload_optimizer", "optimizer.params.eps", "scheduler"):
        assert by_key[k].startswith(f"{k}: unsupported:"), by_key[k]
    for k in ("zero_optimization.overlap_comm", "prescale_gradients", "tensorboard"):
        assert by_key[k].startswith(f"{k}: ignored:"), by_key[k]
    assert by_key["my_own_key"].startswith("my_own_key: unknown:")


def test_deepspeed_optimizer_defaults(tmp_path):
    p = write(tmp_path, cfg(optimizer={"type": "AdamW"}))
    doc, warnings = manifest_from_deepspeed(p, None, 2)
    t = doc["training"]
    assert (t["lr"], t["beta1"], t["beta2"], t["weight_decay"]) == (
        1e-3,
        0.9,
        0.999,
        0.0,
    )  # FusedAdam's
    assert {
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.weight_decay",
    } <= keys(warnings)


def test_sgd_maps_and_other_optimizers_are_refused(tmp_path):
    p = write(tmp_path, cfg(optimizer={"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}))
    doc, warnings = manifest_from_deepspeed(p, None, 2)
    assert (doc["training"]["optimizer"], doc["training"]["lr"]) == ("sgd", 0.1)
    assert any(w.startswith("optimizer.params.momentum: unsupported") for w in warnings)
    for bad, field in (
        ({"type": "Lamb"}, "optimizer.type"),
        (
            {"type": "Adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}},
            "optimizer.params.adam_w_mode",
        ),
        ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, "optimizer.params.max_grad_norm"),
        ({"type": "AdamW", "params": {"lr": "auto"}}, "optimizer.params.lr"),
    ):
        p = write(tmp_path, cfg(optimizer=bad))
        with pytest.raises(BadInput) as e:
            manifest_from_deepspeed(p, None, 2)
        assert e.value.field == field


def test_a_manifest_check_on_a_deepspeed_value_names_the_deepspeed_key(tmp_path):
    # a base with tensor parallel: freeze refuses ZeRO with tp > 1; the ZeRO stage came from the DeepSpeed file
    text = DEFAULT_MANIFEST.read_text().replace("dp = 2\ntp = 1", "dp = 1\ntp = 2")
    (tmp_path / "data").symlink_to(DEFAULT_MANIFEST.parent / "data")
    base = tmp_path / "tp.toml"
    base.write_text(text)
    p = write(tmp_path, cfg(train_batch_size=8, zero_optimization={"stage": 1}))
    with pytest.raises(BadInput) as e:
        freeze_from_deepspeed(p, base)
    assert (e.value.where, e.value.field) == (str(p), "zero_optimization.stage")
    frozen, _ = freeze_from_deepspeed(
        write(tmp_path, cfg(train_batch_size=8)), base
    )  # dp = 2 / tp 2 = 1
    assert frozen.manifest["parallelism"]["tp"] == 2 and frozen.manifest["parallelism"]["dp"] == 1


# ---------------------------------------------------------------- unreadable files


@pytest.mark.parametrize(
    "text, reason",
    [
        ('{"train_batch_size": 16,\n  "gradient_clipping": 1.0,\n}', "line 3"),
        ('{"train_batch_size": 16', "line 1"),
        ("", "line 1"),
        ("[1, 2]", "JSON object"),
        ('{"a": 1, "a": 2}', "duplicate key"),
        ("[" * 100_000, "nested"),
        ('{"train_batch_size": ' + "1" * 5000 + "}", "not valid JSON"),
    ],
)
def test_bad_json_names_the_file(tmp_path, text, reason):
    p = write(tmp_path, text)
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(p)
    assert e.value.where == str(p) and reason in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(tmp_path / "nope.json")
    assert e.value.where == str(tmp_path / "nope.json") and "not found" in e.value.reason
    with pytest.raises(BadInput) as e:
        manifest_from_deepspeed(tmp_path)
    assert e.value.where == str(tmp_path)


def test_cli_freeze_from_deepspeed(tmp_path):
    from conftest import cli

    ok = cli("freeze", "--from-deepspeed", EXAMPLE, "--json")
    assert ok.returncode == 0 and '"zero_stage": 1' in ok.stdout
    bad = tmp_path / "ds.json"
    bad.write_text(
        '{"train_batch_size": 15, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}'
    )
    proc = cli("freeze", "--from-deepspeed", bad)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "train_batch_size: Check batch related parameters. train_batch_size is not equal to "
            "micro_batch_per_gpu * gradient_acc_step * world_size 15 != 4 * 2 * 2"
        )
    )
