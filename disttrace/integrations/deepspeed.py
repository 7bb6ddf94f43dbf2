"""disttrace for a DeepSpeed engine (install with `pip install disttrace[deepspeed]`): the same call as for a
torch model, on what `deepspeed.initialize` returned.

    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    run = disttrace.api.attach(engine, optimizer, config={"grad_accum_steps": 2, "micro_batch_size": 4})
    for step ...:
        for micro_batch ...:
            loss = run.loss(loss_fn(engine(x), y))   # optional: the loss record
            engine.backward(loss)
            engine.step()                            # DeepSpeed steps at its accumulation boundary
    run.close()

Phases, with the meaning they have elsewhere, read where DeepSpeed keeps them (ZeRO stages 0 to 3):

- `backward`: this micro-batch's local gradient as autograd hands it to DeepSpeed (a hook on each
  parameter, before DeepSpeed accumulates, reduces or partitions it); the loss already carries DeepSpeed's
  1/accumulation scaling. It is the same quantity at every stage (stage 0 would otherwise show the
  accumulated `.grad`, stage 2 nothing: it frees each micro-batch's gradient once reduced).
- `reduce`: the reduced, averaged gradient at the accumulation boundary, before clipping: the whole
  gradient under stage 0; under ZeRO 1-3 the partition this rank owns, as shards of each logical tensor.
- `clip`: DeepSpeed's global gradient norm (`grad_norm`), the coefficient it scales by (`clip_coef`,
  min(1, clip / (norm + 1e-6)), DeepSpeed's formula at every stage) and the learning rate.
- `optimizer`: after DeepSpeed's step, the fp32 master parameters and the optimizer state (exp_avg, ...)
  this rank holds: whole under stage 0, else its partition, each piece a shard with its offset in the
  logical tensor so diff combines them as it combines FSDP2's.

DeepSpeed partitions the flattened parameters, so a rank's piece of a tensor is a range of its flattened
elements; it is recorded as the few boxes that range is made of (a partial row, whole rows, a partial row)
with their offsets. ZeRO-3 parameters are recorded by their logical names and shapes (`ds_shape`), and the
manifest counts `ds_numel`, not the empty placeholders the module holds.

The replica map comes from DeepSpeed's data-parallel group: data differs there, the clip scalars agree, and
under stage 0 (every rank holds everything) reduced gradients, parameters and optimizer state agree.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

from disttrace.errors import BadInput
from disttrace.run.attach import AttachedRun, Engine, _dist
from disttrace.run.parallel.common import SCALAR_INDEX, SCALARS_AGREE
from disttrace.store.records import Event
from disttrace.store.rundir import event

KIND = "DeepSpeed"
# the faults whose hook point an attached DeepSpeed engine offers (the rest are refused, exit 2)
FAULTS = frozenset({"bitflip-grad", "bitflip-param", "grad-scale", "lr-skew", "kill-rank"})
SHARD_ATTR = (
    "_disttrace_shard"  # recorder.shard_info reads a piece's place in its logical tensor here
)
BOXES = (
    16  # index stride per piece of one tensor (a range of an n-d tensor is at most 2n - 1 boxes)
)


def is_engine(model) -> bool:
    """A DeepSpeedEngine (deepspeed imported by the script: never imported here for a plain model)."""
    ds = sys.modules.get("deepspeed.runtime.engine")
    return ds is not None and isinstance(model, ds.DeepSpeedEngine)


def detect(engine) -> Engine:
    dist = _dist()
    group = getattr(engine, "seq_data_parallel_group", None) or engine.data_parallel_group
    ranks = dist.get_process_group_ranks(group) if dist else [0]
    return Engine(
        KIND, engine.module, engine, sorted(ranks), zero_stage=engine.zero_optimization_stage()
    )


def logical_shape(p) -> list[int]:
    """A parameter's shape as the model defines it (ZeRO-3 leaves an empty placeholder in the module)."""
    return list(p.ds_shape) if hasattr(p, "ds_shape") else list(p.shape)


def replicas(views: list[dict]) -> dict:
    """replicas.json from DeepSpeed's data-parallel group (each rank's `ddp_group` in its view)."""
    world = len(views)
    dp = [list(g) for g in sorted({tuple(v["ddp_group"]) for v in views})]
    stage = views[0].get("zero_stage", 0)
    rules = [{"phase": "data", "dim": "dp", "relation": "differ"}, {**SCALARS_AGREE, "dim": "dp"}]
    if stage == 0:
        rules += [
            {"phase": "reduce", "dim": "dp", "relation": "agree"},
            {"phase": "optimizer", "dim": "dp", "relation": "agree"},
        ]
        note = "reduced gradients, clip scalars, parameters and optimizer state agree"
    else:
        rules.append(
            {
                "phase": "optimizer",
                "dim": "dp",
                "relation": "agree",
                "tensors": ["param_groups.*.lr"],
            }
        )
        note = (
            f"ZeRO-{stage} partitions gradients"
            + (", parameters" if stage == 3 else "")
            + " and optimizer state there: only the clip scalars and learning rates agree"
        )
    return {
        "groups": {"world": [list(range(world))], "dp": dp},
        "rules": rules,
        "inferred": {"engine": KIND, "notes": [f"DeepSpeed data parallel over {dp}: {note}"]},
    }


def check_fault(name: str, stage: int) -> None:
    if name not in FAULTS:
        raise BadInput(
            "--fault",
            f"'{name}' needs a hook point an attached DeepSpeed engine (ZeRO-{stage}) does not "
            f"offer; it offers: {', '.join(sorted(FAULTS))}",
        )


# ---------------------------------------------------------------- a flat range as boxes


def flat_boxes(lo: int, hi: int, shape: list[int]) -> list[tuple[list[int], list[int], int]]:
    """The elements [lo, hi) of a C-contiguous tensor of `shape`, flattened, as boxes (offset, box shape,
    flat position of the box's first element), in order: each box is contiguous in the flattened tensor."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [([lo], [hi - lo], lo)] if shape else [([], [], 0)]
    inner = math.prod(shape[1:])

    def row(r: int, a: int, b: int):
        return [([r, *o], [1, *s], r * inner + f) for o, s, f in flat_boxes(a, b, shape[1:])]

    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi % inner):
        return row(first, lo - first * inner, hi - first * inner)
    out, a, b = [], first, last + 1
    if lo % inner:
        out += row(first, lo % inner, inner)
        a = first + 1
    if hi % inner:
        b = last
    if b > a:
        out.append(([a] + [0] * (len(shape) - 1), [b - a, *shape[1:]], a * inner))
    if hi % inner:
        out += row(last, 0, hi % inner)
    return out


def pieces(index: int, n: int, name: str, frag, start: int, shape: list[int]) -> list[tuple]:
    """(record index, name, box tensor) for the flat fragment `frag` of a tensor of logical `shape`, which
    holds its flattened elements [start, start + frag.numel()): each box a view, marked with its offset."""
    numel = math.prod(shape)
    frag = frag.detach().reshape(-1)
    count = max(0, min(frag.numel(), numel - start))  # ZeRO-3 pads the last rank's partition
    if count == 0:
        return []
    if start == 0 and count == numel:  # the whole tensor
        return [(index, name, frag[:numel].view(shape))]
    out = []
    for b, (offset, box, flat) in enumerate(flat_boxes(start, start + count, shape)):
        if b >= BOXES:
            raise RuntimeError(f"{name}: more than {BOXES} boxes for one range")
        t = frag[flat - start : flat - start + math.prod(box)].view(box)
        setattr(t, SHARD_ATTR, {"shard": {"offset": offset, "logical_shape": list(shape)}})
        out.append((b * n + index, name, t))
    return out


def _copies(entries: list[tuple]) -> list[tuple]:
    """(index, name, a copy of the piece, keeping its place in the logical tensor)."""
    out = []
    for index, name, t in entries:
        c = t.detach().clone()
        if hasattr(t, SHARD_ATTR):
            setattr(c, SHARD_ATTR, getattr(t, SHARD_ATTR))
        out.append((index, name, c))
    return out


# ---------------------------------------------------------------- where DeepSpeed keeps each rank's piece


class _Partitions:
    """This rank's pieces of each parameter's gradient, fp32 master and optimizer state, by ZeRO stage."""

    def __init__(self, engine, named):
        self.engine, self.named, self.stage = engine, named, engine.zero_optimization_stage()
        self.zo = engine.optimizer
        self.base = getattr(self.zo, "optimizer", self.zo) if self.stage else self.zo

    def _fragment(self, p, what: str):
        """(flat fragment, its start in the flattened parameter) or None; what: grad | param | a state key."""
        if self.stage == 0:
            if what == "grad":
                return (p.grad, 0) if p.grad is not None else None
            if what == "param":
                return p, 0
            st = self.base.state.get(p, {}).get(what)
            return (st, 0) if st is not None else None
        if self.stage in (1, 2):
            hp = getattr(p, "_hp_mapping", None)
            if hp is None:
                return None
            start = hp.lp_fragment_address.start
            if what == "grad":
                try:
                    return hp.get_lp_grad_fragment(p._index_in_param_group), start
                except (ValueError, KeyError, IndexError):
                    return None
            if what == "param":
                return hp.hp_fragment, start
            flat = self.zo.single_partition_of_fp32_groups[hp.param_group_index]
            st = self.base.state.get(flat, {}).get(what)
            if st is None:
                return None
            a = hp.hp_fragment_address
            return st.narrow(0, a.start, a.numel), start
        # stage 3: the partition of each parameter (padded on the last rank), at partition rank * size
        from deepspeed.utils import (
            safe_get_local_fp32_param,
            safe_get_local_grad,
            safe_get_local_optimizer_state,
        )

        dist = _dist()
        part = dist.get_rank(group=p.ds_process_group) if dist else 0
        start = part * p.ds_tensor.ds_numel
        if what == "grad":
            t = safe_get_local_grad(p)
        elif what == "param":
            t = safe_get_local_fp32_param(p)
        else:
            try:
                t = safe_get_local_optimizer_state(p, what)
            except KeyError:
                return None
        return (t, start) if t is not None else None

    def state_keys(self) -> list[str]:
        """The optimizer's per-element state (Adam's exp_avg, exp_avg_sq; no step counter)."""
        keys = set()
        for st in self.base.state.values():
            keys |= {k for k, v in st.items() if torch.is_tensor(v) and v.numel() > 1}
        return sorted(keys)

    def collect(self, what: str, base_index: int = 0, named=None) -> list[tuple]:
        n, out = len(self.named), []
        for i, name, p in self.named if named is None else named:
            got = self._fragment(p, what)
            if got is not None and got[0] is not None:
                out += pieces(base_index + i, n, name, got[0], got[1], logical_shape(p))
        return out


class DeepSpeedRun(AttachedRun):
    """An attached run whose hook points are DeepSpeed's (see the module's docstring)."""

    def __init__(self, engine_obj, optimizer, *args, **kwargs):
        self.ds = engine_obj
        super().__init__(engine_obj, optimizer, *args, **kwargs)
        self.parts = _Partitions(engine_obj, self.named)
        self._norm, self._norm_stage0 = None, None
        self._clipped: list[tuple] = []  # this step's gradient pieces after clipping, for `clip`
        self._orig = {}  # the engine's methods this run replaced on the instance (own ones kept)
        for name in ("step", "clip_fp32_gradients", "save_checkpoint"):
            self._orig[name] = engine_obj.__dict__.get(name)
            setattr(engine_obj, name, getattr(self, f"_ds_{name}"))
        # ZeRO 1-2 clip each group's flat fp32 gradient partition right before its optimizer step
        self._zo_clip = None  # (ZeRO-3: each sub-group's, right before that sub-group's step)
        if self.parts.stage > 0 and hasattr(self.parts.zo, "unscale_and_clip_grads"):
            self._zo_clip = self.parts.zo.__dict__.get("unscale_and_clip_grads")
            self.parts.zo.unscale_and_clip_grads = self._zo_unscale_and_clip_grads

    def _call(self, name: str, *args, **kwargs):
        """The engine's own method (the script's, if it had replaced it on the instance)."""
        own = self._orig[name]
        return (own or getattr(type(self.ds), name).__get__(self.ds))(*args, **kwargs)

    # AttachedRun's hooks on the torch optimizer's step: DeepSpeed's step is the one recorded here
    def _before_step(self, _opt, args, kwargs):
        return None

    def _after_step(self, _opt, _args, _kwargs):
        return None

    def _install_backward_points(self) -> bool:
        for i, n, p in self.named:
            if p.requires_grad:
                self._handles.append(p.register_hook(self._grad_hook(i, n)))
        return False

    def _grad_hook(self, index: int, name: str):
        def hook(grad):
            if self._paused or self._closed:
                return None
            self.bus.micro_batch = max(self._forwards - 1, 0)
            g = (
                grad.clone() if self.fault is not None else grad
            )  # a fault acts on what DeepSpeed gets
            self.bus.emit("backward", grads=[(index, name, g)])
            return g if self.fault is not None else None

        return hook

    def _ds_clip_fp32_gradients(self):
        """Stage 0 clips with DeepSpeed's clip_grad_norm_, which returns the norm the engine drops."""
        from deepspeed.runtime.utils import clip_grad_norm_

        self._norm = clip_grad_norm_(
            parameters=self.ds.module.parameters(),
            max_norm=self.ds.gradient_clipping(),
            mpu=self.ds.mpu,
        )
        if not (self._paused or self._closed):
            self._clipped = _copies(self.parts.collect("grad"))

    def _zo_unscale_and_clip_grads(self, grad_groups_flat, total_norm, *args, **kwargs):
        """ZeRO 1-2: the gradient partition each group's optimizer step reads, after DeepSpeed clipped it
        (copied: DeepSpeed reuses or frees the buffer after the step)."""
        own = self._zo_clip or type(self.parts.zo).unscale_and_clip_grads.__get__(self.parts.zo)
        out = own(grad_groups_flat, total_norm, *args, **kwargs)
        if self._paused or self._closed or not self.ds.gradient_clipping():
            return out  # without clipping `clip` holds the scalars only, as the harness's does
        zo, n = self.parts.zo, len(self.named)
        if self.parts.stage == 3:  # grad_groups_flat: the sub-group's index
            flat = zo.fp32_partitioned_groups_flat[grad_groups_flat].grad
            dist = _dist()
            for i, name, p in self.named:
                pos = zo.grad_position.get(zo.get_param_id(p))
                if pos is None or pos[0] != grad_groups_flat:
                    continue
                part = dist.get_rank(group=p.ds_process_group) if dist else 0
                frag = flat.narrow(0, int(pos[1]), int(pos[2])).clone()
                self._clipped += pieces(
                    i, n, name, frag, part * p.ds_tensor.ds_numel, logical_shape(p)
                )
            return out
        fp32 = getattr(zo, "single_partition_of_fp32_groups", [])
        for flat in grad_groups_flat:
            group = next((g for g, t in enumerate(fp32) if t.grad is flat), None)
            if group is None or not torch.is_tensor(flat):  # offload's sub-partition lists
                continue
            for i, name, p in self.named:
                hp = getattr(p, "_hp_mapping", None)
                if hp is None or hp.param_group_index != group:
                    continue
                a = hp.hp_fragment_address
                frag = flat.narrow(0, a.start, a.numel).clone()
                self._clipped += pieces(
                    i, n, name, frag, hp.lp_fragment_address.start, logical_shape(p)
                )
        return out

    def _ds_step(self, *args, **kwargs):
        if self._paused or self._closed or not self.ds.is_gradient_accumulation_boundary():
            return self._call("step", *args, **kwargs)
        self.bus.micro_batch = max(self._forwards - 1, 0)
        grads = self.parts.collect("grad")
        if grads:
            self.bus.emit("reduce", grads=grads)
        self.bus.emit("before_optimizer", optimizer=self.optimizer, params=self.named)
        self._norm, self._norm_stage0 = None, None
        self._clipped = []
        if self.parts.stage == 0 and not self.ds.gradient_clipping():
            # stage 0 without clipping computes no norm; every rank holds the whole reduced gradient,
            # so its norm is the global one, taken as the harness takes it (before the step frees it)
            g = [p.grad for _, _, p in self.named if p.grad is not None]
            self._norm_stage0 = torch.nn.utils.get_total_norm(g, 2.0, foreach=False) if g else None
        out = self._call("step", *args, **kwargs)
        self._record_optimizer(lr0=not self._record_clip())
        self._stepped = True
        self.completed = self.step
        if self._observed is None:  # the experiment's global batch is summed from it at close
            self._observed = {
                "step": self.step,
                "samples": self._samples if self._forwards else None,
                "micro_batches": self._forwards,
            }
        return out

    def _record_clip(self) -> bool:
        """`clip`'s scalars (and the clipped gradient); False where DeepSpeed computed no norm."""
        norm = self._norm if self._norm is not None else self.ds.get_global_grad_norm()
        norm = norm if norm is not None else self._norm_stage0
        if norm is None:
            return False
        # in the gradients' dtype, as the harness records its norm (ZeRO-3 computes it in float64)
        dtype = self.named[0][2].dtype if self.named else torch.float32
        norm = torch.tensor(float(norm), dtype=dtype)
        clip = float(self.ds.gradient_clipping() or 0.0)
        coef = (
            torch.clamp(clip / (norm + 1e-6), max=1.0)
            if clip > 0
            else torch.ones((), dtype=norm.dtype)
        )
        scalars = [(SCALAR_INDEX, "grad_norm", norm), (SCALAR_INDEX + 1, "clip_coef", coef)]
        if self.optimizer.param_groups:
            lr = self.optimizer.param_groups[0].get("lr", 0.0)
            scalars.append((SCALAR_INDEX + 2, "lr", torch.tensor(float(lr), dtype=torch.float64)))
        grads, self._clipped = self._clipped, []
        self.bus.emit("clip", grads=grads, scalars=scalars)
        return True

    def _record_optimizer(self, lr0: bool = False) -> None:
        params = self.parts.collect("param")
        n = len(self.named)
        state = []
        for slot, key in enumerate(self.parts.state_keys()):
            for index, name, t in self.parts.collect(key, base_index=0):
                # after every parameter piece: BOXES strides of the parameters, then one per key
                state.append((BOXES * n * (1 + slot) + index - len(params), f"{name}:{key}", t))
        # group 0's lr is the `clip` phase's (as the harness and a plain attached run that clips record it);
        # here only in a step that recorded no `clip` (lr0); the other groups' are always here
        lrs = [
            (
                SCALAR_INDEX * 4 + g - len(params),
                f"param_groups.{g}.lr",
                torch.tensor(float(group.get("lr", 0.0)), dtype=torch.float64),
            )
            for g, group in enumerate(self.optimizer.param_groups)
            if g > 0 or lr0
        ]
        self.bus.emit("optimizer", params=params, state=state + lrs, optimizer=self.optimizer)

    def checkpoint(self, state: dict | None = None, step: int | None = None) -> Path:
        """DeepSpeed's own engine.save_checkpoint (its files, every stage's partitions) into the run's
        checkpoints/step-NNNNNN with disttrace's sha256 INDEX.json (format "deepspeed"), published atomically
        as the harness's are; `verify`, `show checkpoints` and the gate's checkpoint integrity read it.
        Collective: every rank calls it. The directory is DeepSpeed's tag directory (load_dir = the run's
        checkpoints/, tag = step-NNNNNN)."""
        import shutil

        from disttrace.store.checkpoints import step_dir, write_index

        if state is not None:
            raise BadInput(
                "run.checkpoint",
                "a DeepSpeed engine saves its own state: put extra state in the engine's client_state",
            )
        dist = _dist()
        step = (self.step if self._stepped else self.step - 1) if step is None else int(step)
        final = step_dir(self.run_dir, step)
        # DeepSpeed writes save_dir/tag/ (and a recovery script into save_dir): a staging folder holds both
        staging = final.with_name(f".{final.name}.staging")
        self._paused = True
        try:
            self._call(
                "save_checkpoint",
                str(staging),
                final.name,
                client_state={"disttrace": {"step": step, "manifest_id": self.manifest_id}},
                save_latest=False,
            )
        finally:
            self._paused = False
        if dist:
            dist.barrier()
        if self.rank == 0:
            write_index(
                staging / final.name,
                step,
                self.manifest_id,
                self.manifest["parallelism"]["world_size"],
                ["model", "optim"],
                fmt="deepspeed",
            )
            os.replace(staging / final.name, final)
            shutil.rmtree(staging, ignore_errors=True)
            event(
                self.run_dir,
                Event.CHECKPOINT_SAVED,
                step=step,
                path=str(final.relative_to(self.run_dir)),
            )
        if dist:
            dist.barrier()
        self.bus.emit("checkpoint", path=final, step=step)
        self._finish_step()
        return final

    def _ds_save_checkpoint(self, save_dir, tag=None, *args, **kwargs):
        self._paused = True
        try:
            return self._call("save_checkpoint", save_dir, tag, *args, **kwargs)
        finally:
            self._paused = False

    def close(self) -> None:
        if not self._closed:
            for name, own in self._orig.items():
                if own is None:
                    self.ds.__dict__.pop(name, None)
                else:
                    setattr(self.ds, name, own)
            if self.parts.stage > 0 and "unscale_and_clip_grads" in self.parts.zo.__dict__:
                if self._zo_clip is None:
                    del self.parts.zo.unscale_and_clip_grads
                else:
                    self.parts.zo.unscale_and_clip_grads = self._zo_clip
        super().close()
