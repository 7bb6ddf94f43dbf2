"""`DeepSpeedRun`: an attached run whose hook points are DeepSpeed's (the package's docstring says what
each phase reads there)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from disttrace.errors import BadInput
from disttrace.run.attach import AttachedRun, initialized_dist
from disttrace.run.deepspeed.pieces import (
    BOXES,
    _copies,
    _Partitions,
    logical_shape,
    pieces,
)
from disttrace.run.parallel.common import SCALAR_INDEX
from disttrace.store.events import CheckpointSaved
from disttrace.store.writers import event


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
            dist = initialized_dist()
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
        dist = initialized_dist()
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
                self.typed.parallelism.world_size,
                ["model", "optim"],
                fmt="deepspeed",
            )
            os.replace(staging / final.name, final)
            shutil.rmtree(staging, ignore_errors=True)
            event(
                self.run_dir,
                CheckpointSaved(step=step, path=str(final.relative_to(self.run_dir))),
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
