"""The sections of a DeepSpeed config mapped onto the manifest, refused, or named: world and batch,
precision, ZeRO, clipping, elasticity, and every other key."""

from __future__ import annotations

from pathlib import Path

from disttrace.config.deepspeed.batch import (
    GRAD_ACC,
    MICRO_BATCH,
    TRAIN_BATCH,
    BatchAssertion,
    resolve_batch,
)
from disttrace.config.deepspeed.values import _HARMLESS, _TOP_LEVEL, _enabled, _num, _section, _set
from disttrace.errors import BadInput


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
