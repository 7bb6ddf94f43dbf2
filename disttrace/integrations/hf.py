"""disttrace for a Hugging Face `transformers.Trainer` (install with `pip install disttrace[hf]`).

    from disttrace.integrations.hf import DisttraceCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(DisttraceCallback(trainer, out="runs"))
    trainer.train()            # every rank records; rank 0 prints nothing extra: the run dir is callback.run_dir

eval_command=[...] (with evaluation={"data": ..., "metric": ..., ...}, the rest of a policy's [eval]; see
docs/gate.md) names the gate's evaluation in the run's manifest, so that a gate judging a candidate against
this run as its reference scores both final checkpoints with it; the callback then also writes a final
disttrace checkpoint (run.checkpoint()) at the end of training, which is what the gate hands the command.

At `on_train_begin` the Trainer has wrapped the model (DDP under torchrun) and built the optimizer: the
callback attaches to those, so DDP's comm hook gives the `backward` point. The TrainingArguments that define
the experiment (learning rate, batch, accumulation, steps, seed, clipping) go into the manifest's config.

The training DataLoader (accelerate's DataLoaderShard, passed to `on_train_begin`) is watched as
`attach(..., loader=)` watches a script's: each micro-batch's `data` record is the batch it handed out, with
its sample ids where its sampler can be read ahead without changing anything (accelerate's
SeedableRandomSampler, the Trainer's default, or a Sequential/DistributedSampler, sharded by
BatchSamplerShard; see attach._planned_sample_ids), else no ids. A batch is paired with the model's next
training forward only when that forward's input is the tensor the loader handed out (on the CPU: equal to it);
otherwise (a Trainer whose compute_loss runs the model twice, or rebuilds the inputs) the queued batches are
dropped and those micro-batches have no ids. Batches fetched in an epoch that stopped early are dropped at the next epoch.

checkpoints=True writes a disttrace checkpoint (run.checkpoint(): DCP with its sha256 INDEX) each time the
Trainer saves its own. resume=PATH, with `trainer.train(resume_from_checkpoint=...)` of the same step, loads
that verified disttrace checkpoint into the model and optimizer the Trainer restored and numbers the run's
steps from it (run.resume()): the Trainer's own checkpoint restores its scheduler, generator states and data
position, which disttrace does not hold. This is how `disttrace replay RUN --step S -- CMD` replays a Trainer
run from its checkpoint (docs/replay.md); a Trainer that resumed without `resume=` is refused, since its
steps would be numbered from 1.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback

import disttrace.api
from disttrace.errors import BadInput
from disttrace.integrations import evaluation_spec, resume_where_the_framework_did
from disttrace.run.attach import batch_inputs, first_tensor

ARG_FIELDS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "lr_scheduler_type",
    "warmup_steps",
    "seed",
    "data_seed",
    "max_steps",
    "num_train_epochs",
)


class DisttraceCallback(TrainerCallback):
    def __init__(
        self,
        trainer=None,
        out="runs",
        name: str = "hf-trainer",
        config: dict | None = None,
        eval_command: list[str] | None = None,
        evaluation: dict | None = None,
        final_checkpoint: bool | None = None,
        checkpoints: bool = False,
        resume=None,
    ):
        self.trainer, self.out, self.name, self.config = trainer, out, name, config or {}
        self.checkpoints, self.resume = checkpoints, resume
        self.evaluation = evaluation_spec(eval_command, evaluation)
        # what the gate evaluates: the store's last checkpoint, written at the end when there is an evaluation
        self.final_checkpoint = (
            self.evaluation is not None if final_checkpoint is None else final_checkpoint
        )
        self.run = None
        self._pairing = None

    def on_train_begin(
        self, args, state, control, model=None, optimizer=None, train_dataloader=None, **kwargs
    ):
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        config = {k: getattr(args, k) for k in ARG_FIELDS if hasattr(args, k)}
        config.update(
            grad_accum_steps=args.gradient_accumulation_steps,
            micro_batch_size=args.per_device_train_batch_size,
            **self.config,
        )
        if args.max_steps and args.max_steps > 0:
            config["steps"] = args.max_steps
        if state.global_step and self.resume is None:
            raise BadInput(
                "DisttraceCallback(resume=)",
                f"the Trainer resumed from its own checkpoint at step {state.global_step}: give the "
                "disttrace checkpoint of that step (written with checkpoints=True), or the run's steps "
                "would be numbered from 1",
            )
        self.run = disttrace.api.attach(
            wrapped if wrapped is not None else model,
            optimizer,
            out=self.out,
            name=self.name,
            config=config,
            loader=train_dataloader,
            evaluation=self.evaluation,
        )
        if self.resume is not None:
            resume_where_the_framework_did(self.run, self.resume, state.global_step, "Trainer")
        if (
            train_dataloader is not None
        ):  # runs before attach's own pre-hook, which takes the queued batch
            self._pairing = self.run.inner.register_forward_pre_hook(
                self._check_pairing, with_kwargs=True, prepend=True
            )

    def _check_pairing(self, module, args, kwargs):
        """The queued batch goes to this forward only if the forward reads it: its input tensor (input_ids, or
        the first tensor) is the handed-out tensor (same memory: on an accelerator the DataLoaderShard placed
        the batch and the Trainer's move is a no-op), or on the CPU equal to it (the Trainer's `.to("cpu:0")`
        copies a "cpu" tensor); compared without waiting for a device. Else every queued batch is dropped."""
        run = self.run
        if (
            run is None
            or not run.queued_batches()
            or not (module.training and torch.is_grad_enabled())
        ):
            return None
        if (
            torch._C._current_graph_task_id() != -1
        ):  # recomputation inside backward: not a micro-batch
            return None
        seen = batch_inputs(dict(kwargs)) if kwargs else first_tensor(args, {})
        queued = run.queued_inputs()
        same = (
            seen is not None
            and seen.shape == queued.shape
            and seen.dtype == queued.dtype
            and (
                seen.data_ptr() == queued.data_ptr()
                or (seen.device.type == queued.device.type == "cpu" and torch.equal(seen, queued))
            )
        )
        if not same:
            run.drop_queued_batches()
        return None

    def on_save(self, args, state, control, **kwargs):
        if self.checkpoints and self.run is not None:  # every rank: DCP's save is collective
            self.run.checkpoint()

    def on_epoch_begin(self, args, state, control, **kwargs):
        if (
            self.run is not None
        ):  # the epoch's batches are not fetched yet: anything queued is left over
            self.run.drop_queued_batches()

    def on_train_end(self, args, state, control, **kwargs):
        if self._pairing is not None:
            self._pairing.remove()
            self._pairing = None
        if self.run is not None:
            if self.final_checkpoint:
                self.run.checkpoint()
            self.run.close()

    @property
    def run_dir(self):
        return self.run.run_dir if self.run is not None else None
