"""Pieces every strategy shares: the optimizer, and the (index, name, tensor) lists the hook points carry."""

from __future__ import annotations

import torch


def optimizer_class_and_kwargs(manifest: dict):
    t = manifest["training"]
    if t["optimizer"] == "sgd":
        return torch.optim.SGD, {"lr": t["lr"], "weight_decay": t["weight_decay"], "foreach": False}
    return torch.optim.AdamW, {"lr": t["lr"], "betas": (t["beta1"], t["beta2"]), "weight_decay": t["weight_decay"],
                               "foreach": False}


def build_optimizer(manifest: dict, params):
    cls, kwargs = optimizer_class_and_kwargs(manifest)
    return cls(params, **kwargs)


def optimizer_state_list(optimizer, named: list[tuple[int, str, torch.Tensor]]):
    """Optimizer state this rank holds, as (index, 'param:key', tensor): index = param index * 4 + key slot.
    Under ZeRO-1 only the owner of a parameter's partition holds its state."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    out = []
    for index, name, p in named:
        st = local.state.get(p, {})
        for slot, key in enumerate(sorted(k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1)):
            out.append((index * 4 + slot, f"{name}:{key}", st[key]))
    return out


def local_optimizer_state_tensors(optimizer):
    local = getattr(optimizer, "optim", optimizer)
    for st in local.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                yield v


def optimizer_bytes(optimizer):
    """An optimizer's state as one opaque blob, for state that is private to a rank (a ZeRO-1 partition,
    a pipeline stage): DCP stores it under that rank's own key and hands it back to the same rank."""
    import io

    buf = io.BytesIO()
    torch.save(optimizer.state_dict(), buf)
    buf.seek(0)
    return buf


def load_optimizer_bytes(optimizer, buf) -> None:
    buf.seek(0)
    optimizer.load_state_dict(torch.load(buf, weights_only=False))
