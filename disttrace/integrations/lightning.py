"""disttrace for a Lightning `Trainer` (install with `pip install disttrace[lightning]`).

    from disttrace.integrations.lightning import DisttraceCallback
    callback = DisttraceCallback(out="runs")
    trainer = L.Trainer(strategy="ddp", accumulate_grad_batches=2, callbacks=[callback], ...)
    trainer.fit(module, loader)          # callback.run_dir: the run directory

At `on_train_start` the strategy has wrapped the module (DDP under strategy="ddp") and built the optimizer:
the callback attaches to those. The Trainer settings that define the experiment go into the manifest's config.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

import disttrace.api


class DisttraceCallback(Callback):
    def __init__(self, out="runs", name: str = "lightning", config: dict | None = None):
        self.out, self.name, self.config = out, name, config or {}
        self.run = None

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        config = {"grad_accum_steps": trainer.accumulate_grad_batches, "gradient_clip_val": trainer.gradient_clip_val,
                  "max_epochs": trainer.max_epochs, **self.config}
        if trainer.max_steps and trainer.max_steps > 0:
            config["steps"] = trainer.max_steps
        self.run = disttrace.api.attach(model, trainer.optimizers[0], out=self.out, name=self.name, config=config)

    def on_train_end(self, trainer, pl_module):
        if self.run is not None:
            self.run.close()

    @property
    def run_dir(self):
        return self.run.run_dir if self.run is not None else None
