"""What a micro-batch contributes: another rank's shard (`data-swap`), a loss dropped or scaled
(`drop-microbatch`, `loss-scale`), a gradient added after the all-reduce (`late-microbatch`)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrace.errors import BadInput
from disttrace.run.faults.base import AnyManifest, Capability, Fault, at, register, state_digest
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


def _check_mb(args, manifest: AnyManifest):
    accum = manifest.training.grad_accum_steps
    # a zero-code run knows no count before it steps: a micro-batch the step lacks never fires (diff shows it)
    if accum is None:
        return
    if not 0 <= args.micro_batch < accum:
        raise BadInput(
            "--param micro_batch",
            f"micro-batch {args.micro_batch} does not exist: training.grad_accum_steps = {accum}",
        )


@register
class DataSwap(Fault):
    name, point, expect = "data-swap", Point.DATA, "data"
    recurrence = "persistent"
    description = "the rank reads another data-parallel rank's shard for that step"
    needs_dp2 = True

    @dataclass(frozen=True)
    class Args:
        micro_batch: int = 0

    @classmethod
    def _check(cls, step, args, manifest):
        _check_mb(args, manifest)

    @at(Point.DATA)
    def swap(self, bus, p: hooks.Data):
        if bus.micro_batch == self.args.micro_batch:
            other = (self.ctx.dp_rank + 1) % self.manifest.parallelism.dp
            before = state_digest(p.batch.inputs, p.batch.targets)
            p.batch = p.fetch(other)
            self.fire(
                bus,
                proof=(before, state_digest(p.batch.inputs, p.batch.targets)),
                phase="data",
                read_shard_of_dp_rank=other,
            )


@register
class DropMicrobatch(Fault):
    name, point, expect = "drop-microbatch", Point.LOSS, "loss"
    recurrence = "persistent"
    description = (
        "skips one micro-batch of the accumulation (its loss enters backward multiplied by zero)"
    )

    @dataclass(frozen=True)
    class Args:
        micro_batch: int = 0

    @classmethod
    def _check(cls, step, args, manifest):
        _check_mb(args, manifest)

    def factor(self) -> float:
        return 0.0  # not skipped outright: backward still runs, so DDP's collectives stay matched

    @at(Point.LOSS)
    def scale(self, bus, p: hooks.Loss):
        if bus.micro_batch == self.args.micro_batch:
            before = float(p.loss)
            p.loss = p.loss * self.factor()
            self.fire(
                bus,
                proof=(repr(before), repr(float(p.loss))),
                phase="loss",
                before=before,
                after=float(p.loss),
            )


@register
class LateMicrobatch(Fault):
    # expect backward: what it sends is the first evidence
    name, point, expect = "late-microbatch", Point.BACKWARD, "backward"
    recurrence = "persistent"
    description = (
        "the last micro-batch's gradient misses the all-reduce and is added locally after it"
    )
    requires = frozenset({Capability.COLLECTIVE_HOOK})

    @classmethod
    def _check(cls, step, args, manifest):
        if manifest.training.grad_accum_steps < 2:
            raise BadInput(
                "--set training.grad_accum_steps",
                "'late-microbatch' needs gradient accumulation (>= 2)",
            )

    def install(self, bus):
        self.before_last: dict = {}
        self.late: dict = {}
        super().install(bus)

    @at(Point.BACKWARD)  # the accumulated gradient before the last micro-batch
    def remember(self, bus, p: hooks.Backward):
        accum = self.manifest.training.grad_accum_steps
        if bus.micro_batch == accum - 2 and not p.before_collective:
            self.before_last = {i: g.detach().clone() for i, _, g, *_ in p.grads}

    @at(
        Point.BACKWARD, order=11
    )  # in the comm hook: send everything but the last micro-batch's part
    def hold_back(self, bus, p: hooks.Backward):
        import torch

        if p.before_collective:
            for i, _, g, *_ in p.grads:
                prev = self.before_last.get(i, torch.zeros_like(g))
                self.late[i] = g.detach() - prev
                g.copy_(prev)

    @at(Point.REDUCE)
    def add_late(self, bus, p: hooks.Reduce):
        touched = [g for i, _, g, *_ in p.grads if i in self.late]
        with self.changing(bus, touched, phase="reduce", tensors=len(self.late)):
            for i, _, g, *_ in p.grads:
                if i in self.late:
                    g.add_(self.late[i])


@register
class LossScale(DropMicrobatch):
    name, point, expect = "loss-scale", Point.LOSS, "loss"
    recurrence = "persistent"
    description = "multiplies one micro-batch's loss by a factor (default 1 + 1e-4) before backward"

    @dataclass(frozen=True)
    class Args:
        micro_batch: int = 0
        factor: float = 1.0001

    @classmethod
    def _check(cls, step, args, manifest):
        import math

        _check_mb(args, manifest)
        if args.factor == 1.0 or not math.isfinite(args.factor):
            raise BadInput(
                "--param factor",
                f"factor {args.factor} would change nothing (or nothing finite): use a finite "
                "factor != 1",
            )

    def factor(self) -> float:
        return self.args.factor
