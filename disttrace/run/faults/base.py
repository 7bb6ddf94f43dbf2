"""What every fault shares: the `Fault` base class (the checks of a request against a manifest or an
attached script, the installing of its `@at` handlers, the proof it fired), the registry and the
capabilities each strategy's hook points offer. The entries themselves are the package's other modules."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any, ClassVar

from disttrace.config.attached import AttachedManifest
from disttrace.config.manifest import Manifest
from disttrace.errors import BadInput
from disttrace.run.job.hooks import Point
from disttrace.store.events import FaultEvent
from disttrace.store.writers import event

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
    EP = "ep"  # expert parallel: tokens dispatched to experts' ranks by all-to-all (`dispatch`)
    CP = "cp"  # context parallel: a rank computes a slice of the sequence (`context`)


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
            from disttrace.run.job.topology import coords_of, mesh_shape

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
        # a zero-code run learns its accumulation count only when it steps, after the fault is armed
        needs_count = (
            f"'{cls.name}' needs the accumulation count, which a zero-code run does not know before its "
            "first step: name the micro-batch (--param micro_batch=K, 0 the first)"
            if getattr(m.record, "source", None) == "zero-code"
            else f"'{cls.name}' needs the accumulation count: pass "
            "config={'grad_accum_steps': N} to attach"
        )
        try:
            cls.check(step, merged, pseudo)
        except (KeyError, TypeError):
            raise BadInput(where, needs_count) from None
        args = cls.Args(**merged)
        if accum is None and (getattr(args, "micro_batch", 0) < 0 or cls.name == "late-microbatch"):
            raise BadInput(where, needs_count)
        _model_has(getattr(args, "tensor", None), names)
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
        )
        event(self.ctx.run_dir, line)


def _model_has(tensor: str | None, names: list[str]) -> None:
    """An attached script's model holds the tensor a fault names (a name, or an index as text)."""
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
    if p.ep > 1:
        return "expert-parallel (DDP + all-to-all)"
    if p.cp > 1:
        return "context-parallel (DDP + all-gather)"
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
    'tp': tensor parallel, with replicated (norm) parameters beside sharded ones;
    'ep', 'cp': expert parallel's `dispatch` point, context parallel's `context` point."""
    caps = _capabilities(manifest)
    p = manifest.parallelism
    if p.architecture != "parameter-server" and (
        p.zero_stage >= 2 or p.tp > 1 or p.pp > 1 or p.ep > 1
    ):
        caps.add("sharded_grads")
    if p.tp > 1:
        caps.add("tp")
    if p.ep > 1:
        caps.add("ep")
    if p.cp > 1:
        caps.add("cp")
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


def state_digest(*tensors) -> str:
    """xxh3-128 of the raw bytes of the tensors this rank holds (a DTensor: its shard): a fault's proof."""
    import xxhash

    from disttrace.run.record.digest import raw_bytes

    h = xxhash.xxh3_128()
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):
            t = t.to_local()
        h.update(raw_bytes(t))
    return h.hexdigest()
