"""Pieces every strategy shares: the optimizer, and the (index, name, tensor) lists the hook points carry."""

from __future__ import annotations

import torch


def build_optimizer(manifest: dict, params):
    t = manifest["training"]
    if t["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=t["lr"], weight_decay=t["weight_decay"], foreach=False)
    return torch.optim.AdamW(params, lr=t["lr"], betas=(t["beta1"], t["beta2"]), weight_decay=t["weight_decay"],
                             foreach=False)


def optimizer_state_list(optimizer, named: list[tuple[int, str, torch.Tensor]]):
    """Optimizer state as (index, 'param:key', tensor): index = param index * 4 + key slot, stable order."""
    out = []
    for index, name, p in named:
        st = optimizer.state.get(p, {})
        for slot, key in enumerate(sorted(k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1)):
            out.append((index * 4 + slot, f"{name}:{key}", st[key]))
    return out
