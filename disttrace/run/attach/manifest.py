"""The manifest an attached run writes (config/attached.py states its shape) and its evaluation section."""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import Any

import torch

from disttrace.errors import BadInput
from disttrace.run.attach.engine import Engine, named_parameters
from disttrace.run.attach.replicas import attached_layout, mesh_doc
from disttrace.store.records import ATTACHED_SOURCE

SOURCE = ATTACHED_SOURCE  # the lock's `source` of attached runs (readers ask Run.attached)


def _jsonable(v: Any) -> Any:
    """Hyper-parameters and user config as JSON (tuples as lists, tensors as numbers, the rest as text)."""
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if torch.is_tensor(v) and v.numel() == 1:
        return v.item()
    return str(v)


def build_manifest(
    engine: Engine,
    optimizer,
    views: list,  # run/attach/engine.py's AttachView, one a rank
    name: str,
    edition: str,
    seed: int | None,
    config: dict | None,
    evaluation: dict | None = None,
) -> dict:
    """The experiment as attach sees it: the user's config plus the model's tensors, the optimizer and its
    hyper-parameters, the world, the engine and the default generator's seed. Two attached runs whose
    manifests differ in these are not the same experiment, and diff says which fields differ."""
    inner = engine.inner
    world = len(views)
    groups = [
        {k: _jsonable(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]
    g0 = groups[0] if groups else {}
    training: dict = {"optimizer": type(optimizer).__name__}
    for key in ("lr", "weight_decay"):
        if key in g0:
            training[key] = g0[key]
    if isinstance(g0.get("betas"), list) and len(g0["betas"]) == 2:
        training["beta1"], training["beta2"] = g0["betas"]
    cfg = _jsonable(config or {})
    for key in ("grad_accum_steps", "micro_batch_size", "steps"):  # typed fields the readers know
        if isinstance(cfg.get(key), int) and not isinstance(cfg.get(key), bool):
            # accumulation and micro-batch are topology (the global batch is compared), not the experiment
            training[key] = cfg.pop(key) if key != "steps" else cfg[key]
    from disttrace.run.deepspeed import logical_shape  # ZeRO-3 holds empty placeholders

    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in inner.parameters()})
    training["dtype"] = dtypes[0] if len(dtypes) == 1 else "mixed"
    dp_groups, tp_groups = attached_layout(engine.kind, views)
    from disttrace.config.attached import (
        AttachedManifest,
    )  # the shape, typed: a new key is declared there

    return AttachedManifest.model_validate(
        {
            "experiment": {
                "name": name,
                "edition": edition,
                "seed": int(views[0].seed if seed is None else seed),
                "description": f"recorded by {SOURCE}",
            },
            "parallelism": {
                "dp": len(dp_groups[0]),
                "tp": len(tp_groups[0]),
                "pp": 1,
                "zero_stage": 3 if engine.kind == "FSDP2" else engine.zero_stage,
                "world_size": world,
                "architecture": "allreduce",
                "engine": engine.kind,
                **({"mesh": mesh} if (mesh := mesh_doc(views)) else {}),
            },
            "model": {
                "class": type(inner).__qualname__,
                "parameters": sum(math.prod(logical_shape(p)) for p in inner.parameters()),
                "tensors": {
                    n: {"shape": logical_shape(p), "dtype": str(p.dtype).removeprefix("torch.")}
                    for n, p in named_parameters(inner)
                },
            },
            "optimizer": {
                "type": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
                "param_groups": {str(i): g for i, g in enumerate(groups)},
            },
            "training": training,
            "config": cfg,
            **({"eval": evaluation} if evaluation is not None else {}),
        }
    ).document()


def manifest_id_of(manifest: dict) -> str:
    from disttrace.config.freezing import canonical_json

    return hashlib.sha256(
        canonical_json(manifest)
    ).hexdigest()  # the harness's manifest id, same rule


def evaluation_section(spec: dict) -> tuple[dict, dict]:
    """attach(evaluation=) -> (the manifest's `eval` section, the lock's resolved paths): validated as a
    policy's [eval] is (gate/policy.py), the data's sha256 computed (or checked, if given) now."""
    from pydantic import ValidationError

    from disttrace.gate.policy import USER_EVAL_KEYS, EvalPolicy
    from disttrace.gate.usereval import EvalFailure, data_sha256

    where = "attach(evaluation=)"
    if not isinstance(spec, dict) or not spec.get("command"):
        raise BadInput(where, "needs a command (a list of strings)", field="command")
    unknown = sorted(set(spec) - set(USER_EVAL_KEYS) - {"data", "cwd"})
    if unknown:
        raise BadInput(where, "unknown key", field=unknown[0])
    cwd = Path(spec.get("cwd") or os.getcwd()).resolve()
    if spec.get("data") is None:
        raise BadInput(where, "names no held-out data (the gate checks it by hash)", field="data")
    data = (cwd / spec["data"]).resolve()
    try:
        sha = data_sha256(data)
    except EvalFailure as e:
        raise BadInput(where, str(e), field="data") from None
    if spec.get("data_sha256") not in (None, sha):
        raise BadInput(where, f"{data} has sha256 {sha}, not the one given", field="data_sha256")
    doc = {**spec, "data": str(data), "cwd": str(cwd), "data_sha256": sha}
    doc["command"] = list(doc["command"])
    doc["env"] = list(doc.get("env") or [])
    try:
        EvalPolicy.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadInput(
            where, err["msg"].removeprefix("Value error, "), field=".".join(map(str, err["loc"]))
        ) from None
    section = {k: _jsonable(doc[k]) for k in USER_EVAL_KEYS if k in doc}
    return section, {"eval_data": str(data), "eval_cwd": str(cwd)}
