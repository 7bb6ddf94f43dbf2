"""Clipping and the optimizer step: a norm taken locally (`clip-local-norm`), replicated parameters left
unclipped (`clip-skip-replicated`), an update applied to stale parameters (`stale-param`), a skewed
learning rate (`lr-skew`)."""

from __future__ import annotations

from dataclasses import dataclass

from disttrace.errors import BadInput
from disttrace.run.faults.base import Capability, Fault, at, register
from disttrace.run.faults.targets import _ParamFault
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


@register
class StaleParam(_ParamFault):
    name, point, expect = "stale-param", Point.OPTIMIZER, "optimizer"
    recurrence = "persistent"
    description = "applies the step's update to the previous step's parameters"

    @classmethod
    def _check(cls, step, args, manifest):
        if step < 2:
            raise BadInput("--step", "'stale-param' needs a previous step: use --step >= 2")

    def install(self, bus):
        self.saved: dict = {}
        super().install(bus)

    # under the parameter server `before_optimizer` hands the server its master parameters already
    @at(Point.BEFORE_OPTIMIZER, anytime=True)
    def keep(self, bus, p: hooks.BeforeOptimizer):
        if bus.step in (self.step - 1, self.step) and not self.fired:
            self.saved[bus.step] = [t.detach().clone() for _, _, t in p.params]

    @at(Point.OPTIMIZER)
    def restale(self, bus, p: hooks.Optimizer):
        tensors = [t for _, _, t in p.params]
        with self.changing(
            bus, tensors, phase="optimizer", tensors=len(tensors), target=self._target()
        ):
            for t, prev, cur in zip(tensors, self.saved[self.step - 1], self.saved[self.step]):
                t.data.copy_(prev + (t.detach() - cur))


@register
class LrSkew(Fault):
    name, point, expect = "lr-skew", Point.OPTIMIZER, "optimizer"
    recurrence = "persistent"
    description = "uses the learning rate times k for one step"

    @dataclass(frozen=True)
    class Args:
        k: float = 2.0

    @classmethod
    def _check(cls, step, args, manifest):
        import math

        if args.k == 1.0 or not math.isfinite(args.k):
            raise BadInput(
                "--param k",
                f"k = {args.k} would change nothing (or nothing finite): use a finite k != 1",
            )

    @at(Point.BEFORE_OPTIMIZER)
    def skew(self, bus, p: hooks.BeforeOptimizer):
        self.saved = [g["lr"] for g in p.optimizer.param_groups]
        for g in p.optimizer.param_groups:
            g["lr"] = g["lr"] * self.args.k

    # at `optimizer` itself (the parameter server's too): the learning rates are the optimizer's
    @at(Point.OPTIMIZER)
    def restore(self, bus, p: hooks.Optimizer):
        used = [g["lr"] for g in p.optimizer.param_groups]
        for g, lr in zip(p.optimizer.param_groups, self.saved):
            g["lr"] = lr
        self.fire(
            bus,
            proof=(repr(self.saved), repr(used)),
            phase="optimizer",
            k=self.args.k,
            lr_before=self.saved,
            lr_used=used,
        )


class _ClipFault(Fault):
    """A fault on the clip phase: it changes the norm a rank clips with, or what it clips (`act`)."""

    point, expect = Point.BEFORE_CLIP, "clip"

    @classmethod
    def _check(cls, step, args, manifest):
        if not manifest.training.max_grad_norm:
            raise BadInput(
                "--set training.max_grad_norm",
                f"'{cls.name}' acts on gradient clipping: set "
                "training.max_grad_norm (small enough that clipping is active)",
            )

    @at(Point.BEFORE_CLIP)
    def clip(self, bus, p: hooks.BeforeClip):
        before = (repr(float(p.norm)), sorted(p.skip))
        detail = self.act(p)
        after = (repr(float(p.norm)), sorted(p.skip))
        self.fire(bus, proof=(repr(before), repr(after)), phase="clip", **detail)

    def act(self, p: hooks.BeforeClip) -> dict:
        raise NotImplementedError


@register
class ClipLocalNorm(_ClipFault):
    name = "clip-local-norm"
    recurrence = "persistent"
    description = (
        "the rank clips with the norm of its local gradient shard instead of the global norm"
    )
    requires = frozenset({Capability.SHARDED_GRADS})

    def act(self, p: hooks.BeforeClip):
        import torch

        local = [
            g.to_local() if hasattr(g, "to_local") else g
            for _, _, t in p.named
            if (g := t.grad) is not None
        ]
        global_norm = float(p.norm)
        p.norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in local]))
        return {"global_norm": global_norm, "local_norm": float(p.norm)}


@register
class ClipSkipReplicated(_ClipFault):
    name = "clip-skip-replicated"
    recurrence = "persistent"
    description = (
        "under tensor parallel, the rank leaves its replicated (unsharded) parameters unclipped"
    )
    requires = frozenset({Capability.TP})

    @classmethod
    def _check(cls, step, args, manifest):
        super()._check(step, args, manifest)
        if manifest.parallelism.dp > 1:
            raise BadInput(
                "--fault",
                f"'{cls.name}' selects the parameters replicated across tp, but with dp = "
                f"{manifest.parallelism.dp} FSDP2 shards every parameter over dp (the norm weights "
                "too): the selection is empty and the fault would change nothing; use dp = 1",
            )

    def act(self, p: hooks.BeforeClip):
        replicated = [
            (i, n)
            for i, n, t in p.named
            if not (hasattr(t, "placements") and any(pl.is_shard() for pl in t.placements))
        ]
        p.skip |= {i for i, _ in replicated}
        return {"skipped": len(replicated), "tensors": [n for _, n in replicated][:8]}
