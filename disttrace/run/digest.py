"""Tensor digests: bit-exact (any flipped bit changes it) and cheap (xxh3-128 runs at memory bandwidth,
docs/design.md, "Facts"), plus float64 sum and L2 norm for tolerance comparisons across topologies.
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


_M1, _M2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)  # as signed int64


def device_digest(t: torch.Tensor) -> str:
    """A 128-bit checksum computed where the tensor lives (no host copy of the tensor: on a GPU only two
    integers cross). The raw bits, read as integers v_i, are summed with odd position weights w_i
    (int64 arithmetic wraps mod 2^64): flipping bit k of element i changes the sum by 2^k * w_i, never 0
    mod 2^64 for odd w_i, so any single flipped bit changes it. Two independent weightings make 128 bits.
    Not a cryptographic hash: it guards against faults, not adversaries."""
    flat = t.detach().contiguous().reshape(-1)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    v = flat.view(ints).to(torch.int64)
    pos = torch.arange(v.numel(), dtype=torch.int64, device=v.device)
    h1 = (v * (pos * _M1 | 1)).sum()
    h2 = ((v ^ (v >> 7)) * (pos * _M2 | 1)).sum()
    return f"dev:{int(h1) & (2**64 - 1):016x}{int(h2) & (2**64 - 1):016x}"


def digest_tensor(t: torch.Tensor) -> dict:
    """{'digest','sum','norm','nonfinite','dtype','shape','numel'} of one (local) tensor. On a GPU the
    digest and the float64 statistics are computed on the device; on the CPU, xxh3 over the raw bytes."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
        t = t.to_local()
    if t.device.type == "cuda":
        return _digest_on_device(t)
    cpu = t.cpu().contiguous() if t.device.type != "cpu" else t.contiguous()
    h = xxhash.xxh3_128_hexdigest(raw_bytes(cpu))
    with np.errstate(all="ignore"):  # a fault may plant inf/nan: counted below, not warned about
        if cpu.dtype in (torch.float32, torch.float64, torch.float16):
            a = cpu.numpy().astype(np.float64, copy=False).ravel()
        else:  # bfloat16 (numpy has no such dtype) and integers
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


def _digest_on_device(t: torch.Tensor) -> dict:
    a = t.to(torch.float64)
    s, n = float(a.sum()), float(torch.linalg.vector_norm(a))
    nonfinite = 0
    if not (math.isfinite(s) and math.isfinite(n)):
        nonfinite = int((~torch.isfinite(a)).sum())
    return {
        "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "numel": int(t.numel()),
        "digest": device_digest(t) if t.numel() else "dev:" + "0" * 32,
        "sum": s if math.isfinite(s) else None, "norm": n if math.isfinite(n) else None, "nonfinite": nonfinite,
    }
