"""The hook points an attached run installs in torch: the model's forward (pre-hook and block outputs),
each parameter's gradient (or DDP's comm hook), torch.nn.utils' clipping and the optimizer's step. Each
emits on the run's bus what the harness's loop emits at the same point."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from disttrace.run.attach.loader import first_tensor
from disttrace.run.job.hooks import (
    Backward,
    Batch,
    BeforeOptimizer,
    Clip,
    Data,
    Forward,
    Optimizer,
    Reduce,
)
from disttrace.run.parallel.common import SCALAR_INDEX, optimizer_state_list
from disttrace.store.events import AttachNote
from disttrace.store.writers import event

if TYPE_CHECKING:
    from disttrace.run.attach.run import AttachedRun


_ACTIVE: list[AttachedRun] = []  # the run that torch.nn.utils' clipping reports to
_ORIGINAL_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
# torch >= 2.6 splits clip_grad_norm_ in two public halves (what torchtitan's clipping calls); clip_grad_norm_
# calls the module's private names, so patching the public ones never records a clip twice
_ORIGINAL_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)
_ORIGINAL_WITH_NORM = getattr(torch.nn.utils, "clip_grads_with_norm_", None)


def _clip_grad_norm_(parameters, max_norm, *args, **kwargs):
    if not _ACTIVE:
        return _ORIGINAL_CLIP(parameters, max_norm, *args, **kwargs)
    return _ACTIVE[-1]._clip(parameters, max_norm, *args, **kwargs)


def _get_total_norm(tensors, *args, **kwargs):
    """The gradients are final when their norm is taken: the step's reduce is recorded first."""
    if _ACTIVE:
        _ACTIVE[-1]._flush_reduce()
    return _ORIGINAL_TOTAL_NORM(tensors, *args, **kwargs)


def _clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
    if not _ACTIVE:
        return _ORIGINAL_WITH_NORM(parameters, max_norm, total_norm, *args, **kwargs)
    return _ACTIVE[-1]._clip_with_norm(parameters, max_norm, total_norm, *args, **kwargs)


def active_runs() -> list[AttachedRun]:
    """The attached runs of this process still open (the last one gets torch.nn.utils' clipping)."""
    return list(_ACTIVE)


def patch_clip(on: bool) -> None:
    fn = _clip_grad_norm_ if on else _ORIGINAL_CLIP
    torch.nn.utils.clip_grad_norm_ = fn
    torch.nn.utils.clip_grad.clip_grad_norm_ = fn
    if _ORIGINAL_TOTAL_NORM is not None and _ORIGINAL_WITH_NORM is not None:
        torch.nn.utils.get_total_norm = _get_total_norm if on else _ORIGINAL_TOTAL_NORM
        torch.nn.utils.clip_grads_with_norm_ = _clip_grads_with_norm_ if on else _ORIGINAL_WITH_NORM


class _CommHookState:
    """What DDP's comm hook holds. DDP keeps the hook and its state in C++ (its reducer), where Python's
    collector cannot see them: a hook that held the run would tie DDP -> reducer -> hook -> run -> DDP into a
    cycle no collection frees, keeping the model, the reducer and the process group (gloo's threads) alive
    until the process exits. So the run is held by weak reference, and a closed run's hook is DDP's plain
    all-reduce."""

    def __init__(self, run: AttachedRun, names: dict, group, size: int):
        self.run, self.names, self.group, self.size = weakref.ref(run), names, group, size


def _allreduce_with_hook(state: _CommHookState, bucket):
    """`backward` at DDP's comm hook: each bucket's local gradients right before its all-reduce (numerically
    DDP's default: divide by the group size, then sum)."""
    import torch.distributed as dist

    run = state.run()
    if run is not None and not run._closed:
        run._comm_fired = True
        grads = [(*state.names[id(p)], g) for p, g in zip(bucket.parameters(), bucket.gradients())]
        run.bus.emit(Backward(grads=grads, before_collective=True))
    buf = bucket.buffer()
    buf.div_(state.size)
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()
    return fut.then(_first_value)


def _first_value(fut):
    return fut.value()[0]


class HookPoints:
    """AttachedRun's hook points (a mixin: the state they move is steps.StepCycle's)."""

    def _install_backward_points(self) -> bool:
        """`backward`: under DDP, a comm hook sees each bucket's local gradient right before its all-reduce
        (numerically DDP's default: divide by the group size, then sum). Every backward pass that does not
        reach the comm hook (no_sync micro-batches, no DDP, a forward that bypassed DDP) reports the local
        accumulated gradients when autograd finishes it."""
        comm = False
        names = {id(p): (i, n) for i, n, p in self.named}
        if self.engine.kind == "DDP":
            ddp = self.engine.ddp
            state = _CommHookState(self, names, ddp.process_group, len(self.engine.group_ranks))
            try:
                ddp.register_comm_hook(state, _allreduce_with_hook)
                comm = True
            except RuntimeError as e:  # the script registered its own, or training already started
                if self.rank == 0:
                    event(self.run_dir, AttachNote(note=f"no DDP comm hook: {e}"[:500]))
        if self.engine.kind != "FSDP2":
            for _, _, p in self.named:
                if p.requires_grad:
                    self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        return comm

    def _on_forward(self, module, args, kwargs):
        if self._paused or not (module.training and torch.is_grad_enabled()):
            return None  # evaluation, not a micro-batch
        if torch._C._current_graph_task_id() != -1:
            return None  # recomputed inside backward (activation checkpointing)
        self._finish_step()
        mb = self._forwards
        self._forwards += 1
        self.bus.micro_batch = mb
        watched = self._take_batch(args, kwargs)
        if mb not in self._data_mb:
            inputs, ids = watched if watched is not None else (first_tensor(args, kwargs), [])
            self._count(inputs)
            if inputs is not None:
                self._data_mb.add(mb)
                self.bus.emit(Data(Batch(inputs.detach(), sample_ids=ids)))
        return None

    def _block_output_hook(self, index: int, name: str):
        """`forward`: a block's output (its first tensor) on a training micro-batch, as the harness records
        each layer's; evaluation and activation-checkpointing recomputation are not micro-batches."""

        def hook(module, _args, out):
            if self._paused or not (module.training and torch.is_grad_enabled()):
                return None
            if torch._C._current_graph_task_id() != -1:
                return None
            t = first_tensor((out,), {})
            if t is not None:
                self.bus.emit(Forward(name=name, index=index, tensor=t.detach()))
            return None

        return hook

    def _on_grad(self, _param):
        if not self._bw_queued and not self._paused:
            self._bw_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self):
        self._bw_queued = False
        if self._comm_fired:  # DDP's comm hook has reported this pass, bucket by bucket
            self._comm_fired = False
            return
        self.bus.micro_batch = max(self._forwards - 1, 0)
        self.bus.emit(
            Backward(grads=[(i, n, p.grad) for i, n, p in self.named if p.grad is not None])
        )

    def _flush_reduce(self):
        """`reduce`: the gradients as the step begins (after DDP's all-reduce, or the script's own)."""
        if self._reduced:
            return
        self._reduced = True
        self.bus.micro_batch = max(self._forwards - 1, 0)
        grads = [(i, n, p.grad) for i, n, p in self.named if p.grad is not None]
        if grads:
            self.bus.emit(Reduce(grads=grads))

    def _clip(self, parameters, max_norm, *args, **kwargs):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        self._flush_reduce()
        total = _ORIGINAL_CLIP(parameters, max_norm, *args, **kwargs)
        self._record_clip(total, max_norm)
        return total

    def _clip_with_norm(self, parameters, max_norm, total_norm, *args, **kwargs):
        """torch.nn.utils.clip_grads_with_norm_: the clip by a norm the script took itself (through
        get_total_norm, or any way it likes: a local shard's norm is recorded as what it is)."""
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        self._flush_reduce()
        out = _ORIGINAL_WITH_NORM(parameters, max_norm, total_norm, *args, **kwargs)
        self._record_clip(total_norm, max_norm)
        return out

    def _record_clip(self, total, max_norm) -> None:
        """`clip`: the clipped gradients and the scalars every rank must agree on (the first clip of a step
        is the step's)."""
        if self._clipped:
            return
        self._clipped = True
        norm = total.full_tensor() if hasattr(total, "full_tensor") else total
        norm = (
            norm.detach()
            if torch.is_tensor(norm)
            else torch.tensor(float(norm), dtype=torch.float64)
        )
        coef = torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)  # torch's own formula
        scalars = [(SCALAR_INDEX, "grad_norm", norm), (SCALAR_INDEX + 1, "clip_coef", coef)]
        if self.optimizer.param_groups:
            scalars.append((SCALAR_INDEX + 2, "lr", _lr(self.optimizer.param_groups[0])))
        self.bus.emit(
            Clip(
                grads=[(i, n, p.grad) for i, n, p in self.named if p.grad is not None],
                scalars=scalars,
            )
        )

    def _before_step(self, _opt, args, kwargs):
        if self._paused:
            return None
        closure = kwargs.get("closure", args[0] if args else None)
        if callable(
            closure
        ):  # step(closure) (Lightning): the last micro-batch runs inside it, so reduce after it

            def closure_then_reduce():
                loss = closure()
                self._flush_reduce()
                self.bus.emit(BeforeOptimizer(optimizer=self.optimizer, params=self.named))
                return loss

            if "closure" in kwargs:
                return args, {**kwargs, "closure": closure_then_reduce}
            return (closure_then_reduce, *args[1:]), kwargs
        self._flush_reduce()
        self.bus.emit(BeforeOptimizer(optimizer=self.optimizer, params=self.named))
        return None

    def _after_step(self, _opt, _args, _kwargs):
        if self._paused:
            return
        state = optimizer_state_list(self.optimizer, self.named)
        base = len(
            self.named
        )  # the recorder puts state at base + index: lrs after every state tensor
        # group 0's lr once a step: in a step that clipped it is `clip`'s lr (where the harness and the
        # DeepSpeed integration record it, so a diff against them pairs it), else here
        lrs = [
            (SCALAR_INDEX * 4 + g - base, f"param_groups.{g}.lr", _lr(group))
            for g, group in enumerate(self.optimizer.param_groups)
            if g > 0 or not self._clipped
        ]
        self.bus.emit(Optimizer(params=self.named, state=state + lrs, optimizer=self.optimizer))
        self._stepped = True
        self.completed = self.step
        if self._observed is None:
            self._observed = {
                "step": self.step,
                "samples": self._samples if self._forwards else None,
                "tokens": self._tokens if self._forwards else None,
                "micro_batches": self._forwards,
            }


def _lr(group: dict) -> torch.Tensor:
    lr = group.get("lr", 0.0)
    return (
        lr.detach().to(torch.float64)
        if torch.is_tensor(lr)
        else torch.tensor(float(lr), dtype=torch.float64)
    )
