"""The gradient reduce: a rank keeps its local gradient (`skip-allreduce`, `unsynced-param`), divides
twice (`grad-scale`), or sends its contribution rounded to bfloat16 (`bf16-reduce`)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrace.run.faults.base import Capability, Fault, at, register, state_digest
from disttrace.run.faults.targets import _TensorFault
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


@register
class SkipAllreduce(Fault):
    name, point, expect = "skip-allreduce", Point.REDUCE, "reduce"
    recurrence = "persistent"
    description = (
        "the rank keeps its local gradient instead of the reduced one (the collective still runs)"
    )
    needs_dp2 = True
    requires = frozenset({Capability.COLLECTIVE_HOOK})

    def keeps(self, index: int, name: str) -> bool:
        """Which tensors keep their local gradient: all of them."""
        return True

    def install(self, bus):
        self.local: dict = {}
        super().install(bus)

    @at(Point.BACKWARD, order=95)  # after any other handler: what was really sent
    def keep_local(self, bus, p: hooks.Backward):
        if p.before_collective:
            for index, name, g, *_ in p.grads:
                if self.keeps(index, name):
                    self.local[index] = g.detach().clone()

    @at(Point.REDUCE)
    def restore(self, bus, p: hooks.Reduce):
        kept = [(name, g) for index, name, g, *_ in p.grads if index in self.local]
        with self.changing(
            bus,
            [g for _, g in kept],
            phase="reduce",
            tensors=len(self.local),
            names=[n for n, _ in kept][:8],
        ):
            for index, _name, g, *_ in p.grads:
                if index in self.local:
                    g.copy_(self.local[index])


@register
class GradScale(Fault):
    name, point, expect = "grad-scale", Point.REDUCE, "reduce"
    recurrence = "persistent"
    description = "divides the reduced gradient by the data-parallel size a second time"
    needs_dp2 = True

    @at(Point.REDUCE)
    def divide(self, bus, p: hooks.Reduce):
        world = self.manifest.parallelism.dp
        grads = [g for _, _, g, *_ in p.grads]
        with self.changing(bus, grads, phase="reduce", divisor=world):
            for g in grads:
                g.div_(world)


@register
class UnsyncedParam(_TensorFault, SkipAllreduce):
    name, point, expect = "unsynced-param", Point.REDUCE, "reduce"
    recurrence = "persistent"
    description = (
        "one parameter's gradient is never reduced on the rank (as when its copy is replaced after "
        "wrapping): it keeps the local gradient, every other tensor is reduced"
    )

    @dataclass(frozen=True)
    class Args:
        tensor: str = "layers.0.attention_norm.weight"

    def keeps(self, index: int, name: str) -> bool:
        return self.args.tensor in (name, str(index))  # a name, or an index as text (as `pick`)


@register
class Bf16Reduce(Fault):
    name, point, expect = "bf16-reduce", Point.BACKWARD, "backward"
    recurrence = "persistent"
    description = (
        "rounds the rank's gradient contribution to bfloat16 before the all-reduce (what an all-reduce "
        "in bfloat16 does to each input where float32 is configured)"
    )
    requires = frozenset({Capability.BACKWARD})

    def install(self, bus):
        self.before: list[str] = []
        self.after: list[str] = []
        super().install(bus)

    # every bucket of the last micro-batch (DDP hands them one at a time); logged once, at the end
    @at(Point.BACKWARD, anytime=True)
    def to_bf16(self, bus, p: hooks.Backward):
        import torch

        accum = self.manifest.training.grad_accum_steps
        if bus.step != self.step or bus.rank != self.rank or bus.micro_batch != accum - 1:
            return
        for _, _, g in p.grads:
            if g is None:
                continue
            t = g.to_local() if hasattr(g, "to_local") else g
            self.before.append(state_digest(t))
            t.copy_(t.to(torch.bfloat16).to(t.dtype))
            self.after.append(state_digest(t))

    @at(Point.REDUCE)
    def log(self, bus, p: hooks.Reduce):
        self.fire(
            bus,
            proof=(",".join(self.before), ",".join(self.after)),
            phase="backward",
            tensors=len(self.before),
        )
