"""Named hook points: the only way observation (the recorder) and perturbation (faults) reach training.

The training loop and the strategies `emit` at these points; they never know who listens. Handlers run
in `order` (faults at 10 act before the recorder at 90 observes, so the record shows what was done).
What a point hands its handlers is its payload, one class a point below (`Backward` for `backward`, ...):
a handler may change the tensors in it in place or replace its fields (a fault hands back another
batch, a scaled loss); `emit` returns the payload, so the emitter reads what the handlers left.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, NamedTuple


class TensorRef(NamedTuple):
    """One tensor at a hook point. `index` is the parameter's registration order in the plain model, the same
    on every rank and topology (the order key's last coordinate); `tensor` may be a DTensor (its shard is
    what this rank holds). A tuple, so `for index, name, tensor in grads` reads it too."""

    index: int
    name: str
    tensor: Any


def param_refs(model) -> list[TensorRef]:
    """The model's parameters as TensorRefs, indexed in registration order."""
    return [TensorRef(i, n, p) for i, (n, p) in enumerate(model.named_parameters())]


def grads_of(params: list[TensorRef], present_only: bool = False) -> list[TensorRef]:
    """The gradients of `params` (the same index and name), optionally only those that exist."""
    return [TensorRef(i, n, p.grad) for i, n, p in params if not present_only or p.grad is not None]


class Point(StrEnum):
    """The hook points, in the order a step reaches them (a str: `bus.on("backward", ...)` still reads)."""

    STEP_START = "step_start"  # process: kill-rank, slow-rank live here
    DATA = "data"
    FORWARD = "forward"
    DISPATCH = (
        "dispatch"  # expert parallel: tokens about to travel to their experts' ranks, and back
    )
    CONTEXT = (
        "context"  # context parallel: the slice of the sequence (and its labels) a rank computes
    )
    LOSS = "loss"
    BACKWARD = "backward"
    REDUCE = "reduce"
    BEFORE_CLIP = "before_clip"
    CLIP = "clip"
    BEFORE_OPTIMIZER = "before_optimizer"
    SERVER_UPDATE = "server_update"  # parameter server only
    OPTIMIZER = "optimizer"
    BEFORE_CHECKPOINT = "before_checkpoint"
    CHECKPOINT = "checkpoint"
    STEP_END = "step_end"
    PROCESS_EXIT = "process_exit"


POINTS = tuple(p.value for p in Point)


class Batch(NamedTuple):
    """One micro-batch as a rank reads it (data/windows.py's dict, typed). An attached script's data record
    holds its inputs (and the sample ids it names) only."""

    inputs: Any
    targets: Any = None
    sample_ids: Sequence[int] = ()


class Payload:
    """What a hook point hands its handlers: a dataclass per point (`point` names it)."""

    __slots__ = ()
    point: ClassVar[Point]


@dataclass(slots=True)
class StepStart(Payload):
    point = Point.STEP_START


@dataclass(slots=True)
class Data(Payload):
    """The micro-batch this rank is about to read; `fetch(dp_rank)` reads another data-parallel rank's
    (None where the job cannot: an attached script)."""

    point = Point.DATA
    batch: Batch
    fetch: Callable[[int], Batch] | None = None


@dataclass(slots=True)
class Forward(Payload):
    """A watched module's output (each block, the final norm, the logits)."""

    point = Point.FORWARD
    name: str
    index: int
    tensor: Any


@dataclass(slots=True)
class Dispatch(Payload):
    """Expert parallel, in one MoE layer's forward: `tokens` about to be sent by all-to-all, `splits[j]` rows
    of them to rank j of the expert-parallel group. `stage` "dispatch": the routed tokens, grouped by the
    rank holding their expert; "combine": this rank's experts' outputs grouped by local expert (`counts`
    rows each), before they are put back in arrival order and returned. A handler may replace `tokens`
    (same shape)."""

    point = Point.DISPATCH
    layer: str
    stage: str
    tokens: Any
    splits: list[int]
    counts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Context(Payload):
    """Context parallel: the micro-batch's whole `inputs` and `targets` and the slice [start, end) of the
    sequence this rank computes; the loss is taken over `targets[:, start:end]` (a handler may replace
    `targets`)."""

    point = Point.CONTEXT
    inputs: Any
    targets: Any
    start: int
    end: int


@dataclass(slots=True)
class Loss(Payload):
    """The micro-batch's mean loss, before it is scaled for accumulation; `tokens` it averages over."""

    point = Point.LOSS
    loss: Any
    tokens: int = 0


@dataclass(slots=True)
class Backward(Payload):
    """Local gradients, accumulated, before any data-parallel reduce (a handler may change them in place).
    `before_collective`: this is a bucket handed over right before its collective is issued (DDP's comm
    hook), else the local gradient after the micro-batch's backward."""

    point = Point.BACKWARD
    grads: list[TensorRef]
    before_collective: bool = False


@dataclass(slots=True)
class Reduce(Payload):
    """The gradients after the data-parallel reduce."""

    point = Point.REDUCE
    grads: list[TensorRef]


@dataclass(slots=True)
class BeforeClip(Payload):
    """The global gradient norm a rank is about to clip `named` with, and the indices it leaves unclipped
    (a fault may replace the norm or add to `skip`)."""

    point = Point.BEFORE_CLIP
    norm: Any
    named: list[TensorRef]
    skip: set[int] = field(default_factory=set)
    max_norm: float | None = None


@dataclass(slots=True)
class Clip(Payload):
    """The gradients after clipping (none when not clipping) and the scalars every rank must agree on
    (grad_norm, clip_coef, lr)."""

    point = Point.CLIP
    grads: list[TensorRef]
    scalars: list[TensorRef]


@dataclass(slots=True)
class BeforeOptimizer(Payload):
    point = Point.BEFORE_OPTIMIZER
    optimizer: Any
    params: list[TensorRef]


@dataclass(slots=True)
class ServerUpdate(Payload):
    """On the parameter server, after its optimizer step and before it hands the parameters out: its
    master parameters."""

    point = Point.SERVER_UPDATE
    params: list[TensorRef]
    optimizer: Any


@dataclass(slots=True)
class Optimizer(Payload):
    """The parameters after the optimizer step, and the optimizer state (recorded after them)."""

    point = Point.OPTIMIZER
    params: list[TensorRef]
    state: list[TensorRef] = field(default_factory=list)
    optimizer: Any = None


@dataclass(slots=True)
class BeforeCheckpoint(Payload):
    """The state dict about to be saved at `step` (a fault may drop entries of it)."""

    point = Point.BEFORE_CHECKPOINT
    state: dict
    step: int


@dataclass(slots=True)
class Checkpoint(Payload):
    """The published checkpoint directory of `step`."""

    point = Point.CHECKPOINT
    path: Any
    step: int


@dataclass(slots=True)
class StepEnd(Payload):
    """`spans`: a strategy's own timing of the step, if it keeps one."""

    point = Point.STEP_END
    spans: Any = None


@dataclass(slots=True)
class ProcessExit(Payload):
    """The process ends without reaching step_end (a kill-rank fault's SIGKILL, an exception): observers
    write what they still hold (the recorder's step awaiting its digests)."""

    point = Point.PROCESS_EXIT
    reason: str


PAYLOADS: dict[str, type[Payload]] = {
    c.point.value: c
    for c in (
        StepStart,
        Data,
        Forward,
        Loss,
        Backward,
        Reduce,
        BeforeClip,
        Clip,
        BeforeOptimizer,
        ServerUpdate,
        Optimizer,
        BeforeCheckpoint,
        Checkpoint,
        StepEnd,
        ProcessExit,
    )
}


class HookBus:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.step = -1
        self.micro_batch = 0
        self._handlers: dict[str, list[tuple[int, Callable]]] = {p: [] for p in POINTS}

    def on(self, point: Point | str, fn: Callable[[HookBus, Any], Any], order: int = 50) -> None:
        if point not in self._handlers:
            raise KeyError(f"unknown hook point {point!r}; known: {', '.join(POINTS)}")
        self._handlers[point].append((order, fn))
        self._handlers[point].sort(key=lambda x: x[0])

    def emit(self, payload: Payload | Point | str, **fields: Any) -> Any:
        """Hand `payload` to the point's handlers in order and return it. `emit("loss", loss=x)` is
        `emit(Loss(loss=x))` (the point's payload class built from the fields)."""
        if not isinstance(payload, Payload):
            payload = PAYLOADS[payload](**fields)
        for _, fn in self._handlers[payload.point]:
            fn(self, payload)
        return payload

    def listening(self, point: str) -> bool:
        return bool(self._handlers[point])


def process_exit(bus: HookBus, exc: BaseException) -> None:
    """`process_exit` on an exception's way out, never masking it: an observer that cannot write now (a device
    in error) loses only what it still held, and the run stays incomplete either way."""
    try:
        bus.emit(ProcessExit(reason=f"{type(exc).__name__}: {exc}"[:200]))
    except Exception:  # noqa: BLE001 - the exception on its way out is the one to report
        pass
