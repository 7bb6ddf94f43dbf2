"""disttrace for a Hugging Face `transformers.Trainer` (install with `pip install disttrace[hf]`).

    from disttrace.integrations.hf import DisttraceCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(DisttraceCallback(trainer, out="runs"))
    trainer.train()            # every rank records; rank 0 prints nothing extra: the run dir is callback.run_dir

At `on_train_begin` the Trainer has wrapped the model (DDP under torchrun) and built the optimizer: the
callback attaches to those, so DDP's comm hook gives the `backward` point. The TrainingArguments that define
the experiment (learning rate, batch, accumulation, steps, seed, clipping) go into the manifest's config.
"""

from __future__ import annotations

from transformers import TrainerCallback

import disttrace.api

ARG_FIELDS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
              "lr_scheduler_type", "warmup_steps", "seed", "data_seed", "max_steps", "num_train_epochs")


class DisttraceCallback(TrainerCallback):
    def __init__(self, trainer=None, out="runs", name: str = "hf-trainer", config: dict | None = None):
        self.trainer, self.out, self.name, self.config = trainer, out, name, config or {}
        self.run = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        config = {k: getattr(args, k) for k in ARG_FIELDS if hasattr(args, k)}
        config.update(grad_accum_steps=args.gradient_accumulation_steps,
                      micro_batch_size=args.per_device_train_batch_size, **self.config)
        if args.max_steps and args.max_steps > 0:
            config["steps"] = args.max_steps
        self.run = disttrace.api.attach(wrapped if wrapped is not None else model, optimizer, out=self.out,
                                        name=self.name, config=config)

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.close()

    @property
    def run_dir(self):
        return self.run.run_dir if self.run is not None else None
