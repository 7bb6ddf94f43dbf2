"""The manifest a DeepSpeed config and a base manifest make, and its freezing with the batch identity
checked again after `--set`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from disttrace.config.deepspeed.batch import (
    GRAD_ACC,
    MICRO_BATCH,
    TRAIN_BATCH,
    BatchAssertion,
    identity_message,
    resolve_batch,
)
from disttrace.config.deepspeed.optimizer import _map_optimizer
from disttrace.config.deepspeed.sections import (
    _map_batch,
    _map_clipping,
    _map_precision,
    _map_world,
    _map_zero,
    _name_the_rest,
    _refuse_elasticity,
)
from disttrace.config.deepspeed.values import _set, read_ds_config
from disttrace.config.freezing import Frozen, freeze_doc, read_toml, validate
from disttrace.config.manifest import DEFAULT_MANIFEST
from disttrace.errors import BadInput


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


def freeze_from_deepspeed(
    ds_path: Path | str,
    base_manifest: Path | str | None = None,
    world_size: int | None = None,
    overrides: list[str] | None = None,
) -> tuple[Frozen, list[str]]:
    """Build the manifest from a DeepSpeed config, apply `--set` overrides, and freeze it exactly as
    `freezing.freeze` does (validation, data and tokenizer hashes, unsupported features). Writes nothing.

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
