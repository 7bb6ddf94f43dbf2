"""Digests change when any single bit changes; the device digest (used on GPUs) is tested here on the CPU,
where it runs the same torch code."""

from __future__ import annotations

import torch

from disttrace.run.faults import flip_bit
from disttrace.run.record.digest import device_digest, digest_tensor


def test_every_single_bit_flip_changes_both_digests():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        t = torch.randn(37, generator=g).to(dtype)
        base_host, base_dev = digest_tensor(t)["digest"], device_digest(t)
        bits = t.element_size() * 8
        for element in (0, 17, 36):
            for bit in range(bits):
                u = t.clone()
                flip_bit(u, element, bit)
                assert digest_tensor(u)["digest"] != base_host, (dtype, element, bit)
                assert device_digest(u) != base_dev, (dtype, element, bit)


def test_digests_are_stable_and_see_order():
    t = torch.arange(10, dtype=torch.float32)
    assert device_digest(t) == device_digest(t.clone())
    assert device_digest(t) != device_digest(t.flip(0))  # same multiset of values, other positions
    assert digest_tensor(t)["sum"] == 45.0 and digest_tensor(t)["nonfinite"] == 0
    bad = torch.tensor([1.0, float("nan"), float("inf")])
    d = digest_tensor(bad)
    assert d["sum"] is None and d["nonfinite"] == 2


def test_digest_many_agrees_with_digest_tensor_one_by_one():
    """The batched path (small float32 CPU tensors together) gives every tensor the same digest, dtype, shape
    and non-finite count as digest_tensor, sums, norms and sketches within the derived rounding; shards
    placed at offsets, large, scalar, float64 and non-finite tensors included, and more tensors than one
    batch holds."""
    import math

    from disttrace.analysis import tolerance
    from disttrace.run.record import digest as D
    from disttrace.run.record import digestmany as M

    g = torch.Generator().manual_seed(7)
    items = [
        (torch.randn(64, generator=g), None, None),
        (torch.randn(64, 64, generator=g), None, None),
        (torch.randn(3, 5, 7, generator=g), None, None),
        (torch.tensor(2.5), None, None),
        (torch.randn(512, 64, generator=g), None, None),
        (torch.randn(40, 40, generator=g).double(), None, None),
        (torch.randn(16, 64, generator=g), [16, 0], [64, 64]),
        (torch.randn(32, 8, generator=g), [0, 8], [32, 16]),
    ]
    bad = torch.randn(30, 30, generator=g)
    bad[2, 3] = float("nan")
    items.append((bad, None, None))
    items += [
        (torch.randn(128, 128, generator=g), None, None) for _ in range(20)
    ]  # 20 x 16,384 > one batch
    many = M.digest_many(items)
    assert (
        sum(1 for t, _, _ in items if M._batchable(t)) > M._GROUP // M.SMALL
    )  # several batches were needed
    for (t, off, lshape), m in zip(items, many):
        one = D.digest_tensor(t, off, lshape)
        for k in ("digest", "dtype", "shape", "numel", "nonfinite"):
            assert m[k] == one[k], (tuple(t.shape), k)
        if one["sum"] is None:
            assert m["sum"] is None and m["sketch"] is None
            continue
        scale = one["norm"] * math.sqrt(one["numel"])
        # the batch reduces in float64, digest_tensor a tensor of several rows in float32: within the latter's
        # derived rounding (tolerance.sum_rounding, norm_rounding)
        # (float64 both, to float64 rounding, where the tensor is small: rounding 0)
        rho_s = max(tolerance.sum_rounding(one["dtype"], one["shape"]), 1e-12)
        rho_n = max(tolerance.norm_rounding(one["dtype"], one["shape"]), 1e-12)
        assert abs(m["sum"] - one["sum"]) <= rho_s * scale
        assert abs(m["norm"] - one["norm"]) <= rho_n * one["norm"]
        bound = tolerance.sketch_rounding(one["dtype"], lshape or one["shape"]) * scale
        assert all(abs(x - y) <= bound for x, y in zip(m["sketch"], one["sketch"])), tuple(t.shape)
