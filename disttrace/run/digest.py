"""Tensor digests: bit-exact (any flipped bit changes it) and cheap (xxh3-128 runs at memory bandwidth,
docs/design.md, "Facts"), plus float64 sum and L2 norm for tolerance comparisons across topologies.
Checkpoint files, read once, get sha256 instead (checkpoint.py)."""

from __future__ import annotations

import functools
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


# ---------------------------------------------------------------- the random-projection sketch
# Sum and norm are two numbers: a permutation of a tensor's elements keeps both, and so do offsetting errors
# (+e here, -e there) to first order. The sketch adds SKETCH_K dot products <x, v_k> with fixed random
# vectors. v_k is indexed by the element's position in the *logical* tensor, as a product over axes:
# v_k[i_0, .., i_D-1] = prod_d a_{k,d}[i_d], each a_{k,d} a seeded Gaussian vector of the logical axis
# length scaled to RMS 1 (so ||v_k||^2 = numel exactly, as for the all-ones vector of the sum). A shard at
# offsets o_d uses the slices a_{k,d}[o_d : o_d + n_d], so the sketches of a tensor's shards add up to the
# whole tensor's: logical tensors still compare across topologies. The bound of a sketch difference is the
# sum's (analysis/tolerance.py): with |dx_i| <= eps |x_i|, |sum_i dx_i v_i| <= eps ||x|| ||v|| = eps ||x|| sqrt(numel).
SKETCH_K = 4
SKETCH_SEED = 0x5EED_D15C


@functools.lru_cache(maxsize=256)
def axis_vectors(axis: int, length: int) -> np.ndarray:
    """(length, SKETCH_K) float64: the sketch's factors along one logical axis of that length."""
    g = np.random.default_rng([SKETCH_SEED, axis, length]).standard_normal((length, SKETCH_K))
    g *= np.sqrt(length / np.maximum((g * g).sum(axis=0), 1e-300))
    g.setflags(write=False)
    return g


def sketch(a: np.ndarray, offset=None, logical_shape=None) -> list[float]:
    """SKETCH_K projections of the float64 array `a` (a whole tensor, or a shard at `offset` of a tensor of
    `logical_shape`)."""
    shape = a.shape
    lshape = tuple(logical_shape) if logical_shape else shape
    off = tuple(offset) if offset else (0,) * len(shape)
    if len(shape) == 0:
        return [float(a)] * SKETCH_K  # the empty product: every v_k is 1
    if len(lshape) != len(shape) or len(off) != len(shape):
        raise ValueError(f"shard shape {shape} / offset {off} do not match the logical shape {lshape}")
    d = len(shape) - 1
    m = a.reshape(-1, shape[d]) @ axis_vectors(d, lshape[d])[off[d]:off[d] + shape[d]]  # (rest, K)
    for d in range(len(shape) - 2, -1, -1):
        m = (m.reshape(-1, shape[d], SKETCH_K) * axis_vectors(d, lshape[d])[off[d]:off[d] + shape[d]]).sum(axis=1)
    return [float(x) for x in m.reshape(SKETCH_K)]


def digest_tensor(t: torch.Tensor, offset=None, logical_shape=None) -> dict:
    """{'digest','sum','norm','sketch','nonfinite','dtype','shape','numel'} of one (local) tensor; `offset`
    and `logical_shape` place a shard in its logical tensor (for the sketch). On a GPU the digest and the
    float64 statistics are computed on the device; on the CPU, xxh3 over the raw bytes."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: the digest is of the shard this rank holds
        t = t.to_local()
    if t.device.type == "cuda":
        return _digest_on_device(t, offset, logical_shape)
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
        sk = sketch(a.reshape(cpu.shape), offset, logical_shape) if not nonfinite and a.size else None
    return {
        "dtype": str(cpu.dtype).removeprefix("torch."),
        "shape": list(cpu.shape),
        "numel": int(cpu.numel()),
        "digest": h,
        "sum": s if math.isfinite(s) else None,
        "norm": n if math.isfinite(n) else None,
        "sketch": sk,
        "nonfinite": nonfinite,
    }


def digest_of_digests(digests: list[str]) -> str:
    h = xxhash.xxh3_128()
    for d in digests:
        h.update(d.encode())
    return h.hexdigest()


def _sketch_on_device(a: torch.Tensor, offset, logical_shape) -> list[float]:
    """`sketch` with torch ops where the tensor lives (only SKETCH_K numbers cross to the host)."""
    shape = tuple(a.shape)
    if not shape:
        return [float(a)] * SKETCH_K
    lshape = tuple(logical_shape) if logical_shape else shape
    off = tuple(offset) if offset else (0,) * len(shape)

    def vec(d):
        v = axis_vectors(d, lshape[d])[off[d]:off[d] + shape[d]]
        return torch.tensor(v, dtype=torch.float64, device=a.device)  # a copy: the cached array is read-only

    d = len(shape) - 1
    m = a.reshape(-1, shape[d]) @ vec(d)
    for d in range(len(shape) - 2, -1, -1):
        m = (m.reshape(-1, shape[d], SKETCH_K) * vec(d)).sum(dim=1)
    return [float(x) for x in m.reshape(SKETCH_K).cpu()]


def _digest_on_device(t: torch.Tensor, offset=None, logical_shape=None) -> dict:
    a = t.to(torch.float64)
    s, n = float(a.sum()), float(torch.linalg.vector_norm(a))
    nonfinite = 0
    if not (math.isfinite(s) and math.isfinite(n)):
        nonfinite = int((~torch.isfinite(a)).sum())
    sk = _sketch_on_device(a, offset, logical_shape) if not nonfinite and a.numel() else None
    return {
        "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "numel": int(t.numel()),
        "digest": device_digest(t) if t.numel() else "dev:" + "0" * 32,
        "sum": s if math.isfinite(s) else None, "norm": n if math.isfinite(n) else None, "sketch": sk,
        "nonfinite": nonfinite,
    }
