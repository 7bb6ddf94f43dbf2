"""The fault catalog: one registry entry per fault, each attached at a named hook point.

An entry states its name, hook point, parameters (with defaults), a one-line description and the first
divergence it must produce (`expect`). A fault fires exactly once, on its (step, rank), and logs the exact
coordinates to events.jsonl. The training loop knows none of them.

Proof that it fired: a fault that changes state passes `proof=(before, after)` to `fire` (a digest of the
raw bytes of what it names, or the scalar it changes), and the `fault_fired` event carries
`digest_before`, `digest_after` and `changed`. A spec that could change nothing (an unknown tensor, an
empty selection under the strategy, a no-op parameter) is refused before any process starts (exit 2).

`expect` uses the phases of docs/design.md, "Order"; special signatures: "resume:optimizer" (the recovered run diverges at
the resume step), "refused-at-load", "exit-3", "none" (numerics equal; a straggler is flagged).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

from disttrace.config.attached import AttachedManifest
from disttrace.config.manifest import Manifest
from disttrace.errors import BadInput
from disttrace.run import hooks
from disttrace.run.hooks import Point, ProcessExit
from disttrace.store.records import FaultEvent
from disttrace.store.rundir import event

AnyManifest = Manifest | AttachedManifest  # the harness's job, or an attached script (run/attach/)

REGISTRY: dict[str, type[Fault]] = {}


def register(cls):
    REGISTRY[cls.name] = cls
    return cls


# How a fault behaves when its step is executed again (`disttrace replay`, docs/replay.md): a one-off event
# that does not recur (a bit flip, a crash: "transient"), a standing bug of code, data or configuration that
# does ("persistent"), or hardware bound to a physical slot, not to a rank ("device"). A replay keeps the
# fault only when it recurs; the attribution never reads this, only the replayed and stored trajectories.
RECURRENCES = ("transient", "persistent", "device")


class Capability(StrEnum):
    """What a strategy's hook points carry (see `capabilities`): a fault `requires` some of them."""

    BACKWARD = "backward"  # the local gradient before any data-parallel reduce reaches `backward`
    COLLECTIVE_HOOK = (
        "collective_hook"  # that point runs right before the gradient collective is issued
    )
    SHARDED_GRADS = "sharded_grads"  # ranks hold different pieces of the gradient
    TP = "tp"  # tensor parallel: replicated (norm) parameters beside sharded ones


@dataclass(frozen=True)
class NoArgs:
    """The parameters of a fault that takes none."""


@dataclass(frozen=True)
class _Hook:
    point: Point
    order: int
    anytime: bool


def at(point: Point, *, order: int = 10, anytime: bool = False):
    """Declare a fault's method a handler at `point` (its `order` among the point's handlers: 10 acts before
    the recorder at 90 observes, so the record shows what was done). It is called only at the fault's own
    (step, rank) while it has not fired, unless `anytime` (the method decides)."""

    def mark(fn):
        fn.__fault_hook__ = _Hook(point, order, anytime)
        return fn

    return mark


class Fault:
    """One catalog entry. A subclass states its name, point, expected signature, recurrence, parameters
    (`Args`, a frozen dataclass whose defaults are the catalog's) and the capabilities it needs, and marks
    what it does with `@at(point)`; `attach` installs those handlers on the rank it acts on."""

    name: ClassVar[str] = ""
    point: ClassVar[Point]  # the hook point it acts at, as run.json and the catalog name it
    expect: ClassVar[str] = ""
    description: ClassVar[str] = ""
    recurrence: ClassVar[str] = ""  # one of RECURRENCES; every catalog entry states its own
    Args: ClassVar[type] = NoArgs
    defaults: ClassVar[dict] = {}  # Args' defaults, by field (derived)
    needs_dp2: ClassVar[bool] = False
    needs_checkpoint_step: ClassVar[bool] = False
    # hook capabilities the strategy must offer (see `capabilities`)
    requires: ClassVar[frozenset[Capability]] = frozenset()
    _hooks: ClassVar[tuple[tuple[str, _Hook], ...]] = ()

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.defaults = {f.name: f.default for f in fields(cls.Args)}
        found: dict[str, _Hook] = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                hook = getattr(fn, "__fault_hook__", None)
                if hook is not None:
                    found[attr] = hook
        cls._hooks = tuple(found.items())

    def __init__(self, step: int, rank: int, params: dict):
        self.step, self.rank, self.params = step, rank, params
        self.args = self.Args(**self.parameters(params))

    # ---------------------------------------------------------- checked before any process starts
    # Three callers check a fault request: `spec` (our trainer, against the manifest), usercmd.fault_spec
    # (`inject -- CMD`, before the user's command runs: what needs no job) and `attached` (attach.build_fault,
    # inside the user's job, against what the script offers). The checks themselves live here, once.
    @classmethod
    def parameters(cls, params: dict) -> dict:
        """The defaults with the given parameters over them, each converted to its default's type."""
        unknown = sorted(set(params) - set(cls.defaults))
        if unknown:
            raise BadInput(
                f"--param {unknown[0]}",
                f"fault '{cls.name}' has no parameter '{unknown[0]}'; "
                f"it takes: {', '.join(cls.defaults) or 'none'}",
            )
        merged = {**cls.defaults}
        for k, v in params.items():
            try:
                merged[k] = type(cls.defaults[k])(v)
            except (TypeError, ValueError):
                raise BadInput(
                    f"--param {k}", f"'{v}' is not a {type(cls.defaults[k]).__name__}"
                ) from None
        return merged

    @classmethod
    def coordinates(
        cls, step: int, rank: int, steps: int | None = None, world: int | None = None
    ) -> None:
        """Step and rank exist (against the run's length and world size where they are known)."""
        if step < 1 or (steps is not None and step > steps):
            raise BadInput(
                "--step",
                f"step {step} does not exist: "
                + (
                    f"the manifest runs steps 1..{steps}"
                    if steps is not None
                    else "steps count from 1"
                ),
            )
        if rank < 0 or (world is not None and rank >= world):
            raise BadInput(
                "--rank",
                f"rank {rank} does not exist" + (f": world size is {world}" if world else ""),
            )

    @classmethod
    def offered(cls, dp: int, caps: set, has: str, offers: str) -> None:
        """The run offers what the fault acts on: data parallelism if it needs it, and its hook points. `has` and
        `offers` name the run in the message ("this manifest", "the DDP strategy"; "this script", ...)."""
        if cls.needs_dp2 and dp < 2:
            raise BadInput(
                "--fault", f"'{cls.name}' needs data parallelism (dp >= 2); {has} has dp = {dp}"
            )
        missing = cls.requires - caps
        if missing:
            raise BadInput(
                "--fault",
                f"'{cls.name}' needs the {', '.join(sorted(missing))} hook point, which "
                f"{offers} does not offer",
            )

    @classmethod
    def spec(cls, step: int, rank: int, params: dict, manifest: Manifest) -> dict:
        merged = cls.parameters(params)
        par = manifest.parallelism
        cls.coordinates(step, rank, manifest.training.steps, par.world_size)
        cls.offered(
            par.dp,
            capabilities(manifest),
            "this manifest",
            f"the {strategy_name(manifest)} strategy",
        )
        if (
            par.architecture == "parameter-server"
            and cls.point in (Point.REDUCE, Point.OPTIMIZER, Point.BEFORE_CLIP)
            and rank != 0
        ):
            raise BadInput(
                "--rank",
                f"under the parameter server only rank 0 reduces and steps the optimizer: "
                f"'{cls.name}' must target --rank 0",
            )
        if par.pp > 1 and cls.point == Point.LOSS:
            from disttrace.run.topology import coords_of, mesh_shape

            if coords_of(rank, mesh_shape(manifest)[0])["pp"] != par.pp - 1:
                raise BadInput(
                    "--rank",
                    f"under pipeline parallel only the last stage computes the loss: "
                    f"'{cls.name}' must target a rank of stage {par.pp - 1}",
                )
        interval = manifest.checkpoint.interval
        if cls.needs_checkpoint_step and (not interval or step % interval):
            raise BadInput(
                "--step",
                f"'{cls.name}' acts on a checkpoint, but no checkpoint is written at step "
                f"{step} (checkpoint.interval = {interval})",
            )
        cls.check(step, merged, manifest)
        cls.check_target(rank, cls.Args(**merged), manifest)
        return cls.record(step, rank, merged)

    @classmethod
    def attached(
        cls,
        step: int,
        rank: int,
        params: dict,
        manifest: dict,
        engine: str,
        caps: set[str],
        names: list[str],
    ) -> dict:
        """Inside an attached job (attach.build_fault): the checks against the manifest attach built (its stored
        dict), the hook points the script offers (`attached_capabilities`) and the model's parameter `names`."""
        from disttrace.config.manifest import Checkpoint

        where = "--fault"
        m = typed(manifest)
        cls.coordinates(step, rank, world=m.parallelism.world_size)
        if cls.point == Point.DATA:
            raise BadInput(
                where,
                f"'{cls.name}' needs the data point to fetch another rank's shard, which an "
                "attached script does not offer",
            )
        own_hook = (
            ", its own DDP comm hook"
            if engine == "DDP" and "backward" in caps and "collective_hook" not in caps
            else ""
        )
        cls.offered(m.parallelism.dp, caps, "this script", f"this script ({engine}{own_hook})")
        merged = cls.parameters(params)
        # what a script may do at any step: clip, and checkpoint
        training = m.training.model_copy(update={"max_grad_norm": 1.0, "steps": max(step, 1)})
        pseudo = m.model_copy(update={"checkpoint": Checkpoint(interval=1), "training": training})
        accum = m.training.grad_accum_steps
        try:
            cls.check(step, merged, pseudo)
        except (KeyError, TypeError):
            raise BadInput(
                where,
                f"'{cls.name}' needs the accumulation count: pass config={{'grad_accum_steps': N}} "
                "to attach",
            ) from None
        args = cls.Args(**merged)
        if accum is None and (getattr(args, "micro_batch", 0) < 0 or cls.name == "late-microbatch"):
            raise BadInput(
                where,
                f"'{cls.name}' needs the accumulation count: pass config={{'grad_accum_steps': N}} "
                "to attach",
            )
        tensor = getattr(args, "tensor", None)
        if (
            tensor is not None
            and tensor not in names
            and not (str(tensor).isdigit() and int(tensor) < len(names))
        ):
            raise BadInput(
                "--param tensor",
                f"this model has no tensor '{tensor}'; it has: "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}",
            )
        return cls.record(step, rank, merged)

    @classmethod
    def record(cls, step: int, rank: int, params: dict) -> dict:
        """The fault as run.json records it (params already merged with the defaults and checked)."""
        return {
            "name": cls.name,
            "step": step,
            "rank": rank,
            "params": params,
            "point": cls.point.value,
            "expect": cls.expect,
        }

    @classmethod
    def check(cls, step: int, params: dict, manifest: AnyManifest | dict) -> None:
        """Fault-specific validation (raise BadInput) of the merged parameters. attach.build_fault hands
        its manifest as a dict."""
        cls._check(step, cls.Args(**params), typed(manifest))

    @classmethod
    def _check(cls, step: int, args, manifest: AnyManifest) -> None:
        """A fault's own checks of its parameters (`Args`) against the manifest (raise BadInput)."""

    @classmethod
    def check_target(cls, rank: int, args, manifest: Manifest) -> None:
        """Refuse a target that does not exist on that rank (raise BadInput): a fault that could change
        nothing must not produce a 'fault run' that is a second reference."""

    # ---------------------------------------------------------- in the job
    def attach(self, bus, ctx) -> None:
        self.ctx, self.manifest = ctx, typed(ctx.manifest)
        self.fired = False
        if self.installs_here(bus):
            self.install(bus)

    def installs_here(self, bus) -> bool:
        """Whether this process runs the fault: on its rank (a fault every rank must run alike says so)."""
        return bus.rank == self.rank

    def install(self, bus) -> None:
        """Put the `@at` handlers in place (a fault acting through torch's own hooks adds them here)."""
        for attr, hook in self._hooks:
            bus.on(self.where(hook.point), self._handler(getattr(self, attr), hook), hook.order)

    def _handler(self, method, hook: _Hook):
        if hook.anytime:
            return method
        return lambda bus, p: method(bus, p) if self.here(bus) else None

    def where(self, point: Point) -> Point:
        """The point a handler declared at `point` installs at under this manifest (its own, but for faults
        whose point moves with the strategy)."""
        return point

    def here(self, bus) -> bool:
        return not self.fired and bus.step == self.step and bus.rank == self.rank

    @contextlib.contextmanager
    def changing(self, bus, watched: list, /, **detail: Any):
        """Fire with proof for a change made in place inside the block: the digest of the `watched` tensors
        before and after it (the common case; faults that replace an object or change a scalar pass `proof`
        to fire themselves)."""
        before = state_digest(*watched)
        yield
        self.fire(bus, proof=(before, state_digest(*watched)), **detail)

    def fire(self, bus, proof: tuple | None = None, **detail: Any) -> None:
        """Log the firing; `proof` = (before, after) digests (or values) of what the fault changed."""
        self.fired = True
        if proof is not None:
            detail.update(
                digest_before=proof[0], digest_after=proof[1], changed=proof[0] != proof[1]
            )
        line = FaultEvent(
            fault=self.name,
            step=bus.step,
            micro_batch=bus.micro_batch,
            rank=bus.rank,
            point=self.point.value,
            params=self.params,
            **detail,
        ).line()
        event(self.ctx.run_dir, line.pop("event"), **line)


def typed(manifest: AnyManifest | dict) -> AnyManifest:
    """The manifest as a model. The harness's job hands its Manifest; the attach API still hands the dict it
    stores (or a stand-in built from it): that is an AttachedManifest, validated here."""
    return AttachedManifest.model_validate(manifest) if isinstance(manifest, dict) else manifest


def strategy_name(manifest: Manifest) -> str:
    p = manifest.parallelism
    if p.architecture == "parameter-server":
        return f"parameter-server (staleness {p.staleness})"
    if p.pp > 1:
        return f"pipeline ({p.pp_schedule})"
    if p.tp > 1:
        return "tensor-parallel" + (" x FSDP2" if p.dp > 1 else "")
    return {
        0: "DDP",
        1: "ZeRO-1 (DDP + ZeroRedundancyOptimizer)",
        2: "ZeRO-2 (FSDP2)",
        3: "ZeRO-3 (FSDP2)",
    }[p.zero_stage]


def capabilities(manifest: Manifest) -> set[str]:
    """Which hook points carry what under this manifest's strategy:
    'backward': the local gradient before any data-parallel reduce is handed to the `backward` point;
    'collective_hook': that point runs right before the gradient collective is issued (DDP's comm hook);
    'sharded_grads': ranks hold different pieces of the gradient (a local norm is not the global one);
    'tp': tensor parallel, with replicated (norm) parameters beside sharded ones."""
    caps = _capabilities(manifest)
    p = manifest.parallelism
    if p.architecture != "parameter-server" and (p.zero_stage >= 2 or p.tp > 1 or p.pp > 1):
        caps.add("sharded_grads")
    if p.tp > 1:
        caps.add("tp")
    return caps


def _capabilities(manifest: Manifest) -> set[str]:
    p = manifest.parallelism
    if p.architecture == "parameter-server":
        return {"backward"}  # the push is point-to-point, not a collective
    if p.pp > 1:  # after the schedule: the stage's accumulated gradient, local only without dp/tp
        return {"backward"} if p.dp == 1 and p.tp == 1 else set()
    if p.tp > 1:
        return {"backward"} if p.dp == 1 else set()
    if p.zero_stage >= 2:
        return set()  # FSDP2 reduce-scatters inside its own post-backward
    return {"backward", "collective_hook"}


def attached_capabilities(engine: str, comm_hook: bool) -> set[str]:
    """The hook points an attached script offers (the vocabulary of `capabilities`), by the engine attach
    found: FSDP2 none (it reduce-scatters inside its own post-backward), DeepSpeed `backward` (a hook on each
    parameter; its collectives are its own), DDP also `collective_hook` while attach's comm hook is in place."""
    if engine == "FSDP2":
        return set()
    if engine == "DeepSpeed":
        return {"backward"}
    caps = {"backward"}
    if engine == "DDP" and comm_hook:
        caps.add("collective_hook")
    return caps


def catalog() -> list[dict]:
    return [
        {
            "name": c.name,
            "point": c.point.value,
            "expect": c.expect,
            "description": c.description,
            "params": c.defaults,
        }
        for c in REGISTRY.values()
    ]


def get(name: str) -> type[Fault]:
    if name not in REGISTRY:
        raise BadInput("--fault", f"unknown fault '{name}'; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def build(spec: dict | None) -> Fault | None:
    if not spec:
        return None
    return REGISTRY[spec["name"]](spec["step"], spec["rank"], dict(spec["params"]))


# ---------------------------------------------------------------- helpers


def state_digest(*tensors) -> str:
    """xxh3-128 of the raw bytes of the tensors this rank holds (a DTensor: its shard): a fault's proof."""
    import xxhash

    from disttrace.run.digest import raw_bytes

    h = xxhash.xxh3_128()
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        h.update(raw_bytes(t))
    return h.hexdigest()


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


def pick(grads, tensor: str):
    """Find the (index, name, tensor) entry named `tensor` (a name, or an index as text)."""
    for entry in grads:
        if entry[1] == tensor or str(entry[0]) == tensor:
            return entry
    return None


def _check_bit(args, manifest: AnyManifest):
    bits = 64 if manifest.training.dtype == "float64" else 32
    if not 0 <= args.bit < bits:
        raise BadInput("--param bit", f"bit {args.bit} does not exist in a {bits}-bit value")


def _check_tensor(cls, rank: int, args, manifest: Manifest) -> None:
    """The named tensor (a name, or an index as text, as `pick`) must be a parameter the rank holds."""
    from disttrace.model.names import parameter_names

    par = manifest.parallelism
    stage = 0
    if par.pp > 1:
        from disttrace.run.topology import coords_of, mesh_shape

        stage = coords_of(rank, mesh_shape(manifest)[0])["pp"]
    names = parameter_names(manifest.model.model_dump(), par.pp, stage)
    want = str(args.tensor)
    if want in names or (want.isdigit() and int(want) < len(names)):
        return
    where = f" (pipeline stage {stage} of rank {rank})" if par.pp > 1 else ""
    close = [n for n in names if want.split(".")[-1] in n][:3] or names[:3]
    raise BadInput(
        "--param tensor",
        f"'{cls.name}' names tensor '{want}', which is not a parameter of this "
        f"model{where}: it would change nothing; e.g. {', '.join(close)} (or an index 0..{len(names) - 1})",
    )


def _check_mb(args, manifest: AnyManifest):
    accum = manifest.training.grad_accum_steps
    if not 0 <= args.micro_batch < accum:
        raise BadInput(
            "--param micro_batch",
            f"micro-batch {args.micro_batch} does not exist: training.grad_accum_steps = {accum}",
        )


class _TensorFault(Fault):
    """A fault on one named parameter (or its gradient): the rank must hold it."""

    @classmethod
    def check_target(cls, rank, args, manifest):
        _check_tensor(cls, rank, args, manifest)


class _ParamFault(Fault):
    """A fault on the parameters after the optimizer step. Under the parameter server it acts on the server's
    master parameters before it hands them out (`server_update`), else the next pull would overwrite it."""

    def where(self, point: Point) -> Point:
        return Point.SERVER_UPDATE if point == Point.OPTIMIZER and self._on_server() else point

    def _on_server(self) -> bool:
        return self.manifest.parallelism.architecture == "parameter-server"

    def _target(self) -> str:
        return "master" if self._on_server() else "local"


# ---------------------------------------------------------------- the catalog


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
        if bus.micro_batch == self.args.micro_batch % self.manifest.training.grad_accum_steps:
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


# faults that act inside one module (what `zoom` names): their own file, registered in the same catalog
from disttrace.run import module_faults  # noqa: E402, F401
