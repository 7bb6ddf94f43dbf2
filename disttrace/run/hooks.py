"""Named hook points: the only way observation (the recorder) and perturbation (faults) reach training.

The training loop and the strategies `emit` at these points; they never know who listens. Handlers run
in `order` (faults at 10 act before the recorder at 90 observes, so the record shows what was done).
A handler may mutate the payload in place or replace entries of it; `emit` returns the payload.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Any, NamedTuple


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
    DATA = "data"  # payload: batch (inputs, targets, sample_ids), fetch(dp_rank) for another shard
    FORWARD = "forward"  # payload: name, index, tensor (a module output)
    LOSS = "loss"  # payload: loss (micro-batch mean), tokens
    BACKWARD = "backward"  # payload: grads [TensorRef] local, accumulated, before any reduce
    REDUCE = "reduce"  # payload: grads [TensorRef] after the data-parallel reduce
    BEFORE_CLIP = "before_clip"  # payload: norm (to clip with), skip (indices not clipped)
    CLIP = "clip"  # payload: grads after clipping (if clipping), scalars [TensorRef]
    BEFORE_OPTIMIZER = "before_optimizer"  # payload: optimizer, params
    # parameter server only, on the server after its optimizer step and before it hands the parameters
    # out: params = the master [TensorRef], optimizer
    SERVER_UPDATE = "server_update"
    OPTIMIZER = "optimizer"  # payload: params [TensorRef], state [TensorRef]
    BEFORE_CHECKPOINT = "before_checkpoint"  # payload: state (the dict about to be saved)
    CHECKPOINT = "checkpoint"  # payload: path (the published checkpoint directory)
    STEP_END = "step_end"
    # payload: reason. The process ends without reaching step_end (a kill-rank fault's SIGKILL, an
    # exception): observers write what they still hold (the recorder's step awaiting its digests)
    PROCESS_EXIT = "process_exit"


POINTS = tuple(p.value for p in Point)


class HookBus:
    def __init__(self, rank: int = 0):
        self.rank = rank
        self.step = -1
        self.micro_batch = 0
        self._handlers: dict[str, list[tuple[int, Callable]]] = {p: [] for p in POINTS}

    def on(self, point: Point | str, fn: Callable[[HookBus, dict], Any], order: int = 50) -> None:
        if point not in self._handlers:
            raise KeyError(f"unknown hook point {point!r}; known: {', '.join(POINTS)}")
        self._handlers[point].append((order, fn))
        self._handlers[point].sort(key=lambda x: x[0])

    def emit(self, point: str, **payload: Any) -> dict:
        for _, fn in self._handlers[point]:
            fn(self, payload)
        return payload

    def listening(self, point: str) -> bool:
        return bool(self._handlers[point])


def process_exit(bus: HookBus, exc: BaseException) -> None:
    """`process_exit` on an exception's way out, never masking it: an observer that cannot write now (a device
    in error) loses only what it still held, and the run stays incomplete either way."""
    try:
        bus.emit("process_exit", reason=f"{type(exc).__name__}: {exc}"[:200])
    except Exception:  # noqa: BLE001 - the exception on its way out is the one to report
        pass
