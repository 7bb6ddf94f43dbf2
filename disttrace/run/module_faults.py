"""Faults that act inside one module of the model, at known coordinates (docs/zoom.md): what `zoom` must name.

- `corrupt-module`: at (step, rank, micro-batch), scales one element of the output of the first `op` run
  inside the module's forward (a dispatch mode below the depth recorder's, so the recorded op output is the
  corrupted one), or, with `direction = backward`, of the gradient with respect to the module's output as it
  arrives in backward (a tensor hook ahead of every other).
- `tp-unsummed-row`: from `step` on, a row-parallel module's output is its rank's partial sum tagged
  Replicate instead of being summed over the tensor-parallel group (the fused-path bug of
  tests/scripts/tp_bugs.py's `unsummed-row`, in the harness's own model). Every rank of the job runs it (a
  collective left out on one rank only would hang the others); the named rank logs it.

Registered in the catalog (run/faults.py) like every other fault: checked before any process starts, one
`fault_fired` event with the proof.
"""

from __future__ import annotations

from disttrace.errors import BadInput
from disttrace.run.faults import Fault, capabilities, register, state_digest


def _module_paths(manifest) -> set[str]:
    """Every module path of the plain model that owns a parameter (and its parents), from the manifest."""
    from disttrace.model.names import parameter_names

    out = set()
    for name in parameter_names(manifest.model.model_dump(), 1, 0):
        parts = name.split(".")[:-1]
        for k in range(1, len(parts) + 1):
            out.add(".".join(parts[:k]))
    return out


def _check_module(cls, params, manifest) -> None:
    paths = _module_paths(manifest)
    if params["module"] not in paths:
        close = sorted(p for p in paths if params["module"].split(".")[-1] in p)[:3]
        raise BadInput(
            "--param module",
            f"'{cls.name}' names module '{params['module']}', which is not a module of this model"
            + (f"; e.g. {', '.join(close)}" if close else ""),
        )


@register
class CorruptModule(Fault):
    name, point, expect = "corrupt-module", "forward", "forward"
    recurrence = "transient"  # fires once, at its step: a replay of that step does not see it again
    description = (
        "scales one element of an op's output inside one module's forward, or of the gradient "
        "with respect to its output in backward (direction=backward)"
    )
    defaults = {
        "module": "layers.1.feed_forward.w1",
        "direction": "forward",
        "op": "aten.mm",
        "element": 1000,  # inside the tensor (a causal attention's first position has a zero query gradient)
        "scale": 1.5,
        "micro_batch": 0,
    }

    @classmethod
    def spec(cls, step, rank, params, manifest):
        out = super().spec(step, rank, params, manifest)
        if out["params"]["direction"] == "backward":
            # the parameter gradients it changes: the local ones where the strategy offers them
            out["expect"] = "backward" if "backward" in capabilities(manifest) else "reduce"
        return out

    @classmethod
    def _check(cls, step, params, manifest):
        if params["direction"] not in ("forward", "backward"):
            raise BadInput(
                "--param direction", f"'{params['direction']}' is not forward or backward"
            )
        accum = manifest.training.grad_accum_steps
        if not 0 <= params["micro_batch"] < accum:
            raise BadInput(
                "--param micro_batch",
                f"micro-batch {params['micro_batch']} does not exist: training.grad_accum_steps = {accum}",
            )
        if params["scale"] == 1.0:
            raise BadInput("--param scale", "a scale of 1 changes nothing")
        if manifest.parallelism.pp > 1:
            raise BadInput("--fault", f"'{cls.name}' does not support pipeline parallel yet")

    @classmethod
    def check_target(cls, rank, params, manifest):
        _check_module(cls, params, manifest)

    def install(self, bus):
        import torch

        module = self.ctx.strategy.plain.get_submodule(self.params["module"])
        state = {"inside": 0, "handles": [], "mode": None}
        mb = self.params["micro_batch"]

        def active(b) -> bool:
            return self.here(b) and b.micro_batch == mb

        def corrupt(t, **detail):
            """A copy of `t` with one element scaled; fires with the proof."""
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():
                out = t.clone()  # below autograd (a dispatch mode) or a gradient: a plain copy
                local = out._local_tensor if hasattr(out, "_local_tensor") else out
                flat = local.view(-1)
                if flat.numel() == 0:
                    return t
                e = self.params["element"] % flat.numel()
                before, d0 = float(flat[e]), state_digest(local)
                flat[e] = flat[e] * self.params["scale"]
                self.fire(
                    bus,
                    proof=(d0, state_digest(local)),
                    phase=self.params["direction"],
                    module=self.params["module"],
                    element=e,
                    before=before,
                    after=float(flat[e]),
                    **detail,
                )
            return out

        fault = self

        class _Corrupt(torch.utils._python_dispatch.TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if (
                    state["inside"]
                    and not fault.fired
                    and str(func.overloadpacket) == fault.params["op"]
                    and isinstance(out, torch.Tensor)
                    and torch._C._current_autograd_node() is None
                ):
                    return corrupt(out, op=fault.params["op"])
                return out

        def pre(mod, args):
            if active(bus):
                state["inside"] += 1

        def post(mod, args, out):
            if state["inside"]:
                state["inside"] -= 1
            if (
                self.params["direction"] == "backward"
                and active(bus)
                and isinstance(out, torch.Tensor)
                and out.requires_grad
            ):
                out.register_hook(lambda g: corrupt(g) if not self.fired else None)

        def start(b, p):
            if b.step != self.step:
                return
            state["handles"] = [
                module.register_forward_pre_hook(pre),
                module.register_forward_hook(post),
            ]
            if self.params["direction"] == "forward":
                state["mode"] = _Corrupt()
                state["mode"].__enter__()

        def end(b, p):
            if state["mode"] is not None:
                state["mode"].__exit__(None, None, None)
                state["mode"] = None
            for h in state["handles"]:
                h.remove()
            state["handles"] = []

        bus.on("step_start", start, order=10)
        bus.on(
            "step_end", end, order=99
        )  # after the depth recorder's mode (above this one) is gone


_ROW_PARALLEL = ("attention.wo", "feed_forward.w2")


@register
class TpUnsummedRow(Fault):
    name, point, expect = "tp-unsummed-row", "forward", "forward"
    recurrence = "persistent"  # a standing bug from its step on
    description = (
        "from step on, a row-parallel module's output is the rank's partial sum, tagged Replicate "
        "instead of summed over tp (every rank)"
    )
    defaults = {"module": "layers.0.feed_forward.w2"}
    requires = frozenset({"tp"})

    @classmethod
    def _check(cls, step, params, manifest):
        m = params["module"]
        if not (m.startswith("layers.") and m.split(".", 2)[-1] in _ROW_PARALLEL):
            raise BadInput(
                "--param module",
                f"'{m}' is not a row-parallel module (layers.K.attention.wo or layers.K.feed_forward.w2)",
            )

    @classmethod
    def check_target(cls, rank, params, manifest):
        _check_module(cls, params, manifest)

    def attach(self, bus, ctx) -> None:
        self.ctx, self.manifest = ctx, ctx.manifest
        self.fired = False
        self.install(bus)  # on every rank: the sum is left out everywhere, or the group would hang

    def install(self, bus):
        from torch.distributed.tensor import DTensor, Replicate

        module = self.ctx.strategy.plain.get_submodule(self.params["module"])

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
                    module=self.params["module"],
                    placements=[str(p) for p in out.placements],
                )
            return replaced

        # ahead of the parallel style's own output hook, which would sum a Partial output
        module.register_forward_hook(unsummed, prepend=True)
