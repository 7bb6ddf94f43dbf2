"""Faults of the layouts that move tokens: expert parallel's dispatch (`ep-misroute`: a token sent to the
wrong rank; `ep-drop-expert`: an expert's output lost on the way back) and context parallel's slice
(`cp-label-boundary`: the label at a slice's boundary shifted, the slice's labels rolled from its own
inputs). Each acts on one micro-batch of one layer, once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disttrace.errors import BadInput
from disttrace.run.faults.base import Capability, Fault, at, register, state_digest
from disttrace.run.faults.batches import _check_mb
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


def _check_layer(args, manifest) -> None:
    n = manifest.model.n_layers
    if not 0 <= args.layer < n:
        raise BadInput("--param layer", f"layer {args.layer} does not exist: model.n_layers = {n}")


class _AtDispatch(Fault):
    point, expect = Point.DISPATCH, "forward"
    requires = frozenset({Capability.EP})
    stage = "dispatch"

    @dataclass(frozen=True)
    class Args:
        micro_batch: int = 0
        layer: int = 0

    @classmethod
    def _check(cls, step, args, manifest):
        _check_mb(args, manifest)
        _check_layer(args, manifest)

    @at(Point.DISPATCH)
    def act(self, bus, p: hooks.Dispatch):
        if (
            bus.micro_batch != self.args.micro_batch
            or p.layer != f"layers.{self.args.layer}.moe"
            or p.stage != self.stage
        ):
            return
        before = state_digest(p.tokens.detach())
        detail = self.change(p)
        if detail is not None:
            self.fire(bus, proof=(before, state_digest(p.tokens.detach())), **detail)

    def change(self, p: hooks.Dispatch) -> dict | None:
        raise NotImplementedError


@register
class EpMisroute(_AtDispatch):
    name = "ep-misroute"
    recurrence = "persistent"  # a routing bug, not an event
    description = (
        "expert parallel: two tokens bound for different ranks trade places in the dispatch (each "
        "reaches the wrong rank's expert, its output returns to the other's place)"
    )

    def change(self, p):
        ends = torch.tensor(p.splits).cumsum(0).tolist()
        starts = [e - n for e, n in zip(ends, p.splits)]
        full = [s for s, n in zip(starts, p.splits) if n]
        if (
            len(full) < 2
        ):  # every token of this micro-batch goes to one rank: nothing can be misrouted
            return None
        a, b = full[0], full[1]
        order = torch.arange(p.tokens.shape[0], device=p.tokens.device)
        order[a], order[b] = b, a
        p.tokens = p.tokens.index_select(0, order)
        return {"phase": "forward", "swapped_rows": [a, b]}


@register
class EpDropExpert(_AtDispatch):
    name = "ep-drop-expert"
    recurrence = "persistent"
    description = (
        "expert parallel: the rank's first local expert's outputs are lost on the way back (zeros "
        "combined in their place)"
    )
    stage = "combine"

    def change(self, p):
        n = p.counts[0] if p.counts else 0
        if not n:
            return None
        keep = torch.ones(p.tokens.shape[0], 1, dtype=p.tokens.dtype, device=p.tokens.device)
        keep[:n] = 0
        p.tokens = p.tokens * keep
        return {"phase": "forward", "dropped_rows": n}


@register
class CpLabelBoundary(Fault):
    name, point, expect = "cp-label-boundary", Point.CONTEXT, "loss"
    recurrence = "persistent"
    description = (
        "context parallel: the label at the end of the rank's slice is shifted by one, taken from the "
        "slice's own first input (labels rolled within the slice, not the sequence)"
    )
    requires = frozenset({Capability.CP})

    @dataclass(frozen=True)
    class Args:
        micro_batch: int = 0

    @classmethod
    def _check(cls, step, args, manifest):
        _check_mb(args, manifest)

    @at(Point.CONTEXT)
    def roll(self, bus, p: hooks.Context):
        if bus.micro_batch != self.args.micro_batch:
            return
        before = state_digest(p.targets)
        targets = p.targets.clone()
        targets[:, p.end - 1] = p.inputs[:, p.start]
        p.targets = targets
        self.fire(bus, proof=(before, state_digest(p.targets)), phase="loss", position=p.end - 1)
