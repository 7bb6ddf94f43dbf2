"""The attached run: what the user's script calls (batch, loss, scalar, checkpoint, resume, close), over
the recorder, collective trace and memory ledger the harness's ranks use."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import SimpleNamespace

import torch

from disttrace.errors import BadInput
from disttrace.run import faults
from disttrace.run.attach.comm import initialized_dist
from disttrace.run.attach.engine import Engine, named_parameters
from disttrace.run.attach.faults import FaultContext, FaultGroup, build_fault
from disttrace.run.attach.loader import LoaderWatch
from disttrace.run.attach.manifest import SOURCE
from disttrace.run.attach.points import _ACTIVE, HookPoints, patch_clip
from disttrace.run.attach.steps import StepCycle
from disttrace.run.job.complete import seal_and_complete
from disttrace.run.job.hooks import Batch, Data, HookBus, Loss, StepStart, process_exit
from disttrace.run.parallel.common import SCALAR_INDEX, Strategy
from disttrace.run.record.collectives import CollectiveTracer
from disttrace.run.record.recorder import Recorder
from disttrace.run.record.scales import Magnitudes
from disttrace.store.documents import ResumeSpec
from disttrace.store.events import CheckpointSaved, FaultRefused, RankFailed, Resumed
from disttrace.store.rundir import read_run_info
from disttrace.store.writers import disk_full, event, write_run_info


class _UserState(Strategy):
    """The model and optimizer as a Strategy for run/job/checkpoint.py (DCP's state-dict helpers), or the
    user's own state dict when one is passed."""

    def __init__(self, model, optimizer, state: dict | None = None):
        self.model, self.optimizer, self.state = model, optimizer, state

    def state_dict(self, with_optimizer: bool = True) -> dict:
        return dict(self.state) if self.state is not None else super().state_dict(with_optimizer)

    def load_state_dict(self, state: dict) -> None:
        if self.state is None:
            super().load_state_dict(state)


class AttachedRun(LoaderWatch, HookPoints, StepCycle):
    """A user's training script, recorded: attach() builds it on every rank (see the package's docstring)."""

    def __init__(
        self,
        model,
        optimizer,
        run_dir: Path,
        rank: int,
        engine: Engine,
        manifest: dict,
        manifest_id: str,
        fault_spec: dict | None,
        blocks: list[tuple[str, torch.nn.Module]] = (),
        depth=None,  # run/record/depth.py's DepthRequest
    ):
        self.run_dir, self.rank = run_dir, rank
        self.model, self.engine, self.manifest, self.manifest_id = (
            model,
            engine,
            manifest,
            manifest_id,
        )
        self.typed = faults.typed(
            manifest
        )  # the same manifest read by attribute (AttachedManifest)
        self.inner = engine.inner
        self.named = [(i, n, p) for i, (n, p) in enumerate(named_parameters(self.inner))]
        self.optimizer = optimizer
        self.bus = HookBus(rank)
        self.tracer = CollectiveTracer(run_dir, rank)
        self.tracer.attach(
            self.bus
        )  # the step on each trace line (its handler holds the tracer, not the run)
        forward = self.typed.record.forward
        self.recorder = Recorder(run_dir, rank, forward=forward).attach(self.bus)
        self.ledger = self._memory_ledger()
        self._start_cycle()
        self._start_watching()
        self._handles = [
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
            self.inner.register_forward_pre_hook(self._on_forward, with_kwargs=True),
        ]
        if forward:
            self._handles += [
                module.register_forward_hook(self._block_output_hook(index, name))
                for index, (name, module) in enumerate(blocks)
            ]
        self.comm_hook = self._install_backward_points()
        self.capabilities = faults.attached_capabilities(engine.kind, self.comm_hook)
        self.fault = None
        if fault_spec:
            names = [n for _, n, _ in self.named]
            try:
                self.fault = build_fault(fault_spec, engine, self.capabilities, manifest, names)
            except BadInput as e:
                if rank == 0:
                    event(
                        run_dir,
                        FaultRefused(
                            fault=fault_spec.get("name"),
                            where=e.where,
                            field=e.field,
                            reason=e.reason,
                        ),
                    )
                self._remove_hooks()
                raise
            ctx = FaultContext(
                run_dir=run_dir,
                manifest=manifest,
                rank=rank,
                dp_rank=rank,
                strategy=FaultGroup(group=getattr(engine.ddp, "process_group", None)),
            )
            self.fault.attach(self.bus, ctx)
        # the magnitudes the numeric bound scales each gradient by (run/record/scales.py), from module hooks on the
        # model as trained: DDP's, FSDP2's and a plain script's modules alike (the HF and Lightning callbacks
        # reach this run too); after the fault check, which would leave them on the model when it refuses.
        # Not under DeepSpeed, whose engine owns the backward: its stores keep the norm's scale, diff says so
        self.scales = (
            Magnitudes(run_dir, rank, self.inner).attach(self.bus)
            if engine.kind != "DeepSpeed"
            else None
        )
        # one step recorded at depth (run.json's `depth`: a replay for `zoom`, docs/zoom.md); else nothing
        self.depth = None
        if depth is not None:
            from disttrace.run.record.depth import DepthRecorder

            self.depth = DepthRecorder(
                run_dir,
                rank,
                self.inner,
                depth.step,
                depth.level,
                dp=depth.dp,
                dp_rank=depth.dp_rank,
                micro_batch_size=None,  # the step's first micro-batch tells
                global_batch=depth.global_batch,
            ).attach(self.bus)
        self.tracer.__enter__()
        _ACTIVE.append(self)
        patch_clip(True)
        self.bus.step, self.bus.micro_batch = 1, 0
        self.bus.emit(StepStart())

    # ---------------------------------------------------------- the user's calls
    def batch(self, inputs, sample_ids=None) -> None:
        """The data record of the micro-batch about to run (call it before that forward)."""
        self._finish_step()
        mb = self._forwards
        self.bus.micro_batch = mb
        ids = sample_ids.tolist() if torch.is_tensor(sample_ids) else list(sample_ids or [])
        self._data_mb.add(mb)
        self._count(inputs)
        self.bus.emit(Data(Batch(inputs.detach(), sample_ids=[int(i) for i in ids])))

    def loss(self, loss: torch.Tensor, tokens: int = 0) -> torch.Tensor:
        """Record the loss of the current micro-batch (the last forward); returns the loss to backprop (a
        fault on the loss point acts on what this returns)."""
        self.bus.micro_batch = max(self._forwards - 1, 0)
        return self.bus.emit(Loss(loss=loss, tokens=int(tokens))).loss

    def scalar(self, name: str, value) -> None:
        """A scalar every rank should agree on, recorded in this step's clip phase (after the step's reduce,
        recorded first): run.scalar("grad_norm", norm) is a hand-written clip's norm, held to the rule the
        clip scalars are (replicas.json)."""
        if self._forwards:  # after the step's backward passes: its gradients are final
            self._flush_reduce()
        t = (
            value.detach()
            if torch.is_tensor(value)
            else torch.tensor(float(value), dtype=torch.float64)
        )
        index = (
            SCALAR_INDEX + 100 + int(hashlib.sha256(name.encode()).hexdigest()[:6], 16) % 100_000
        )
        self.recorder.add(self.bus, "clip", index, name, t)

    def checkpoint(self, state: dict | None = None, step: int | None = None) -> Path:
        """Write a DCP checkpoint of `state` (default: the model and optimizer, through DCP's state-dict
        helpers) with disttrace's sha256 INDEX.json, at `step` (default: the last completed step).
        Collective: every rank calls it."""
        from disttrace.run.job import checkpoint as ckpt

        if initialized_dist() is None:
            raise BadInput(
                "run.checkpoint", "needs torch.distributed initialised (DCP's collective save)"
            )
        step = (self.step if self._stepped else self.step - 1) if step is None else int(step)
        holder = _UserState(self.model, self.optimizer, state)
        self._paused = True
        try:
            path = ckpt.save(
                holder,
                self.run_dir,
                step,
                self.manifest_id,
                self.typed.parallelism.world_size,
                self.rank,
                self.bus,
                extra={"source": SOURCE},
            )
        finally:
            self._paused = False
        if self.rank == 0:
            event(
                self.run_dir,
                CheckpointSaved(step=step, path=str(path.relative_to(self.run_dir))),
            )
        self._finish_step()  # the checkpoint's records belong to the step it saved, as in harness runs
        return path

    def resume(self, checkpoint: str | Path, state: dict | None = None) -> int:
        """Load a verified checkpoint (every file's sha256 against its INDEX; refused if it belongs to
        another experiment) into the model and optimizer (or `state`, in place); returns its step. Later
        steps are numbered from it, and the run becomes a recovered path that diff compares from there."""
        from disttrace.run.job import checkpoint as ckpt

        path = Path(checkpoint).resolve()
        holder = _UserState(self.model, self.optimizer, state)
        self._paused = True  # set_state_dict initialises optimizer state with a zero-gradient step(): not a step
        try:
            progress = ckpt.load(holder, path, self.rank, self.manifest_id)
        finally:
            self._paused = False
        self.resumed(path, progress.step, path.parent.parent.parent, progress.with_optimizer)
        return progress.step

    def resumed(self, checkpoint: Path, step: int, from_run: Path, with_optimizer: bool) -> None:
        """The script's state is now that of `step` of `from_run` (loaded from `checkpoint`): later steps are
        numbered from it and the run is the recovered path (a replay stays a replay)."""
        if self.rank == 0:
            info = read_run_info(self.run_dir)
            info = info.updated(
                # a replay (`disttrace replay RUN -- CMD`) resuming is still a replay
                path="replay" if info.path == "replay" else "recovered",
                resume=ResumeSpec(
                    checkpoint=str(checkpoint), step=step, from_run=str(from_run)
                ).doc(),
            )
            write_run_info(self.run_dir, info)
            event(
                self.run_dir,
                Resumed(step=step, checkpoint=str(checkpoint), with_optimizer=with_optimizer),
            )
        self.step = step + 1
        self.bus.step, self.bus.micro_batch = self.step, 0
        self.tracer.step = self.step
        if self.depth is not None:
            self.depth.renumbered(self.bus)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._finish_step(start_next=False)
        self._remove_hooks()
        for loader, base in self._loaders:
            loader.__class__ = base
        self._loaders = []
        self._pending.clear()
        self._taken = None
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        patch_clip(bool(_ACTIVE))
        self.tracer.__exit__(None, None, None)
        self.tracer.close()
        self.recorder.close()
        if self.scales is not None:
            self.scales.close()
        if self.ledger._hooks is not None:  # the step that never ran: nothing to write
            self.ledger._hooks.__exit__(None, None, None)
            self.ledger._hooks = None
        self.ledger.close()
        dist = initialized_dist()
        self._write_observed(dist)
        seal_and_complete(
            self.run_dir,
            self.rank,
            self.recorder,
            dist,
            {
                "steps": self.completed,
                "source": SOURCE,
                "world_size": self.typed.parallelism.world_size,
            },
        )

    def __enter__(self) -> AttachedRun:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # the run stays incomplete: what the observers hold is written, and why it stopped said
            process_exit(self.bus, exc)
            event(
                self.run_dir,
                RankFailed(
                    rank=self.rank,
                    error=f"{exc_type.__name__}: {exc}"[:2000],
                    **({"disk_full": True} if disk_full(exc) is not None else {}),
                ),
            )

    # ---------------------------------------------------------- hook points
    def _memory_ledger(self):
        from disttrace.run.record.memory import (
            LedgerLayout,
            LedgerParallelism,
            LedgerTraining,
            MemoryLedger,
        )

        tr = self.typed.training
        layout = LedgerLayout(
            parallelism=LedgerParallelism.model_validate(self.typed.parallelism),
            training=LedgerTraining(
                dtype=tr.dtype if tr.dtype != "mixed" else "bfloat16",
                optimizer="adamw" if "adam" in tr.optimizer.lower() else "sgd",
            ),
        )
        held = SimpleNamespace(plain=self.inner, optimizer=self.optimizer)
        return MemoryLedger(self.run_dir, self.rank, layout, held).attach(self.bus)

    def _remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles = []
