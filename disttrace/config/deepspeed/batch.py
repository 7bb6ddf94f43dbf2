"""DeepSpeed's batch rules in DeepSpeed's words: the identity train_batch_size = micro batch x
accumulation x data-parallel size, each value resolved from the other two as DeepSpeed resolves it."""

from __future__ import annotations

from typing import Any

TRAIN_BATCH = "train_batch_size"


MICRO_BATCH = "train_micro_batch_size_per_gpu"


GRAD_ACC = "gradient_accumulation_steps"


class BatchAssertion(ValueError):
    """DeepSpeed's batch assertion failed; `field` is the DeepSpeed key it is about."""

    def __init__(self, message: str, field: str):
        self.field = field
        super().__init__(message)


def identity_message(train_batch: Any, micro_batch: Any, grad_acc: Any, world_size: Any) -> str:
    # verbatim from DeepSpeedConfig._batch_assertion
    return (
        "Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
        f"gradient_acc_step * world_size {train_batch} != {micro_batch} * {grad_acc} * {world_size}"
    )


def _positive(train_batch: int, micro_batch: int, grad_acc: int) -> None:
    # the three `> 0` assertions of DeepSpeedConfig._batch_assertion, in its order, in its words
    if not train_batch > 0:
        raise BatchAssertion(
            f"Train batch size: {train_batch} has to be greater than 0", TRAIN_BATCH
        )
    if not micro_batch > 0:
        raise BatchAssertion(
            f"Micro batch size per gpu: {micro_batch} has to be greater than 0", MICRO_BATCH
        )
    if not grad_acc > 0:
        raise BatchAssertion(
            f"Gradient accumulation steps: {grad_acc} has to be greater than 0", GRAD_ACC
        )


def resolve_batch(
    train_batch: int | None, micro_batch: int | None, grad_acc: int | None, world_size: int
) -> tuple[int, int, int, list[str]]:
    """DeepSpeed's `_set_batch_related_parameters` then `_batch_assertion`: fill in what is missing by
    DeepSpeed's rules (floor division, as DeepSpeed does), then assert. Returns (train, micro, accum, notes),
    a note per inferred value; raises BatchAssertion with DeepSpeed's message.

    Where DeepSpeed itself would divide by zero (a stated 0 it divides by) the `> 0` assertion for that
    value is raised instead of a ZeroDivisionError."""
    notes: list[str] = []
    w = world_size
    if train_batch is not None and micro_batch is not None and grad_acc is not None:
        pass
    elif train_batch is not None and micro_batch is not None:
        if micro_batch == 0:
            _positive(train_batch, micro_batch, 1)
        grad_acc = train_batch // micro_batch // w
        notes.append(
            f"{GRAD_ACC}: not given; DeepSpeed infers {grad_acc} = {TRAIN_BATCH} {train_batch} // "
            f"{MICRO_BATCH} {micro_batch} // world_size {w}"
        )
    elif train_batch is not None and grad_acc is not None:
        if grad_acc == 0:
            _positive(train_batch, 1, grad_acc)
        micro_batch = train_batch // w // grad_acc
        notes.append(
            f"{MICRO_BATCH}: not given; DeepSpeed infers {micro_batch} = {TRAIN_BATCH} {train_batch} // "
            f"world_size {w} // {GRAD_ACC} {grad_acc}"
        )
    elif micro_batch is not None and grad_acc is not None:
        train_batch = micro_batch * grad_acc * w
        notes.append(
            f"{TRAIN_BATCH}: not given; DeepSpeed infers {train_batch} = {MICRO_BATCH} {micro_batch} * "
            f"{GRAD_ACC} {grad_acc} * world_size {w}"
        )
    elif train_batch is not None:
        grad_acc = 1
        micro_batch = train_batch // w
        notes.append(
            f"{GRAD_ACC}, {MICRO_BATCH}: not given; DeepSpeed infers {GRAD_ACC} 1 and {MICRO_BATCH} "
            f"{micro_batch} = {TRAIN_BATCH} {train_batch} // world_size {w}"
        )
    elif micro_batch is not None:
        train_batch = micro_batch * w
        grad_acc = 1
        notes.append(
            f"{TRAIN_BATCH}, {GRAD_ACC}: not given; DeepSpeed infers {GRAD_ACC} 1 and {TRAIN_BATCH} "
            f"{train_batch} = {MICRO_BATCH} {micro_batch} * world_size {w}"
        )
    else:
        # verbatim from DeepSpeedConfig._set_batch_related_parameters
        raise BatchAssertion(
            "Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
            TRAIN_BATCH,
        )
    _positive(train_batch, micro_batch, grad_acc)
    if train_batch != micro_batch * grad_acc * w:
        raise BatchAssertion(identity_message(train_batch, micro_batch, grad_acc, w), TRAIN_BATCH)
    return train_batch, micro_batch, grad_acc, notes
