"""DeepSpeed's optimizer section onto the manifest's adamw or sgd, with DeepSpeed's defaults where the
config is silent, and every parameter it cannot apply named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disttrace.config.deepspeed.values import _num, _section
from disttrace.errors import BadInput

_ADAM_EPS = 1e-8  # torch.optim.AdamW's eps, which the engine uses (the manifest has no eps field)


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
    _adam_warnings(p, eps, torch_adam, default_wd, warnings)
    put("training.optimizer", "adamw", "optimizer.type")
    put("training.lr", lr, "optimizer.params.lr")
    put("training.weight_decay", wd, "optimizer.params.weight_decay")
    put("training.beta1", betas[0], "optimizer.params.betas")
    put("training.beta2", betas[1], "optimizer.params.betas")


def _adam_warnings(
    p: _Params, eps: float, torch_adam: bool, default_wd: float, warnings: list[str]
):
    """What Adam's mapping takes by default, and what it cannot apply, named."""
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
