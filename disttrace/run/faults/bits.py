"""Bits of a value: one bit of a gradient or a parameter flipped once (`bitflip-grad`, `bitflip-param`),
or a device that flips a bit of every output of one kind of op (`faulty-device`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from disttrace.errors import BadInput
from disttrace.run.faults.base import Capability, Fault, at, register, state_digest
from disttrace.run.faults.targets import _check_bit, _ParamFault, _TensorFault, pick
from disttrace.run.job import hooks
from disttrace.run.job.hooks import Point


def flip_bit(t, element: int, bit: int) -> dict:
    """Flip one bit of one element in place. Returns the coordinates actually used: `element` (the requested
    index wrapped into the local tensor), `bit`, `before`/`after` values, `digest_before`/`digest_after`
    of the whole (local) tensor; `numel` 0 means there was nothing to flip."""
    import torch

    if hasattr(t, "to_local"):  # a DTensor: flip a bit of the shard this rank holds
        t = t.to_local()
    flat = t.detach().view(-1)
    d0 = state_digest(flat)
    if flat.numel() == 0:
        return {
            "element": None,
            "bit": bit,
            "before": None,
            "after": None,
            "numel": 0,
            "proof": (d0, d0),
        }
    element = element % flat.numel()
    before = float(flat[element])
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.element_size() * 8
    mask = (1 << bit) if bit < bits - 1 else -(1 << bit)  # the sign bit as a signed constant
    flat[element : element + 1].view(ints).bitwise_xor_(mask)
    return {
        "element": element,
        "bit": bit,
        "before": before,
        "after": float(flat[element]),
        "numel": int(flat.numel()),
        "proof": (d0, state_digest(flat)),
    }


def _fire_flip(fault: Fault, bus, phase: str, name: str, tensor, **extra) -> None:
    out = flip_bit(tensor, fault.args.element, fault.args.bit)
    fault.fire(
        bus,
        proof=out.pop("proof"),
        phase=phase,
        tensor=name,
        requested_element=fault.args.element,
        **out,
        **extra,
    )


@register
class BitflipGrad(_TensorFault):
    name, point, expect = "bitflip-grad", Point.BACKWARD, "backward"
    recurrence = "transient"
    description = "flips one bit of one element of a local gradient before the reduce"
    requires = frozenset({Capability.BACKWARD})

    @dataclass(frozen=True)
    class Args:
        tensor: str = "layers.0.attention.wq.weight"
        element: int = 0
        bit: int = 30
        micro_batch: int = -1

    @classmethod
    def _check(cls, step, args, manifest):
        _check_bit(args, manifest)
        accum = manifest.training.grad_accum_steps
        # a zero-code run knows no count before it steps: a micro-batch the step lacks never fires
        if accum is None:
            return
        if not -accum <= args.micro_batch < accum:
            raise BadInput(
                "--param micro_batch",
                f"micro-batch {args.micro_batch} does not exist: "
                f"training.grad_accum_steps = {accum} (-1 is the last)",
            )
        if manifest.parallelism.pp > 1 and args.micro_batch % accum != accum - 1:
            raise BadInput(
                "--param micro_batch",
                "under pipeline parallel the backward point is after the "
                "schedule (the accumulated gradient): only the last micro-batch (-1)",
            )

    @at(Point.BACKWARD)
    def flip(self, bus, p: hooks.Backward):
        # -1: the last micro-batch, the one the reduce follows
        accum = self.manifest.training.grad_accum_steps
        if bus.micro_batch == (self.args.micro_batch % accum if accum else self.args.micro_batch):
            entry = pick(p.grads, self.args.tensor)
            if entry is not None:
                _fire_flip(self, bus, "backward", entry[1], entry[2])


@register
class BitflipParam(_TensorFault, _ParamFault):
    name, point, expect = "bitflip-param", Point.OPTIMIZER, "optimizer"
    recurrence = "transient"
    description = (
        "flips one bit of a parameter after the optimizer step (default a mantissa bit: silent)"
    )

    @dataclass(frozen=True)
    class Args:
        tensor: str = "layers.0.attention.wq.weight"
        element: int = 0
        bit: int = 16

    @classmethod
    def _check(cls, step, args, manifest):
        _check_bit(args, manifest)

    @at(Point.OPTIMIZER)
    def flip(self, bus, p: hooks.Optimizer):
        entry = pick(p.params, self.args.tensor)
        if entry is not None:
            _fire_flip(self, bus, "optimizer", entry[1], entry[2], target=self._target())


def launch_slot(device=None) -> int:
    """The physical slot this process runs in, from what its launcher put in its environment, never from
    its rank: node (GROUP_RANK) times processes per node (LOCAL_WORLD_SIZE) plus the local slot, which on a
    GPU is the CUDA device the process computes on (`device`), LOCAL_RANK otherwise. A process started
    without those variables is slot 0."""
    env = os.environ
    local = int(env.get("LOCAL_RANK", 0))
    if device is not None and getattr(device, "type", None) == "cuda" and device.index is not None:
        local = device.index
    node = int(env.get("GROUP_RANK", env.get("NODE_RANK", 0)))
    return node * int(env.get("LOCAL_WORLD_SIZE", 1)) + local


FAULTY_OPS = ("linear", "embedding")


@register
class FaultyDevice(Fault):
    name, point, expect = "faulty-device", Point.FORWARD, "forward"
    recurrence = "device"
    description = (
        "from step S on, the physical slot rank R held at launch (local process slot; CUDA device on a "
        "GPU) flips one bit of one element of every output of one kind of op it computes, whichever rank "
        "runs there"
    )

    @dataclass(frozen=True)
    class Args:
        op: str = "linear"
        element: int = 0
        bit: int = 20
        slot: int = -1  # the launch slot of rank R (the launcher hands out ranks in slot order)

    @classmethod
    def _check(cls, step, args, manifest):
        _check_bit(args, manifest)
        if args.op not in FAULTY_OPS:
            raise BadInput("--param op", f"'{args.op}' is not one of {', '.join(FAULTY_OPS)}")

    @classmethod
    def check_target(cls, rank, args, manifest):
        world = manifest.parallelism.world_size
        if not -1 <= args.slot < world:
            raise BadInput("--param slot", f"slot {args.slot} does not exist: {world} slots")

    @classmethod
    def record(cls, step, rank, params):
        slot = rank if params["slot"] < 0 else params["slot"]
        return super().record(step, rank, {**params, "slot": slot})

    def installs_here(self, bus) -> bool:
        # bound to the slot, not to the rank: under `replay --permute-ranks` another rank runs there
        self.slot = launch_slot(getattr(self.ctx, "device", None))
        return self.slot == self.args.slot

    def install(self, bus):
        import torch

        kind = {"linear": torch.nn.Linear, "embedding": torch.nn.Embedding}[self.args.op]
        model = getattr(getattr(self.ctx, "strategy", None), "plain", None)
        if model is None:
            raise BadInput(
                "--fault", f"'{self.name}' needs the model's modules, which this run lacks"
            )
        logged = set()

        def corrupt(name, _mod, _inp, out):
            if bus.step < self.step:
                return
            t = out.to_local() if hasattr(out, "to_local") else out
            flat = t.detach().view(-1)
            if not flat.numel():
                return
            element = self.args.element % flat.numel()
            before = float(flat[element])
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
            bit = self.args.bit
            mask = (1 << bit) if bit < flat.element_size() * 8 - 1 else -(1 << bit)
            flat[element : element + 1].view(ints).bitwise_xor_(mask)
            if (
                bus.step not in logged
            ):  # every output is corrupted; the first of each step is logged
                logged.add(bus.step)
                self.fire(
                    bus,
                    proof=(repr(before), repr(float(flat[element]))),
                    phase="forward",
                    slot=self.slot,
                    op=self.args.op,
                    module=name,
                    element=element,
                    bit=bit,
                )

        for name, module in model.named_modules():
            if isinstance(module, kind):
                module.register_forward_hook(lambda m, i, o, name=name: corrupt(name, m, i, o))
