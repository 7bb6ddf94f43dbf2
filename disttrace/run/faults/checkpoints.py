"""Checkpoints: one written without optimizer state (`optimizer-reset`), one with flipped bytes in a shard
file (`corrupt-checkpoint`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disttrace.errors import BadInput
from disttrace.run.faults.base import Fault, at, register
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


@register
class OptimizerReset(Fault):
    name, point, expect = "optimizer-reset", Point.CHECKPOINT, "resume:optimizer"
    recurrence = "persistent"
    description = "the checkpoint at step S is written without optimizer state (on every rank: one checkpoint)"
    needs_checkpoint_step = True

    def installs_here(self, bus) -> bool:
        return (
            True  # a checkpoint is one collective object: the state is dropped on every rank alike
        )

    @at(Point.BEFORE_CHECKPOINT, anytime=True)
    def drop(self, bus, p: hooks.BeforeCheckpoint):
        if bus.step == self.step and "optim" in p.state:
            before = sorted(p.state)
            del p.state["optim"]
            if bus.rank == self.rank:  # the event is logged once, by the named rank
                self.fire(
                    bus,
                    proof=(repr(before), repr(sorted(p.state))),
                    phase="checkpoint",
                    dropped="optim",
                )


@register
class CorruptCheckpoint(Fault):
    name, point, expect = "corrupt-checkpoint", Point.CHECKPOINT, "refused-at-load"
    recurrence = "transient"
    description = "flips bytes in one shard file of the checkpoint written at step S"
    needs_checkpoint_step = True

    @dataclass(frozen=True)
    class Args:
        nbytes: int = 1

    @classmethod
    def _check(cls, step, args, manifest):
        if args.nbytes < 1:
            raise BadInput(
                "--param nbytes", f"nbytes = {args.nbytes} flips nothing: use nbytes >= 1"
            )

    @at(Point.CHECKPOINT)
    def corrupt(self, bus, p: hooks.Checkpoint):
        import hashlib

        target = Path(p.path) / f"__{self.rank}_0.distcp"
        if not target.exists():
            target = sorted(Path(p.path).glob("*.distcp"))[0]
        data = bytearray(target.read_bytes())
        before = hashlib.sha256(data).hexdigest()
        at = len(data) // 2
        for i in range(self.args.nbytes):
            data[(at + i) % len(data)] ^= 0xFF
        target.write_bytes(bytes(data))
        self.fire(
            bus,
            proof=(before, hashlib.sha256(target.read_bytes()).hexdigest()),
            phase="checkpoint",
            file=target.name,
            offset=at,
            nbytes=min(self.args.nbytes, len(data)),
        )
