"""The Adam step's bound (analysis/updates.py) against torch's own AdamW: no sequence of gradients moves an
element further than it, the worst case (gradients growing by beta2 / beta1 a step, the Cauchy-Schwarz
equality) reaches it, and the Adam paper's figure is exceeded there; the recorder's statistic
(run/record/updates.py) stays inside it under decoupled weight decay and names a planted jump."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from disttrace.analysis.updates import SLACK, adam_step_bound, allowance, step_allowance
from disttrace.compiled import native
from disttrace.run.record import updates
from disttrace.run.record.updates import SUFFIX, Updates


def _steps(grads, betas, lr=1.0, wd=0.0, p0=None, dtype=torch.float64):
    """torch's AdamW on one parameter fed `grads` (rows: steps): each step's largest |update|, decay left out."""
    p = torch.nn.Parameter(
        torch.zeros(grads.shape[1], dtype=dtype) if p0 is None else p0.clone().to(dtype)
    )
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=0.0, weight_decay=wd, foreach=False)
    out = []
    for g in grads:
        before = p.detach().clone()
        p.grad = g.to(dtype).clone()
        opt.step()
        out.append(float((p.detach() - before * (1 - lr * wd)).abs().max()))
    return out


@pytest.mark.parametrize("betas", [(0.9, 0.95), (0.5, 0.9), (0.0, 0.5)])
def test_the_worst_case_reaches_the_bound_and_passes_the_papers(betas):
    b1, b2 = betas
    c = adam_step_bound(b1, b2)
    r = (
        b2 / b1 if b1 else 1e3
    )  # g_{t-k} proportional to (beta1 / beta2)^k: Cauchy-Schwarz's equality
    n = 400 if b1 else 30  # squares of the first gradients stay normal in float64
    grads = torch.tensor([[r ** (t - n)] for t in range(n)], dtype=torch.float64)
    moved = _steps(grads, betas)
    assert max(moved) <= c * (1 + 1e-12)
    assert max(moved) >= c * (1 - 1e-6)  # the supremum, reached: the bound cannot be tightened
    paper = max(1.0, (1 - b1) / math.sqrt(1 - b2))
    if b1:
        assert (
            max(moved) > paper * 1.1
        )  # the paper's "effective step" is a typical case, not a bound


def test_random_gradients_stay_inside():
    g = torch.Generator().manual_seed(0)
    for betas in ((0.9, 0.95), (0.9, 0.999), (0.8, 0.99)):
        c = adam_step_bound(*betas)
        grads = torch.randn(300, 64, generator=g, dtype=torch.float64)
        grads *= torch.exp(3 * torch.randn(300, 1, generator=g, dtype=torch.float64))  # bursts
        grads[::7] *= -1
        assert max(_steps(grads, betas, lr=3e-3)) <= 3e-3 * c * (1 + 1e-12)


def test_no_bound_where_none_is_sound():
    assert adam_step_bound(0.99, 0.95) is None  # beta1^2 >= beta2: the sum grows with t
    sgd = {"data": {}, "training": {"optimizer": "sgd", "lr": 0.1}}
    attached = {"training": {"optimizer": "AdamW", "lr": 1e-3}}  # no `data`: an attached run's lock
    adamw = {
        "data": {},
        "training": {"optimizer": "adamw", "lr": 3e-3, "beta1": 0.9, "beta2": 0.95},
    }
    assert step_allowance(sgd) is None and step_allowance(attached) is None
    assert allowance(adamw, sgd) is None
    assert step_allowance(adamw) == pytest.approx(3e-3 * adam_step_bound(0.9, 0.95) * (1 + SLACK))


def test_the_recorded_statistic_under_weight_decay():
    """float32 parameters far from 0 (|p| ~ 50) under AdamW's decoupled decay: the record leaves the decay
    out and stays inside lr C; |p_after - p_before| alone would not; a planted jump is its size."""
    torch.manual_seed(0)
    lr, wd, betas = 3e-3, 0.5, (0.9, 0.95)
    p = torch.nn.Parameter(50 + torch.randn(1000))
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, weight_decay=wd, foreach=False)
    rec, limit = Updates(), lr * adam_step_bound(*betas) * (1 + SLACK)
    plain = []
    for step in range(20):
        p.grad = torch.randn(1000) * (10.0 if step % 5 == 0 else 1e-3)
        rec.before([(0, "w", p)])
        before = p.detach().clone()
        opt.step()
        plain.append(float((p.detach() - before).abs().max()))
        if step == 12:
            with torch.no_grad():
                p[7] += 0.5  # a parameter moved by far more than any Adam step
        (index, name, top) = rec.after([(0, "w", p)], opt)[0]
        assert name == "w" + SUFFIX and top.dtype == torch.float64 and top.dim() == 0
        if step == 12:
            assert float(top) > 0.49
        else:
            assert float(top) <= limit
    assert max(plain) > limit  # the decay alone (lr wd |p| = 0.075) is more than an Adam step


def test_sharded_and_replaced_parameters_have_no_record():
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p, q], lr=1e-3)
    q._disttrace_shard = {"offset": [0], "logical_shape": [8]}
    rec = Updates()
    rec.before([(0, "p", p), (1, "q", q)])
    p.grad = q.grad = torch.ones(4)
    opt.step()
    other = torch.nn.Parameter(p.detach().clone())
    assert rec.after([(0, "p", other), (1, "q", q)], opt) == []


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


@pytest.mark.parametrize("factor", [1.0, 1 - 3e-3 * 0.1, 1 - 1e-12])
def test_the_compiled_pass_gives_torchs_bits(factor, monkeypatch):
    """The C kernel (disttrace/native/updates.c) and the torch path against torch's own float32 operations, bit
    for bit: the decay's product rounded, then the difference; lengths that are not a vector's multiple; an
    infinity; a NaN (the quiet NaN whichever payload); no difference at all (+0)."""
    kernel = native("_updates")
    if kernel is None:
        pytest.skip("the C extensions were not built")
    g = torch.Generator().manual_seed(1)
    cases = []
    for n in (0, 1, 7, 1000, 65_537):
        old = 50 + torch.randn(n, generator=g)
        cases.append((old, old * factor - 1e-3 * torch.randn(n, generator=g)))
    old = torch.randn(33, generator=g)
    cases.append((old, (old * factor).clone()))  # no difference: +0
    inf = torch.randn(33, generator=g)
    inf[5] = float("inf")
    cases.append((inf, inf.clone()))  # inf - inf: NaN
    cases.append((old, torch.where(torch.arange(33) == 9, float("inf"), old)))
    nan = old.clone()
    nan.view(torch.int32)[3] = 0x7FC00123  # a NaN with a payload
    cases.append((old, nan))
    for before, after in cases:
        expected = (after - before * factor).abs().max().item() if before.numel() else 0.0
        if math.isnan(expected):
            expected = float("nan")
        got_c = kernel.largest_update(before.numpy(), after.numpy(), factor)
        monkeypatch.setenv("DISTTRACE_NATIVE", "0")
        updates._kernel.cache_clear()
        got_torch = float(updates._largest(before.clone(), after, factor))
        monkeypatch.delenv("DISTTRACE_NATIVE")
        updates._kernel.cache_clear()
        assert _bits(got_c) == _bits(expected) == _bits(got_torch), (
            before.numel(),
            got_c,
            got_torch,
        )
