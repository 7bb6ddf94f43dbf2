"""Each parameter's update at the optimizer step, as one number: the largest element of
``|p_after - (1 - lr wd) p_before|`` where the optimizer decays decoupled (AdamW: the decay's product
rounded as torch rounds it, so what is left is the Adam step ``lr r`` and the final subtraction's
rounding), otherwise of ``|p_after - p_before|``. Its cost is a copy of each parameter before the step
and one pass over the copy and the parameter after it (a C kernel for float32 host tensors, else torch's
operations in the copy's memory). The recorder
writes it as the record ``NAME:update`` (phase ``optimizer``, a float64 scalar) beside the parameter, so
diff can hold an Adam step to its bound (analysis/updates.py, docs/tolerance.md) where the parameter
itself has none.

The value before the step is a copy taken at ``before_optimizer`` (after any fault there: what the optimizer
stepped from); the one after is what the ``optimizer`` point hands the recorder (after any fault there:
``bitflip-param`` shows here). A parameter sharded over ranks (a DTensor that is not replicated, a piece an
integration placed) has no update record: the largest element of the logical tensor is the largest of its
shards', which diff does not combine (its shards' sums and norms add), so such a parameter keeps the old
behaviour. Nor has a tensor the ``optimizer`` point hands over that is not the one copied before the step
(the parameter server's workers receive copies of the server's parameters)."""

from __future__ import annotations

import functools

import torch

from disttrace.compiled import native
from disttrace.run.job.hooks import TensorRef

SUFFIX = ":update"
SLOT = 3  # the record's index: after its parameter's optimizer state (at most 3 tensors: amsgrad's)


def _whole(t) -> bool:
    """A tensor this rank holds all of (a replicated DTensor counts)."""
    if getattr(t, "_disttrace_shard", None):
        return False
    placements = getattr(t, "placements", None)
    return placements is None or all(p.is_replicate() for p in placements)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class Updates:
    """Copies before the step, the update records after it."""

    def __init__(self):
        self._before: dict[int, tuple[object, torch.Tensor]] = {}
        # each parameter's copy is kept from step to step and written over: a fresh one each step costs
        # its pages' first touch too (a clone of 12 MiB took 1.8x the time of a copy into a kept buffer)
        self._copies: dict[int, torch.Tensor] = {}

    def before(self, params: list) -> None:
        self._before = {}
        with torch.no_grad():
            for index, _, p in params:
                if torch.is_tensor(p) and p.is_floating_point() and _whole(p):
                    src = _local(p).detach()
                    buf = self._copies.get(index)
                    if (
                        buf is None
                        or buf.shape != src.shape
                        or buf.dtype != src.dtype
                        or buf.device != src.device
                    ):
                        buf = self._copies[index] = torch.empty_like(
                            src, memory_format=torch.contiguous_format
                        )
                    self._before[index] = (p, buf.copy_(src))

    def after(self, params: list, optimizer) -> list[TensorRef]:
        """(index, "NAME:update", the largest |update| as a float64 scalar) for each parameter copied
        before the step; `index` is its slot among the optimizer state records (base added by the caller)."""
        before, self._before = self._before, {}
        if not before:
            return []
        decay = _decoupled_decay(optimizer)
        out = []
        with torch.no_grad():
            for index, name, p in params:
                got = before.get(index)
                if got is None or got[0] is not p:
                    continue
                old, new = got[1], _local(p).detach()
                if new.shape != old.shape or new.dtype != old.dtype:
                    continue
                # AdamW: p <- p (1 - lr wd), rounded as torch rounds it, then minus lr r
                top = _largest(old, new, 1.0 - decay.get(id(p), 0.0))
                out.append(TensorRef(index * 4 + SLOT, name + SUFFIX, top))
        return out


def _largest(old: torch.Tensor, new: torch.Tensor, factor: float) -> torch.Tensor:
    """The largest element of |new - old * factor| (float32 arithmetic for float32 tensors: the product
    rounded, then the difference) as a float64 scalar on the tensors' device; `old` may be written over.
    One compiled pass that writes nothing (disttrace/native/updates.c) for float32 host tensors where it was
    built; otherwise torch in the copy's own memory. Both give the same bits: a NaN is the quiet NaN
    0x7ff8000000000000 whatever payload it came from, no difference at all is +0."""
    kernel = _kernel() if old.device.type == "cpu" and old.dtype == torch.float32 else None
    if kernel is not None:
        value = kernel.largest_update(old.reshape(-1).numpy(), new.reshape(-1).numpy(), factor)
        return torch.tensor(value, dtype=torch.float64)
    if factor != 1.0:
        old.mul_(factor)
    # the largest |element| from one min-max pass (an infinity-norm took 10x as long on the CPU)
    d = old.sub_(new)
    if not d.numel():
        return d.new_zeros((), dtype=torch.float64)
    lo, hi = torch.aminmax(d)
    top = torch.maximum(hi, -lo).abs().to(torch.float64)  # abs: +0 where every difference is 0
    return torch.where(top.isnan(), _NAN, top)


_NAN = float(
    "nan"
)  # the quiet NaN 0x7ff8000000000000 (Python's, whatever the platform's operations give)


@functools.cache
def _kernel():
    return native("_updates")


def _decoupled_decay(optimizer) -> dict[int, float]:
    """id(parameter) -> lr * weight_decay of its group, where the group decays decoupled (torch's AdamW, and
    Adam with ``decoupled_weight_decay``); Adam's and SGD's own weight decay goes through the gradient."""
    if optimizer is None:
        return {}
    # ZeroRedundancyOptimizer: its groups hold every parameter, the optimizer it wraps (`optim`) its shard's
    local = getattr(optimizer, "optim", optimizer)
    decoupled_class = isinstance(local, torch.optim.AdamW)
    out = {}
    for g in getattr(optimizer, "param_groups", ()):
        if not (g.get("decoupled_weight_decay") or decoupled_class):
            continue
        lr, wd = g.get("lr", 0.0), g.get("weight_decay", 0.0)
        lr = float(lr) if torch.is_tensor(lr) else lr
        if isinstance(lr, (int, float)) and isinstance(wd, (int, float)) and lr * wd:
            for p in g.get("params", ()):
                out[id(p)] = float(lr * wd)
    return out
