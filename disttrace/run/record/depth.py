"""Depth recording: one step (`record.depth.step`) recorded inside its forward and backward (docs/zoom.md).

At `module` depth every module of the plain model gives a record when its forward returns (its output, as
its caller receives it: after the module's own hooks, a tensor-parallel style's redistribution included) and
one when the gradient with respect to that output arrives in backward, each with its module path, in
execution order. At `op` depth a dispatch mode (as `record.collectives = "values"` uses, run/record/collectives.py)
adds every aten op's output inside the model's forward (labelled by the innermost module running it) and
inside backward (labelled by the module whose output gradient arrived last, "" before the first), each with
its index among that module call's ops.

Records are placed in the step's logical tensor, so runs of different layouts compare: the batch dimension
over the step's micro-batches and data-parallel ranks (data/windows.py hands micro-batch `mb` of dp rank `r`
the samples at `(mb * dp + r) * micro_batch_size` of the step), a DTensor's shard over its mesh as the
trajectory's records carry it (run/record/recorder.py's `shard_info`). A tensor-parallel style hands its caller a
local tensor (`use_local_output`): the placement is read from the DTensor the module itself returned, before
the style's hooks converted it. An output gradient is that of this rank's mean loss; `weight` = 1 / dp makes
it the gradient of the step's mean loss, whatever the split.

Hooks are installed at the step's start and removed at its end: every other step runs exactly as without
depth recording, and with `record.depth` unset nothing here is even built (run/job/worker.py). The records are
written at the step's end to `depth/rank-NNNNN.jsonl` (one `store.documents.DepthRecord` a line), sealed with
the rank's other files.

An attached script (run/attach/) is recorded by the same recorder, on its own bus, when its run.json asks
for it (`depth`, written by `disttrace replay RUN --step S --depth LEVEL -- CMD`: `attached_spec`). There the
micro-batch size is what the step's first micro-batch holds (`saw_batch`) and the global batch the replayed
run counted, and a script that resumes renumbers its steps (`renumbered`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from disttrace.run.record.digest import digest_tensor
from disttrace.run.record.recorder import shard_info, tensor_leaves
from disttrace.store.documents import DepthRecord
from disttrace.store.rundir import rank_file
from disttrace.store.writers import JsonlWriter

KIND = "depth"
LEVELS = ("module", "op")


@dataclass(frozen=True)
class DepthRequest:
    """One step of an attached run recorded at depth, and this rank's place in the data-parallel layout
    the records are placed by."""

    step: int
    level: str
    global_batch: int | None
    dp: int
    dp_rank: int


def attached_spec(info: dict, where) -> dict | None:
    """An attached run's depth request, from its run.json's `depth` ({step, level, global_batch}), checked:
    None when there is none; BadInput naming the field when it is not one."""
    from disttrace.errors import BadInput

    spec = info.get("depth")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise BadInput(where, "must be a table {step, level}", field="depth")
    step, level, batch = spec.get("step"), spec.get("level"), spec.get("global_batch")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise BadInput(where, f"{step!r} is not a step (an integer from 1)", field="depth.step")
    if level not in LEVELS:
        raise BadInput(where, f"{level!r} is not one of {', '.join(LEVELS)}", field="depth.level")
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise BadInput(where, f"{batch!r} is not a batch size", field="depth.global_batch")
    return {"step": step, "level": level, "global_batch": batch}


def _tensors(x):
    return (t for _, t in tensor_leaves(x))


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


class ModuleScope:
    """Which module call the current op runs in. Forward: the innermost module whose forward is running
    (forward pre-hook pushes, forward hook pops). Backward: the module whose output gradient arrived last (a
    module's backward ops follow the arrival of its output's gradient). Shared by the depth recorder and the
    faults that act inside one module (run/faults/modules.py)."""

    def __init__(self):
        self.stack: list[tuple[str, int]] = []
        self.cursor: tuple[str, int] | None = None  # backward
        self.calls: dict[tuple[int, str], int] = {}

    def enter(self, micro_batch: int, path: str) -> int:
        if not self.stack:
            self.cursor = None  # a new forward: the next backward starts outside every module
        key = (micro_batch, path)
        call = self.calls.get(key, -1) + 1
        self.calls[key] = call
        self.stack.append((path, call))
        return call

    def leave(self) -> tuple[str, int]:
        return self.stack.pop() if self.stack else ("", 0)

    def current(self) -> tuple[str, str, int]:
        """(direction, module path, call) of an op running now ("" : outside every module)."""
        if _in_backward():
            path, call = self.cursor or ("", 0)
            return "backward", path, call
        path, call = self.stack[-1] if self.stack else ("", 0)
        return "forward", path, call


class _OpTracer(TorchDispatchMode):
    """Every aten op's outputs, recorded by the depth recorder (the digests themselves run outside every
    dispatch mode, so no other mode, the collective tracer included, sees them)."""

    # a higher-order operator (flex attention) runs whole, its output recorded as one op's
    supports_higher_order_operators = True

    def __init__(self, recorder: DepthRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) == "aten":
            self.recorder.op(str(func.overloadpacket), out)
        return out


class DepthRecorder:
    ORDER = 90  # after the faults (10): the records show what a fault did

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        model,
        step: int,
        level: str,
        *,
        dp: int,
        dp_rank: int,
        micro_batch_size: int | None,
        global_batch: int | None,
    ):
        self.rank, self.model, self.step, self.ops = rank, model, step, level == "op"
        self.path = Path(run_dir) / rank_file(KIND, rank)
        self.dp, self.dp_rank, self.mbs, self.global_batch = (
            dp,
            dp_rank,
            micro_batch_size,
            global_batch,
        )
        self.grad_weight = 1.0 / dp
        self.bus = None
        self.records: list[dict] = []
        self._handles: list = []
        self._mode: _OpTracer | None = None
        self._scope = ModuleScope()
        self._raw: dict[
            str, tuple
        ] = {}  # module path -> the DTensor placement its forward returned
        self._seq: dict[tuple[int, str], int] = {}
        self._op_index: dict[tuple, int] = {}
        self._written = False
        self._outputs: dict[
            int, weakref.ref
        ] = {}  # the step's module outputs (by id, checked by reference)

    def attach(self, bus) -> DepthRecorder:
        self.bus = bus
        bus.on("step_start", self._start, self.ORDER)
        bus.on("step_end", self._end, self.ORDER)
        bus.on("process_exit", lambda b, p: self._end(b, p), self.ORDER)
        return self

    # ---------------------------------------------------------- installing, removing
    def _start(self, bus, p) -> None:
        if bus.step != self.step:
            return
        for path, module in self.model.named_modules():
            if not path:  # the model itself: its output is its last module's
                continue
            self._handles += [
                module.register_forward_pre_hook(functools.partial(self._pre, path)),
                module.register_forward_hook(functools.partial(self._placed, path), prepend=True),
                module.register_forward_hook(functools.partial(self._post, path)),
            ]
        if self.ops:
            self._mode = _OpTracer(self)
            self._mode.__enter__()

    def _remove(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for h in self._handles:
            h.remove()
        self._handles = []

    def _end(self, bus, p) -> None:
        if bus.step != self.step or self._written:
            return
        self._remove()
        self._written = True
        out = JsonlWriter(self.path)
        for rec in self.records:
            out.write(DepthRecord(**rec).line())
        out.close()
        self.records = []

    def close(self) -> None:
        """Nothing to do: the records were written at the step's end."""

    # ---------------------------------------------------------- an attached script's step
    def renumbered(self, bus) -> None:
        """The script resumed: its step is now `bus.step`, without a step_start. Hooks installed for the step
        it was in are removed unwritten (that step never ran); the new step's are installed if it is ours."""
        if self._written:
            return
        if self._handles or self._mode is not None:
            self._remove()
            self.records, self._seq, self._op_index = [], {}, {}
            self._scope = ModuleScope()
        self._start(bus, None)

    def saw_batch(self, inputs) -> None:
        """An attached script's micro-batch about to run: the first of our step gives the micro-batch size
        (the batch is placed in the step's logical batch when the global batch is known too)."""
        if self.mbs is None and self.bus is not None and self.bus.step == self.step:
            if isinstance(inputs, torch.Tensor) and inputs.dim() >= 1:
                self.mbs = int(inputs.shape[0])

    # ---------------------------------------------------------- module hooks
    def _pre(self, path, module, args):
        if (
            not torch.is_grad_enabled()
        ):  # an attached script's evaluation inside the step: no micro-batch
            return
        self._scope.enter(self.bus.micro_batch, path)

    def _placed(self, path, module, args, out):
        """The placement of the DTensor the module itself returned (before a parallel style's hook turns it
        into a local tensor for the caller)."""
        t = next(_tensors(out), None)
        if t is not None and hasattr(t, "placements"):
            self._raw[path] = (
                tuple(t.shape),
                t.device_mesh,
                tuple(t.placements),
                t.to_local().shape,
            )
        else:
            self._raw.pop(path, None)

    def _post(self, path, module, args, out):
        if not torch.is_grad_enabled():
            return
        _, call = self._scope.leave()
        mb = self.bus.micro_batch
        for i, t in enumerate(_tensors(out)):
            if not t.is_floating_point():
                continue
            shard = self._shard(path, t, i, mb)
            self._add(mb, "forward", "module", path, call, t, i, shard)
            if t.requires_grad:
                # a module that returns its last child's output (FeedForward returns w2's) shares that
                # tensor: its gradient's arrival leaves the backward cursor on the innermost module
                ref = self._outputs.get(id(t))
                inner = ref is not None and ref() is t
                self._outputs[id(t)] = weakref.ref(t)
                t.register_hook(functools.partial(self._grad, mb, path, call, i, shard, inner))

    def _grad(self, mb, path, call, i, shard, inner, g):
        if not inner:
            self._scope.cursor = (path, call)
        self._add(mb, "backward", "module", path, call, g, i, shard, weight=self.grad_weight)

    # ---------------------------------------------------------- ops
    def op(self, name: str, out) -> None:
        direction, path, call = self._scope.current()
        if direction == "forward" and not self._scope.stack:
            # outside the model's forward and backward: the data's slicing, the loss, and after the last
            # backward the reduce, the clip and the optimizer (the trajectory records those)
            return
        mb = self.bus.micro_batch
        for i, t in enumerate(_tensors(out)):
            key = (mb, direction, path, call)
            index = self._op_index.get(key, 0)
            self._op_index[key] = index + 1
            shard = self._shard(None, t, i, mb) if t.is_floating_point() else {}
            w = self.grad_weight if direction == "backward" else 1.0
            self._add(
                mb, direction, "op", path, call, t, i, shard, op=name, op_index=index, weight=w
            )

    # ---------------------------------------------------------- records
    def _shard(self, path, t, i, mb) -> dict:
        """Where `t` sits in the step's logical tensor: {"offset", "logical_shape"}, or {} when it is not
        placed (not batch-first)."""
        with _disable_current_modes():
            s = (shard_info(t).get("shard") or {}) if hasattr(t, "placements") else {}
            raw = self._raw.get(path) if path is not None and i == 0 else None
            if not s and raw is not None and tuple(t.shape) == tuple(raw[3]):
                shape, mesh, placements, _ = raw
                if not any(pl.is_partial() for pl in placements):
                    from disttrace.run.record.recorder import _shard_info

                    s = _shard_info(shape, mesh, placements)["shard"]
        offset = list(s.get("offset") or [0] * t.dim())
        logical = list(s.get("logical_shape") or t.shape)
        if t.dim() and logical and self.global_batch and logical[0] == self.mbs:
            offset[0] += (mb * self.dp + self.dp_rank) * self.mbs
            logical[0] = self.global_batch
        elif not s:
            return {}
        return {"offset": offset, "logical_shape": logical}

    def _add(
        self, mb, direction, kind, path, call, t, output, shard, op=None, op_index=None, weight=1.0
    ):
        key = (mb, direction)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        with _disable_current_modes():
            local = t.to_local() if hasattr(t, "to_local") else t
            d = digest_tensor(local, shard.get("offset"), shard.get("logical_shape"))
        self.records.append(
            {
                "step": self.step,
                "micro_batch": mb,
                "rank": self.rank,
                "direction": direction,
                "kind": kind,
                "seq": seq,
                "module": path,
                "call": call,
                "op": op,
                "op_index": op_index,
                "output": output,
                **d,
                "shard": shard or None,
                "weight": weight,
            }
        )
