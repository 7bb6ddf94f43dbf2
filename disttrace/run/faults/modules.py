"""Faults that act inside one module of the model, at known coordinates (docs/zoom.md): what `zoom` must name.

- `corrupt-module`: at (step, rank, micro-batch), scales one element of the output of the first `op` run
  inside the module's forward (a dispatch mode below the depth recorder's, so the recorded op output is the
  corrupted one), or, with `direction = backward`, of the gradient with respect to the module's output as it
  arrives in backward (a tensor hook ahead of every other).
- `tp-unsummed-row`: from `step` on, a row-parallel module's output is its rank's partial sum tagged
  Replicate instead of being summed over the tensor-parallel group (the fused-path bug of
  tests/scripts/tp_bugs.py's `unsummed-row`, in the harness's own model). Every rank of the job runs it (a
  collective left out on one rank only would hang the others); the named rank logs it.

Registered in the catalog (run/faults/) like every other fault: checked before any process starts, one
`fault_fired` event with the proof.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrace.errors import BadInput
from disttrace.run.faults.base import (
    Capability,
    Fault,
    at,
    capabilities,
    register,
    state_digest,
)
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


def _module_paths(manifest) -> set[str]:
    """Every module path of the plain model that owns a parameter (and its parents), from the manifest."""
    from disttrace.model.names import parameter_names

    out = set()
    for name in parameter_names(manifest.model.model_dump(), 1, 0):
        parts = name.split(".")[:-1]
        for k in range(1, len(parts) + 1):
            out.add(".".join(parts[:k]))
    return out


def _check_module(cls, args, manifest) -> None:
    paths = _module_paths(manifest)
    if args.module not in paths:
        close = sorted(p for p in paths if args.module.split(".")[-1] in p)[:3]
        raise BadInput(
            "--param module",
            f"'{cls.name}' names module '{args.module}', which is not a module of this model"
            + (f"; e.g. {', '.join(close)}" if close else ""),
        )


class _ModuleFault(Fault):
    """A fault inside one module of the model: the module must exist."""

    @classmethod
    def check_target(cls, rank, args, manifest):
        _check_module(cls, args, manifest)


@register
class CorruptModule(_ModuleFault):
    name, point, expect = "corrupt-module", Point.FORWARD, "forward"
    recurrence = "transient"  # fires once, at its step: a replay of that step does not see it again
    description = (
        "scales one element of an op's output inside one module's forward, or of the gradient "
        "with respect to its output in backward (direction=backward)"
    )

    @dataclass(frozen=True)
    class Args:
        module: str = "layers.1.feed_forward.w1"
        direction: str = "forward"
        op: str = "aten.mm"
        # inside the tensor (a causal attention's first position has a zero query gradient)
        element: int = 1000
        scale: float = 1.5
        micro_batch: int = 0

    @classmethod
    def spec(cls, step, rank, params, manifest):
        out = super().spec(step, rank, params, manifest)
        if out["params"]["direction"] == "backward":
            # the parameter gradients it changes: the local ones where the strategy offers them
            out["expect"] = (
                "backward" if Capability.BACKWARD in capabilities(manifest) else "reduce"
            )
        return out

    @classmethod
    def _check(cls, step, args, manifest):
        if args.direction not in ("forward", "backward"):
            raise BadInput("--param direction", f"'{args.direction}' is not forward or backward")
        accum = manifest.training.grad_accum_steps
        if not 0 <= args.micro_batch < accum:
            raise BadInput(
                "--param micro_batch",
                f"micro-batch {args.micro_batch} does not exist: training.grad_accum_steps = {accum}",
            )
        if args.scale == 1.0:
            raise BadInput("--param scale", "a scale of 1 changes nothing")
        if manifest.parallelism.pp > 1:
            raise BadInput("--fault", f"'{cls.name}' does not support pipeline parallel yet")

    def install(self, bus):
        self.module = self.ctx.strategy.plain.get_submodule(self.args.module)
        self.inside = 0  # how deep the forward is inside the module at the step's micro-batch
        self.handles: list = []
        self.mode = None
        self.bus = bus
        super().install(bus)

    def active(self, bus) -> bool:
        return self.here(bus) and bus.micro_batch == self.args.micro_batch

    def corrupt(self, t, **detail):
        """A copy of `t` with one element scaled; fires with the proof."""
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            out = t.clone()  # below autograd (a dispatch mode) or a gradient: a plain copy
            local = out._local_tensor if hasattr(out, "_local_tensor") else out
            flat = local.view(-1)
            if flat.numel() == 0:
                return t
            e = self.args.element % flat.numel()
            before, d0 = float(flat[e]), state_digest(local)
            flat[e] = flat[e] * self.args.scale
            self.fire(
                self.bus,
                proof=(d0, state_digest(local)),
                phase=self.args.direction,
                module=self.args.module,
                element=e,
                before=before,
                after=float(flat[e]),
                **detail,
            )
        return out

    def _pre(self, mod, args):
        if self.active(self.bus):
            self.inside += 1

    def _post(self, mod, args, out):
        import torch

        if self.inside:
            self.inside -= 1
        if (
            self.args.direction == "backward"
            and self.active(self.bus)
            and isinstance(out, torch.Tensor)
            and out.requires_grad
        ):
            out.register_hook(lambda g: self.corrupt(g) if not self.fired else None)

    @at(Point.STEP_START)
    def start(self, bus, p: hooks.StepStart):
        self.handles = [
            self.module.register_forward_pre_hook(self._pre),
            self.module.register_forward_hook(self._post),
        ]
        if self.args.direction == "forward":
            self.mode = _corrupting_mode(self)
            self.mode.__enter__()

    # after the depth recorder's mode (above it) is gone
    @at(Point.STEP_END, order=99, anytime=True)
    def end(self, bus, p: hooks.StepEnd):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None
        for h in self.handles:
            h.remove()
        self.handles = []


def _corrupting_mode(fault: CorruptModule):
    """A dispatch mode that hands back the first output of the fault's op run inside its module (outside
    autograd's own nodes) corrupted."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Corrupt(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if (
                fault.inside
                and not fault.fired
                and str(func.overloadpacket) == fault.args.op
                and isinstance(out, torch.Tensor)
                and torch._C._current_autograd_node() is None
            ):
                return fault.corrupt(out, op=fault.args.op)
            return out

    return _Corrupt()


_ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


@register
class TpUnsummedRow(_ModuleFault):
    name, point, expect = "tp-unsummed-row", Point.FORWARD, "forward"
    recurrence = "persistent"  # a standing bug from its step on
    description = (
        "from step on, a row-parallel module's output is the rank's partial sum, tagged Replicate "
        "instead of summed over tp (every rank)"
    )
    requires = frozenset({Capability.TP})

    @dataclass(frozen=True)
    class Args:
        module: str = "layers.0.feed_forward.w2"

    @classmethod
    def _check(cls, step, args, manifest):
        m = args.module
        if not (m.startswith("layers.") and m.split(".", 2)[-1] in _ROW_PARALLEL):
            raise BadInput(
                "--param module",
                f"'{m}' is not a row-parallel module (layers.K.attention.wo or layers.K.feed_forward.w2)",
            )

    def installs_here(self, bus) -> bool:
        return True  # on every rank: the sum is left out everywhere, or the group would hang

    def install(self, bus):
        from torch.distributed.tensor import DTensor, Replicate

        module = self.ctx.strategy.plain.get_submodule(self.args.module)

        def unsummed(mod, args, out):
            if bus.step < self.step or not isinstance(out, DTensor):
                return None
            local = out.to_local()
            replaced = DTensor.from_local(
                local,
                out.device_mesh,
                [Replicate()] * out.device_mesh.ndim,
                run_check=False,
                shape=out.shape,
                stride=out.stride(),
            )
            if bus.rank == self.rank and not self.fired:
                d = state_digest(local.detach())
                self.fire(
                    bus,
                    proof=(f"partial:{d}", f"replicate:{d}"),
                    phase="forward",
                    module=self.args.module,
                    placements=[str(p) for p in out.placements],
                )
            return replaced

        # ahead of the parallel style's own output hook, which would sum a Partial output
        module.register_forward_hook(unsummed, prepend=True)
