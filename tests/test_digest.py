"""Digests change when any single bit changes; the device digest (used on GPUs) is tested here on the CPU,
where it runs the same torch code."""

from __future__ import annotations

import torch

from disttrace.run.digest import device_digest, digest_tensor
from disttrace.run.faults import flip_bit


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
