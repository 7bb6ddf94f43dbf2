"""The job itself: a rank killed (`kill-rank`), a straggler (`slow-rank`), a collective of another shape
(`collective-mismatch`)."""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from disttrace.errors import BadInput
from disttrace.run.faults.base import Capability, Fault, at, register
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point, ProcessExit


@register
class KillRank(Fault):
    name, point, expect = "kill-rank", Point.STEP_START, "exit-3"
    recurrence = "transient"
    description = "the rank dies with SIGKILL at the start of the step"

    @at(Point.STEP_START)
    def kill(self, bus, p: hooks.StepStart):
        self.fire(bus, phase="data")
        bus.emit(ProcessExit(reason=self.name))  # SIGKILL leaves no chance to write later
        os.kill(os.getpid(), signal.SIGKILL)


@register
class SlowRank(Fault):
    name, point, expect = "slow-rank", Point.BACKWARD, "none"
    recurrence = "transient"
    description = (
        "the rank sleeps before its collectives (until the file `until` exists, if given, for at "
        "most `seconds`); numerics stay equal, the run flags it as straggler"
    )
    requires = frozenset({Capability.COLLECTIVE_HOOK})

    @dataclass(frozen=True)
    class Args:
        seconds: float = 0.5
        until: str = ""

    @classmethod
    def _check(cls, step, args, manifest):
        if not args.seconds > 0:
            raise BadInput(
                "--param seconds", f"seconds = {args.seconds} delays nothing: use seconds > 0"
            )

    def _wait(self) -> float:
        """`until`: a file another process creates ends the wait (tests order events by it, not by time)."""
        start, until, seconds = time.monotonic(), self.args.until, self.args.seconds
        if not until:
            time.sleep(seconds)
        while until and not os.path.exists(until) and time.monotonic() - start < seconds:
            time.sleep(0.05)
        return round(time.monotonic() - start, 3)

    @at(Point.BACKWARD)
    def sleep(self, bus, p: hooks.Backward):
        if p.before_collective:
            self.fire(bus, phase="backward", seconds=self._wait())


@register
class CollectiveMismatch(Fault):
    name, point, expect = "collective-mismatch", Point.BACKWARD, "exit-3"
    recurrence = "persistent"
    description = (
        "the rank issues an all-reduce of a different shape; the job ends with exit 3 naming it"
    )
    needs_dp2 = True
    requires = frozenset({Capability.COLLECTIVE_HOOK})

    @dataclass(frozen=True)
    class Args:
        extra: int = 1

    @classmethod
    def _check(cls, step, args, manifest):
        if args.extra < 1:
            raise BadInput(
                "--param extra", f"extra = {args.extra} issues a matching shape: use extra >= 1"
            )

    @at(Point.BACKWARD)
    def mismatch(self, bus, p: hooks.Backward):
        if p.before_collective:
            import torch
            import torch.distributed as dist

            g = p.grads[0][2]
            self.fire(bus, phase="backward", shape=[g.numel() + self.args.extra])
            bad = torch.zeros(g.numel() + self.args.extra, dtype=g.dtype, device=g.device)
            dist.all_reduce(bad, group=self.ctx.strategy.group)
