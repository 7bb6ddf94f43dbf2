"""Read a DeepSpeed config (JSON) into a manifest: `disttrace freeze --from-deepspeed ds_config.json`.

The config is laid over a base manifest (default manifests/default.toml), which supplies what a DeepSpeed
config does not hold: the experiment, data, tokenizer, model, steps, seed. What DeepSpeed does hold is
mapped where the manifest has a field for it, refused where running without it would compute something else
than DeepSpeed would (fp16/bf16), and otherwise *named* in the returned list: nothing is dropped silently.

The batch identity is checked exactly as DeepSpeed checks it (``DeepSpeedConfig._set_batch_related_parameters``
then ``_batch_assertion`` in deepspeed/runtime/config.py), with DeepSpeed's own wording, so the message a user
gets here is the one DeepSpeed would have stopped with on the cluster. DeepSpeed's ``world_size`` there is
the data-parallel size (``mpu.get_data_parallel_world_size()``; the whole world when there is no model
parallelism), i.e. ``parallelism.dp``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from disttrace.config.manifest import (
    DEFAULT_MANIFEST,
    Frozen,
    freeze_doc,
    read_text_file,
    read_toml,
    validate,
)
from disttrace.errors import BadInput

TRAIN_BATCH = "train_batch_size"
MICRO_BATCH = "train_micro_batch_size_per_gpu"
GRAD_ACC = "gradient_accumulation_steps"


# ---------------------------------------------------------------- DeepSpeed's batch rules, DeepSpeed's words


class BatchAssertion(ValueError):
    """DeepSpeed's batch assertion failed; `field` is the DeepSpeed key it is about."""

    def __init__(self, message: str, field: str):
        self.field = field
        super().__init__(message)


def identity_message(train_batch: Any, micro_batch: Any, grad_acc: Any, world_size: Any) -> str:
    # verbatim from DeepSpeedConfig._batch_assertion
    return (
        "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
        f"gradient_acc_step * world_size {train_batch} != {micro_batch} * {grad_acc} * {world_size}"
    )


def _positive(train_batch: int, micro_batch: int, grad_acc: int) -> None:
    # the three `> 0` assertions of DeepSpeedConfig._batch_assertion, in its order, in its words
    if not train_batch > 0:
        raise BatchAssertion(
            f"Train batch size: {train_batch} has to be greater than 0", TRAIN_BATCH
        )
    if not micro_batch > 0:
        raise BatchAssertion(
            f"Micro batch size per gpu: {micro_batch} has to be greater than 0", MICRO_BATCH
        )
    if not grad_acc > 0:
        raise BatchAssertion(
            f"Gradient accumulation steps: {grad_acc} has to be greater than 0", GRAD_ACC
        )


def resolve_batch(
    train_batch: int | None, micro_batch: int | None, grad_acc: int | None, world_size: int
) -> tuple[int, int, int, list[str]]:
    """DeepSpeed's `_set_batch_related_parameters` then `_batch_assertion`: fill in what is missing by
    DeepSpeed's rules (floor division, as DeepSpeed does), then assert. Returns (train, micro, accum, notes),
    a note per inferred value; raises BatchAssertion with DeepSpeed's message.

    Where DeepSpeed itself would divide by zero (a stated 0 it divides by) the `> 0` assertion for that
    value is raised instead of a ZeroDivisionError."""
    notes: list[str] = []
    w = world_size
    if train_batch is not None and micro_batch is not None and grad_acc is not None:
        pass
    elif train_batch is not None and micro_batch is not None:
        if micro_batch == 0:
            _positive(train_batch, micro_batch, 1)
        grad_acc = train_batch // micro_batch // w
        notes.append(
            f"{GRAD_ACC}: not given; DeepSpeed infers {grad_acc} = {TRAIN_BATCH} {train_batch} // "
            f"{MICRO_BATCH} {micro_batch} // world_size {w}"
        )
    elif train_batch is not None and grad_acc is not None:
        if grad_acc == 0:
            _positive(train_batch, 1, grad_acc)
        micro_batch = train_batch // w // grad_acc
        notes.append(
            f"{MICRO_BATCH}: not given; DeepSpeed infers {micro_batch} = {TRAIN_BATCH} {train_batch} // "
            f"world_size {w} // {GRAD_ACC} {grad_acc}"
        )
    elif micro_batch is not None and grad_acc is not None:
        train_batch = micro_batch * grad_acc * w
        notes.append(
            f"{TRAIN_BATCH}: not given; DeepSpeed infers {train_batch} = {MICRO_BATCH} {micro_batch} * "
            f"{GRAD_ACC} {grad_acc} * world_size {w}"
        )
    elif train_batch is not None:
        grad_acc = 1
        micro_batch = train_batch // w
        notes.append(
            f"{GRAD_ACC}, {MICRO_BATCH}: not given; DeepSpeed infers {GRAD_ACC} 1 and {MICRO_BATCH} "
            f"{micro_batch} = {TRAIN_BATCH} {train_batch} // world_size {w}"
        )
    elif micro_batch is not None:
        train_batch = micro_batch * w
        grad_acc = 1
        notes.append(
            f"{TRAIN_BATCH}, {GRAD_ACC}: not given; DeepSpeed infers {GRAD_ACC} 1 and {TRAIN_BATCH} "
            f"{train_batch} = {MICRO_BATCH} {micro_batch} * world_size {w}"
        )
    else:
        # verbatim from DeepSpeedConfig._set_batch_related_parameters
        raise BatchAssertion(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            TRAIN_BATCH,
        )
    _positive(train_batch, micro_batch, grad_acc)
    if train_batch != micro_batch * grad_acc * w:
        raise BatchAssertion(identity_message(train_batch, micro_batch, grad_acc, w), TRAIN_BATCH)
    return train_batch, micro_batch, grad_acc, notes


# ---------------------------------------------------------------- reading the JSON


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    # DeepSpeed loads configs with dict_raise_error_on_duplicate_keys: a repeated key is an error, not "last wins"
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


class _Duplicate(Exception):
    pass


def read_ds_config(path: Path) -> dict:
    path = Path(path)
    text = read_text_file(path, "DeepSpeed config")
    try:
        cfg = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise BadInput(
            path, f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    except _Duplicate as e:
        raise BadInput(
            path, "duplicate key (DeepSpeed refuses repeated keys)", field=str(e.args[0])
        ) from None
    except RecursionError:
        raise BadInput(path, "not valid JSON (nested too deeply)") from None
    except ValueError as e:  # e.g. an integer literal longer than Python's int-conversion limit
        raise BadInput(path, f"not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadInput(path, f"a DeepSpeed config is a JSON object, not {_json_type(cfg)}")
    return cfg


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


# ---------------------------------------------------------------- what is mapped, refused, ignored

# Top-level keys with no manifest field. "ignored": changes nothing that is computed (logging, profiling,
# memory/communication tuning, DeepSpeed's own checkpoint files); "unsupported": would change the computation
# under DeepSpeed, but the manifest cannot express it, so the frozen manifest runs without it.
_TOP_LEVEL: dict[str, tuple[str, str]] = {
    "steps_per_print": ("ignored", "logging only"),
    "wall_clock_breakdown": ("ignored", "timing/logging only"),
    "memory_breakdown": ("ignored", "logging only"),
    "dump_state": ("ignored", "logging only"),
    "tensorboard": ("ignored", "monitoring only"),
    "wandb": ("ignored", "monitoring only"),
    "csv_monitor": ("ignored", "monitoring only"),
    "comet": ("ignored", "monitoring only"),
    "comms_logger": ("ignored", "logging only"),
    "flops_profiler": ("ignored", "profiling only"),
    "autotuning": ("ignored", "DeepSpeed's autotuner, not part of a run"),
    "timers": ("ignored", "timing only"),
    "checkpoint": (
        "ignored",
        "DeepSpeed's checkpoint-file options; disttrace writes its own DCP checkpoints "
        "(checkpoint.interval)",
    ),
    "nebula": ("ignored", "DeepSpeed's checkpoint service"),
    "aio": ("ignored", "NVMe swap I/O tuning"),
    "activation_checkpointing": (
        "ignored",
        "recomputation trades memory for time; the values are the same",
    ),
    "zero_allow_untested_optimizer": ("ignored", "a DeepSpeed safety switch"),
    "zero_force_ds_cpu_optimizer": ("ignored", "a DeepSpeed safety switch"),
    "dataloader_drop_last": ("ignored", "disttrace builds its own data loader"),
    "disable_allgather": ("ignored", "communication tuning"),
    "scheduler": (
        "unsupported",
        "the manifest has no learning-rate schedule (training.lr is constant); not applied",
    ),
    "pipeline": (
        "unsupported",
        "DeepSpeed's pipeline engine options; not applied (parallelism.pp)",
    ),
    "sparse_attention": (
        "unsupported",
        "the manifest's model has dense attention only; not applied",
    ),
    "sparse_gradients": ("unsupported", "not applied"),
    "compression_training": ("unsupported", "not applied"),
    "quantize_training": ("unsupported", "not applied"),
    "data_efficiency": ("unsupported", "data sampling/routing is not applied"),
    "curriculum_learning": ("unsupported", "not applied"),
    "progressive_layer_drop": ("unsupported", "not applied"),
    "data_types": ("unsupported", "not applied; gradients accumulate in training.dtype"),
    "communication_data_type": ("unsupported", "collectives run in training.dtype; not applied"),
    "seq_parallel_communication_data_type": ("unsupported", "not applied"),
    "prescale_gradients": (
        "unsupported",
        "not applied; gradients are averaged after the all-reduce",
    ),
    "gradient_predivide_factor": ("unsupported", "not applied"),
    "fp32_allreduce": ("ignored", "collectives already run in training.dtype (float32/float64)"),
    "hybrid_engine": ("unsupported", "not applied"),
    "tensor_parallel": ("unsupported", "DeepSpeed AutoTP options; not applied (parallelism.tp)"),
    "sequence_parallel_size": ("unsupported", "not applied"),
    "weight_quantization": ("unsupported", "not applied"),
    "vocabulary_size": (
        "ignored",
        "a DeepSpeed alignment hint; model.vocab_size comes from the base manifest",
    ),
}

# Values of those keys that are DeepSpeed's defaults, i.e. say "off": listed as ignored, not unsupported.
_HARMLESS: dict[str, tuple[Any, ...]] = {
    "sparse_gradients": (False,),
    "prescale_gradients": (False,),
    "gradient_predivide_factor": (1, 1.0),
    "communication_data_type": (None, "fp32"),
    "seq_parallel_communication_data_type": (None, "fp32"),
    "data_types": ({},),
}

_ADAM_EPS = 1e-8  # torch.optim.AdamW's eps, which the engine uses (the manifest has no eps field)


def _num(cfg_path: Path, key: str, v: Any, integer: bool = False) -> Any:
    if v == "auto":
        raise BadInput(
            cfg_path,
            "'auto' is filled in by the Hugging Face Trainer integration, not by DeepSpeed; "
            "state the value",
            field=key,
        )
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok:
        raise BadInput(
            cfg_path, f"must be {'an integer' if integer else 'a number'} (got {v!r})", field=key
        )
    return v


def _section(cfg_path: Path, key: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise BadInput(cfg_path, f"must be a JSON object (got {_json_type(v)})", field=key)
    return v


def _enabled(cfg_path: Path, key: str, sec: dict) -> bool:
    v = sec.get("enabled", False)
    if v is None:
        return False
    if v == "auto":
        return True  # 'auto' lets the Trainer turn it on; refuse it like true
    if not isinstance(v, bool):
        raise BadInput(cfg_path, f"must be true or false (got {v!r})", field=f"{key}.enabled")
    return v


def _set(doc: dict, dotted: str, value: Any) -> None:
    section, key = dotted.split(".")
    sec = doc.setdefault(section, {})
    if not isinstance(
        sec, dict
    ):  # the base was validated, so this cannot happen; never a traceback anyway
        raise BadInput(dotted, "is not a table", field=section)
    sec[key] = value


def manifest_from_deepspeed(
    ds_path: Path | str, base_manifest: Path | str | None = None, world_size: int | None = None
) -> tuple[dict, list[str]]:
    """Map a DeepSpeed config onto a manifest document (a dict in the TOML's shape) built from the base
    manifest. Returns (doc, warnings): one warning per DeepSpeed key that is not mapped (unsupported,
    ignored or unknown) and per value DeepSpeed would infer or default, each starting with the dotted key.

    Raises BadInput naming the DeepSpeed file and key for what cannot be mapped: fp16/bf16/amp enabled,
    an optimizer the manifest has no name for, a batch that fails DeepSpeed's own assertion (DeepSpeed's
    message, field train_batch_size), a value of the wrong type."""
    doc, warnings, _, _ = _build(
        Path(ds_path), Path(base_manifest) if base_manifest else DEFAULT_MANIFEST, world_size
    )
    return doc, warnings


def _build(
    ds_path: Path, base_path: Path, world_size: int | None
) -> tuple[dict, list[str], dict, dict]:
    """(doc, warnings, provenance: manifest field -> DeepSpeed key, the config's stated batch values).

    One small mapping per part of the DeepSpeed config, world size first because the batch identity
    (train = micro x accum x dp) needs dp; the others are independent. Every key is mapped, refused with
    its reason, or named in a warning: never dropped silently."""
    cfg = read_ds_config(ds_path)
    doc = read_toml(base_path)
    base = validate(
        copy.deepcopy(doc), base_path
    )  # the base must stand on its own; errors name the base
    warnings: list[str] = []
    provenance: dict[str, str] = {}  # manifest field -> DeepSpeed key it came from

    def put(field: str, value: Any, ds_key: str) -> None:
        _set(doc, field, value)
        provenance[field] = ds_key

    dp = _map_world(doc, base, world_size)
    vals = _map_batch(ds_path, cfg, dp, put, warnings)
    _map_precision(ds_path, cfg, doc, base, warnings)
    _map_zero(ds_path, cfg, put, warnings)
    if "optimizer" in cfg:
        _map_optimizer(ds_path, cfg["optimizer"], put, warnings)
    else:
        warnings.append(
            f"optimizer: not given (DeepSpeed then uses the client's optimizer); the base manifest's "
            f"{base.training.optimizer} with lr {base.training.lr} is kept"
        )
    _map_clipping(ds_path, cfg, put, warnings)
    _refuse_elasticity(ds_path, cfg, warnings)
    _name_the_rest(cfg, warnings)
    return doc, warnings, provenance, vals


def _map_world(doc: dict, base, world_size: int | None) -> int:
    """DeepSpeed's world_size in the batch identity is the data-parallel size: dp = world / (tp * pp)."""
    tp, pp = base.parallelism.tp, base.parallelism.pp
    if world_size is None:
        world = base.world_size
    else:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise BadInput("--world-size", f"must be a whole number >= 1 (got {world_size!r})")
        world = world_size
        if world % (tp * pp):
            raise BadInput(
                "--world-size", f"{world} is not divisible by the base manifest's tp*pp = {tp}*{pp}"
            )
    dp = world // (tp * pp)
    _set(doc, "parallelism.dp", dp)
    if "world_size" in doc.get("parallelism", {}):
        _set(doc, "parallelism.world_size", world)
    return dp


def _map_batch(ds_path: Path, cfg: dict, dp: int, put, warnings: list[str]) -> dict:
    """train_batch_size = micro x accum x dp, DeepSpeed's own assertion and wording; returns the stated values."""
    vals = {}
    for key in (TRAIN_BATCH, MICRO_BATCH, GRAD_ACC):
        v = cfg.get(key)
        vals[key] = None if v is None else _num(ds_path, key, v, integer=True)
    try:
        train, micro, accum, notes = resolve_batch(
            vals[TRAIN_BATCH], vals[MICRO_BATCH], vals[GRAD_ACC], dp
        )
    except BatchAssertion as e:
        raise BadInput(ds_path, str(e), field=e.field) from None
    warnings += notes
    put("training.micro_batch_size", micro, MICRO_BATCH)
    put("training.grad_accum_steps", accum, GRAD_ACC)
    return vals


def _map_precision(ds_path: Path, cfg: dict, doc: dict, base, warnings: list[str]) -> None:
    """The manifest trains in float32 or float64; DeepSpeed without fp16/bf16 trains in fp32."""
    for key, what in (
        ("fp16", "fp16"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        ("amp", "Apex AMP"),
    ):
        if key not in cfg:
            continue
        sec = _section(ds_path, key, cfg[key])
        if _enabled(ds_path, key, sec):
            raise BadInput(
                ds_path,
                f"{what} mixed precision is not supported: the manifest trains in float32 or "
                "float64 only (training.dtype); set it to false",
                field=f"{key}.enabled",
            )
        for sub in sec:
            if sub != "enabled":
                warnings.append(f"{key}.{sub}: ignored: {key} is disabled")
    if base.training.dtype != "float32":
        warnings.append(
            f"training.dtype: the base manifest's {base.training.dtype} is replaced by float32 "
            "(DeepSpeed trains in fp32 when fp16/bf16 are off)"
        )
    _set(doc, "training.dtype", "float32")


def _map_zero(ds_path: Path, cfg: dict, put, warnings: list[str]) -> None:
    zero = cfg.get("zero_optimization")
    stage = 0
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
        stage = 1 if zero else 0
        warnings.append(
            f"zero_optimization: legacy boolean form; DeepSpeed reads it as stage {stage}"
        )
    elif zero is not None:
        zero = _section(ds_path, "zero_optimization", zero)
        st = zero.get("stage", 0)
        st = _num(ds_path, "zero_optimization.stage", st, integer=True)
        if not 0 <= st <= 3:
            raise BadInput(
                ds_path, f"ZeRO stage {st} does not exist (0 to 3)", field="zero_optimization.stage"
            )
        stage = st
        for sub, v in zero.items():
            if sub == "stage":
                continue
            if sub in ("offload_optimizer", "offload_param"):
                device = v.get("device") if isinstance(v, dict) else v
                if device in (None, "none", False):
                    warnings.append(f"zero_optimization.{sub}: ignored: offload is off")
                else:
                    warnings.append(
                        f"zero_optimization.{sub}: unsupported: offload to {device!r} is not "
                        "supported; not applied (state stays on the device)"
                    )
            else:
                warnings.append(
                    f"zero_optimization.{sub}: ignored: ZeRO communication/memory tuning; "
                    f"disttrace's ZeRO-{stage} strategy uses its own"
                )
    put("parallelism.zero_stage", stage, "zero_optimization.stage")


def _map_clipping(ds_path: Path, cfg: dict, put, warnings: list[str]) -> None:
    """The global norm, as training.max_grad_norm (0 means off in DeepSpeed)."""
    if "gradient_clipping" in cfg:
        gc = _num(ds_path, "gradient_clipping", cfg["gradient_clipping"])
        if gc == 0:
            warnings.append("gradient_clipping: ignored: 0 means no clipping, as in the manifest")
        elif gc < 0:
            raise BadInput(ds_path, f"{gc} is negative", field="gradient_clipping")
        else:
            put("training.max_grad_norm", float(gc), "gradient_clipping")


def _refuse_elasticity(ds_path: Path, cfg: dict, warnings: list[str]) -> None:
    """Elasticity rewrites the batch: refused when on."""
    if "elasticity" in cfg:
        sec = _section(ds_path, "elasticity", cfg["elasticity"])
        if _enabled(ds_path, "elasticity", sec):
            raise BadInput(
                ds_path,
                "elastic training chooses the batch itself; disable it and state the batch",
                field="elasticity.enabled",
            )
        warnings.append("elasticity: ignored: disabled")


def _name_the_rest(cfg: dict, warnings: list[str]) -> None:
    """Every other key, named: never dropped silently."""
    handled = {
        TRAIN_BATCH,
        MICRO_BATCH,
        GRAD_ACC,
        "fp16",
        "bf16",
        "bfloat16",
        "amp",
        "zero_optimization",
        "optimizer",
        "gradient_clipping",
        "elasticity",
    }
    for key, v in cfg.items():
        if key in handled:
            continue
        if key in _TOP_LEVEL:
            kind, why = _TOP_LEVEL[key]
            if kind == "unsupported" and any(
                type(v) is type(h) and v == h for h in _HARMLESS.get(key, ())
            ):
                kind, why = "ignored", "DeepSpeed's default (off)"
            warnings.append(f"{key}: {kind}: {why}")
        else:
            warnings.append(f"{key}: unknown: not a DeepSpeed key disttrace knows; ignored")


def _map_optimizer(ds_path: Path, raw: Any, put, warnings: list[str]) -> None:
    sec = _section(ds_path, "optimizer", raw)
    typ = sec.get("type")
    for sub in sec:
        if sub not in ("type", "params"):
            warnings.append(f"optimizer.{sub}: ignored")
    if typ is None:
        warnings.append(
            "optimizer: no type (DeepSpeed then uses the client's optimizer); the base manifest's "
            "training.optimizer and its parameters are kept"
        )
        return
    if not isinstance(typ, str):
        raise BadInput(ds_path, f"must be a string (got {typ!r})", field="optimizer.type")
    params = sec.get("params")
    params = {} if params is None else _section(ds_path, "optimizer.params", params)
    if "max_grad_norm" in params:
        # DeepSpeed's engine raises on it (_configure_basic_optimizer); so do we, in its words
        raise BadInput(
            ds_path,
            "'max_grad_norm' is not supported as an optimizer parameter, please switch to using "
            "the deepspeed parameter 'gradient_clipping'",
            field="optimizer.params.max_grad_norm",
        )
    name = typ.lower()
    p = _Params(ds_path, params)
    if name in ("adam", "adamw"):
        _map_adam(ds_path, name, p, put, warnings)
    elif name == "sgd":
        _map_sgd(ds_path, typ, p, put, warnings)
    else:
        raise BadInput(
            ds_path,
            f"'{typ}' has no counterpart in the manifest (training.optimizer is adamw or sgd); "
            "use Adam, AdamW or SGD",
            field="optimizer.type",
        )
    for key in params:
        if key not in p.used:
            warnings.append(f"optimizer.params.{key}: unknown: not applied")


class _Params:
    """optimizer.params, read key by key: numbers checked, and which keys were looked at kept, so every other
    key is named as unknown."""

    def __init__(self, ds_path: Path, raw: dict):
        self.ds_path, self.raw, self.used = ds_path, raw, set()

    def get(self, key: str, default: Any, number: bool = True) -> Any:
        self.used.add(key)
        if key not in self.raw:
            return default
        return (
            _num(self.ds_path, f"optimizer.params.{key}", self.raw[key])
            if number
            else self.raw[key]
        )


def _map_adam(ds_path: Path, name: str, p: _Params, put, warnings: list[str]) -> None:
    """Adam / AdamW onto the manifest's adamw, with DeepSpeed's defaults where the config is silent."""
    torch_adam = p.get("torch_adam", False, number=False)
    adam_w_mode = p.get("adam_w_mode", True, number=False)
    for key, v in (("torch_adam", torch_adam), ("adam_w_mode", adam_w_mode)):
        if not isinstance(v, bool):
            raise BadInput(
                ds_path, f"must be true or false (got {v!r})", field=f"optimizer.params.{key}"
            )
    decoupled = name == "adamw" or adam_w_mode  # DeepSpeed: type AdamW forces AdamW logic
    # DeepSpeed's FusedAdam defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight_decay 0); with
    # torch_adam it builds torch.optim.AdamW, whose weight_decay defaults to 0.01
    default_wd = 0.01 if (torch_adam and decoupled) else 0.0
    lr = p.get("lr", 1e-3)
    wd = p.get("weight_decay", default_wd)
    eps = p.get("eps", _ADAM_EPS)
    p.used.add("betas")
    betas = p.raw.get("betas", (0.9, 0.999))
    if (
        not isinstance(betas, (list, tuple))
        or len(betas) != 2
        or any(isinstance(b, bool) or not isinstance(b, (int, float)) for b in betas)
    ):
        raise BadInput(
            ds_path, f"must be two numbers (got {betas!r})", field="optimizer.params.betas"
        )
    if not decoupled and wd:
        raise BadInput(
            ds_path,
            "Adam with L2 weight decay (adam_w_mode false) is not supported; the manifest's "
            "adamw decouples weight decay",
            field="optimizer.params.adam_w_mode",
        )
    for key, default in (("lr", 1e-3), ("weight_decay", default_wd)):
        if key not in p.raw:
            warnings.append(
                f"optimizer.params.{key}: not given; DeepSpeed's default {default} is used"
            )
    if "betas" not in p.raw:
        warnings.append(
            "optimizer.params.betas: not given; DeepSpeed's default [0.9, 0.999] is used"
        )
    if eps != _ADAM_EPS:
        warnings.append(
            f"optimizer.params.eps: unsupported: {eps} is not applied (the engine uses AdamW's "
            f"{_ADAM_EPS}; the manifest has no eps field)"
        )
    if torch_adam:
        warnings.append(
            "optimizer.params.torch_adam: ignored: the engine always uses torch.optim.AdamW"
        )
    for key, off in (("amsgrad", False), ("bias_correction", True)):
        p.used.add(key)
        if key in p.raw:
            if p.raw[key] == off and isinstance(p.raw[key], bool):
                warnings.append(f"optimizer.params.{key}: ignored: {off} is what the engine does")
            else:
                warnings.append(
                    f"optimizer.params.{key}: unsupported: {p.raw[key]!r} is not applied"
                )
    put("training.optimizer", "adamw", "optimizer.type")
    put("training.lr", lr, "optimizer.params.lr")
    put("training.weight_decay", wd, "optimizer.params.weight_decay")
    put("training.beta1", betas[0], "optimizer.params.betas")
    put("training.beta2", betas[1], "optimizer.params.betas")


def _map_sgd(ds_path: Path, typ: str, p: _Params, put, warnings: list[str]) -> None:
    """torch.optim.SGD (looked up by exact name) onto the manifest's plain sgd."""
    if typ != "SGD":
        # DeepSpeed lower-cases only its own optimizers; others are looked up in torch.optim by exact name
        raise BadInput(
            ds_path,
            f"DeepSpeed looks '{typ}' up in torch.optim by exact name; use 'SGD'",
            field="optimizer.type",
        )
    lr = p.get("lr", 1e-3)
    wd = p.get("weight_decay", 0.0)
    if "lr" not in p.raw:
        warnings.append("optimizer.params.lr: not given; torch.optim.SGD's default 0.001 is used")
    for key, off in (("momentum", 0), ("dampening", 0), ("nesterov", False), ("maximize", False)):
        p.used.add(key)
        if key in p.raw:
            v = p.raw[key]
            if v == off and not (isinstance(off, bool) ^ isinstance(v, bool)):
                warnings.append(f"optimizer.params.{key}: ignored: {v!r} is torch's default")
            else:
                warnings.append(
                    f"optimizer.params.{key}: unsupported: {v!r} is not applied (the manifest's "
                    "sgd is plain SGD)"
                )
    put("training.optimizer", "sgd", "optimizer.type")
    put("training.lr", lr, "optimizer.params.lr")
    put("training.weight_decay", wd, "optimizer.params.weight_decay")


def freeze_from_deepspeed(
    ds_path: Path | str,
    base_manifest: Path | str | None = None,
    world_size: int | None = None,
    overrides: list[str] | None = None,
) -> tuple[Frozen, list[str]]:
    """Build the manifest from a DeepSpeed config, apply `--set` overrides, and freeze it exactly as
    `manifest.freeze` does (validation, data and tokenizer hashes, unsupported features). Writes nothing.

    Errors about a field the DeepSpeed config supplied name the DeepSpeed file and key; the others name the
    base manifest (or `--set`). After the overrides, the frozen manifest must still be what DeepSpeed would
    run with this config: DeepSpeed's batch rules at the frozen parallelism.dp must give the frozen micro
    batch and accumulation, else it is refused in DeepSpeed's words (field train_batch_size)."""
    ds_path = Path(ds_path)
    base_path = Path(base_manifest) if base_manifest else DEFAULT_MANIFEST
    doc, warnings, provenance, stated = _build(ds_path, base_path, world_size)
    overrides = list(overrides or [])
    try:
        frozen = freeze_doc(doc, base_path, overrides)
    except BadInput as e:
        overridden = {o.split("=", 1)[0].strip() for o in overrides}
        if e.where == str(base_path) and e.field in provenance and e.field not in overridden:
            raise BadInput(
                ds_path, f"{e.reason} (as {e.field})", field=provenance[e.field]
            ) from None
        raise
    m = frozen.model()
    dp, micro, accum = m.parallelism.dp, m.training.micro_batch_size, m.training.grad_accum_steps
    try:
        train, ds_micro, ds_accum, _ = resolve_batch(
            stated[TRAIN_BATCH], stated[MICRO_BATCH], stated[GRAD_ACC], dp
        )
    except BatchAssertion as e:
        raise BadInput(ds_path, str(e), field=e.field) from None
    if (ds_micro, ds_accum) != (micro, accum):
        raise BadInput(ds_path, identity_message(train, micro, accum, dp), field=TRAIN_BATCH)
    return frozen.model_copy(update={"source": str(ds_path)}), warnings
