"""Tensor digests: bit-exact (any flipped bit changes it) and cheap (xxh3-128 runs at memory bandwidth,
see PYTORCH-NOTES), plus float64 sum and L2 norm for tolerance comparisons across topologies.
Checkpoint files, read once, get sha256 instead (checkpoint.py)."""

from __future__ import annotations

import math

import numpy as np
import torch
import xxhash


def raw_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def digest_tensor(t: torch.Tensor) -> dict:
    """{'digest','sum','norm','nonfinite','dtype','shape','numel'} of one (local) tensor."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
        t = t.to_local()
    cpu = t.cpu().contiguous() if t.device.type != "cpu" else t.contiguous()
    h = xxhash.xxh3_128_hexdigest(raw_bytes(cpu))
    if cpu.dtype in (torch.float32, torch.float64, torch.float16):
        a = cpu.numpy().astype(np.float64, copy=False).ravel()
    elif cpu.is_floating_point():  # bfloat16 and friends: numpy has no such dtype
        a = cpu.to(torch.float64).numpy().ravel()
    else:
        a = cpu.to(torch.float64).numpy().ravel()
    s = float(a.sum())
    n = float(math.sqrt(float(np.dot(a, a))))
    nonfinite = 0
    if not (math.isfinite(s) and math.isfinite(n)):  # counting is slow: only when the sum says so
        nonfinite = int((~np.isfinite(a)).sum())
    return {
        "dtype": str(cpu.dtype).removeprefix("torch."),
        "shape": list(cpu.shape),
        "numel": int(cpu.numel()),
        "digest": h,
        "sum": s if math.isfinite(s) else None,
        "norm": n if math.isfinite(n) else None,
        "nonfinite": nonfinite,
    }


def digest_of_digests(digests: list[str]) -> str:
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()
