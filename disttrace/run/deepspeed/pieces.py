"""Where DeepSpeed keeps each rank's piece of a tensor (by ZeRO stage), and a piece of a flattened
tensor as the few boxes it is made of, each marked with its offset in the logical tensor."""

from __future__ import annotations

import math

import torch

from disttrace.run.attach import initialized_dist

SHARD_ATTR = (
    "_disttrace_shard"  # recorder.shard_info reads a piece's place in its logical tensor here
)


BOXES = (
    16  # index stride per piece of one tensor (a range of an n-d tensor is at most 2n - 1 boxes)
)


def logical_shape(p) -> list[int]:
    """A parameter's shape as the model defines it (ZeRO-3 leaves an empty placeholder in the module)."""
    return list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape)


def flat_boxes(lo: int, hi: int, shape: list[int]) -> list[tuple[list[int], list[int], int]]:
    """The elements [lo, hi) of a C-contiguous tensor of `shape`, flattened, as boxes (offset, box shape,
    flat position of the box's first element), in order: each box is contiguous in the flattened tensor."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [([lo], [hi - lo], lo)] if shape else [([], [], 0)]
    inner = math.prod(shape[1:])

    def row(r: int, a: int, b: int):
        return [([r, *o], [1, *s], r * inner + f) for o, s, f in flat_boxes(a, b, shape[1:])]

    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi % inner):
        return row(first, lo - first * inner, hi - first * inner)
    out, a, b = [], first, last + 1
    if lo % inner:
        out += row(first, lo % inner, inner)
        a = first + 1
    if hi % inner:
        b = last
    if b > a:
        out.append(([a] + [0] * (len(shape) - 1), [b - a, *shape[1:]], a * inner))
    if hi % inner:
        out += row(last, 0, hi % inner)
    return out


def pieces(index: int, n: int, name: str, frag, start: int, shape: list[int]) -> list[tuple]:
    """(record index, name, box tensor) for the flat fragment `frag` of a tensor of logical `shape`, which
    holds its flattened elements [start, start + frag.numel()): each box a view, marked with its offset."""
    numel = math.prod(shape)
    frag = frag.detach().reshape(-1)
    count = max(0, min(frag.numel(), numel - start))  # ZeRO-3 pads the last rank's partition
    if count == 0:
        return []
    if start == 0 and count == numel:  # the whole tensor
        return [(index, name, frag[:numel].view(shape))]
    out = []
    for b, (offset, box, flat) in enumerate(flat_boxes(start, start + count, shape)):
        if b >= BOXES:
            raise RuntimeError(f"{name}: more than {BOXES} boxes for one range")
        t = frag[flat - start : flat - start + math.prod(box)].view(box)
        setattr(t, SHARD_ATTR, {"shard": {"offset": offset, "logical_shape": list(shape)}})
        out.append((b * n + index, name, t))
    return out


def _copies(entries: list[tuple]) -> list[tuple]:
    """(index, name, a copy of the piece, keeping its place in the logical tensor)."""
    out = []
    for index, name, t in entries:
        c = t.detach().clone()
        if hasattr(t, SHARD_ATTR):
            setattr(c, SHARD_ATTR, getattr(t, SHARD_ATTR))
        out.append((index, name, c))
    return out


class _Partitions:
    """This rank's pieces of each parameter's gradient, fp32 master and optimizer state, by ZeRO stage."""

    def __init__(self, engine, named):
        self.engine, self.named, self.stage = engine, named, engine.zero_optimization_stage()
        self.zo = engine.optimizer
        self.base = getattr(self.zo, "optimizer", self.zo) if self.stage else self.zo

    def _fragment(self, p, what: str):
        """(flat fragment, its start in the flattened parameter) or None; what: grad | param | a state key."""
        if self.stage == 0:
            if what == "grad":
                return (p.grad, 0) if p.grad is not None else None
            if what == "param":
                return p, 0
            st = self.base.state.get(p, {}).get(what)
            return (st, 0) if st is not None else None
        if self.stage in (1, 2):
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:
                return None
            start = hp.lp_fragment_address.start
            if what == "grad":
                try:
                    return hp.get_lp_grad_fragment(p._index_in_param_group), start
                except (ValueError, KeyError, IndexError):
                    return None
            if what == "param":
                return hp.hp_fragment, start
            flat = self.zo.single_partition_of_fp32_groups[hp.param_group_index]
            st = self.base.state.get(flat, {}).get(what)
            if st is None:
                return None
            a = hp.hp_fragment_address
            return st.narrow(0, a.start, a.numel), start
        # stage 3: the partition of each parameter (padded on the last rank), at partition rank * size
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_grad,
            safe_get_local_optimizer_state,
        )

        dist = initialized_dist()
        part = dist.get_rank(group=p.ds_process_group) if dist else 0
        start = part * p.ds_tensor.ds_numel
        if what == "grad":
            t = safe_get_local_grad(p)
        elif what == "param":
            t = safe_get_local_fp32_param(p)
        else:
            try:
                t = safe_get_local_optimizer_state(p, what)
            except KeyError:
                return None
        return (t, start) if t is not None else None

    def state_keys(self) -> list[str]:
        """The optimizer's per-element state (Adam's exp_avg, exp_avg_sq; no step counter)."""
        keys = set()
        for st in self.base.state.values():
            keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1}
        return sorted(keys)

    def collect(self, what: str, base_index: int = 0, named=None) -> list[tuple]:
        n, out = len(self.named), []
        for i, name, p in self.named if named is None else named:
            got = self._fragment(p, what)
            if got is not None and got[0] is not None:
                out += pieces(base_index + i, n, name, got[0], got[1], logical_shape(p))
        return out
