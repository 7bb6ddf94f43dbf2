"""disttrace for a Lightning `Trainer` (install with `pip install disttrace[lightning]`).

    from disttrace.integrations.lightning import DisttraceCallback
    callback = DisttraceCallback(out="runs")
    trainer = L.Trainer(strategy="ddp", accumulate_grad_batches=2, callbacks=[callback], ...)
    trainer.fit(module, loader)          # callback.run_dir: the run directory

eval_command=[...] (with evaluation={"data": ..., ...}; docs/gate.md) names the gate's evaluation in the
run's manifest and writes a final disttrace checkpoint at the end of training, the one the gate evaluates.

At `on_train_start` the strategy has wrapped the module (DDP under strategy="ddp") and built the optimizer:
the callback attaches to those. The Trainer settings that define the experiment go into the manifest's config.

Under DDP with one sized training DataLoader, that loader (`trainer.train_dataloader`, as Lightning rebuilt it
with its DistributedSampler) is watched as `attach(..., loader=)` watches a script's: each micro-batch's
`data` record is the batch it handed out, with its sample ids where the sampler can be read ahead (a
DistributedSampler or SequentialSampler; a RandomSampler with use_distributed_sampler=False gives none).
Under DDP Lightning runs every training_step through the DDP wrapper's forward, once per batch, fetched one at
a time: that forward takes the batch. Other strategies (the module's own forward runs as often as the
training_step calls it), several loaders (CombinedLoader's batches), unsized ones (prefetched) and a
training_step taking `dataloader_iter` are not watched: their `data` is the forward's input, without ids.

checkpoints=True writes a disttrace checkpoint (run.checkpoint(): DCP with its sha256 INDEX) each time
Lightning saves one of its own. resume=PATH, with `trainer.fit(..., ckpt_path=...)` of the same step, loads
that verified disttrace checkpoint into the module and optimizer Lightning restored and numbers the run's
steps from it (run.resume()); Lightning's own checkpoint restores its loops and callbacks, which disttrace
does not hold. This is how `disttrace replay RUN --step S -- CMD` replays a Lightning run from its
checkpoint (docs/replay.md); a fit that resumed without `resume=` is refused, since its steps would be
numbered from 1.
"""

from __future__ import annotations

import inspect

from lightning.pytorch.callbacks import Callback

import disttrace.api
from disttrace.errors import BadInput
from disttrace.integrations import evaluation_spec, resume_where_the_framework_did


class DisttraceCallback(Callback):
    def __init__(
        self,
        out="runs",
        name: str = "lightning",
        config: dict | None = None,
        eval_command: list[str] | None = None,
        evaluation: dict | None = None,
        final_checkpoint: bool | None = None,
        checkpoints: bool = False,
        resume=None,
    ):
        self.out, self.name, self.config = out, name, config or {}
        self.checkpoints, self.resume = checkpoints, resume
        self.evaluation = evaluation_spec(eval_command, evaluation)
        self.final_checkpoint = (
            self.evaluation is not None if final_checkpoint is None else final_checkpoint
        )
        self.run = None
        self._watching = False

    def on_train_start(self, trainer, pl_module):
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        config = {
            "grad_accum_steps": trainer.accumulate_grad_batches,
            "gradient_clip_val": trainer.gradient_clip_val,
            "max_epochs": trainer.max_epochs,
            **self.config,
        }
        if trainer.max_steps and trainer.max_steps > 0:
            config["steps"] = trainer.max_steps
        if trainer.global_step and self.resume is None:
            raise BadInput(
                "DisttraceCallback(resume=)",
                f"the fit resumed from Lightning's checkpoint at step {trainer.global_step}: give the "
                "disttrace checkpoint of that step (written with checkpoints=True), or the run's steps "
                "would be numbered from 1",
            )
        loader = _watchable_loader(trainer, model)
        self.run = disttrace.api.attach(
            model,
            trainer.optimizers[0],
            out=self.out,
            name=self.name,
            config=config,
            loader=loader,
            evaluation=self.evaluation,
        )
        self._watching = loader is not None
        if self._watching:
            _first_epoch(trainer, self.run, loader)
        if self.resume is not None:
            resume_where_the_framework_did(self.run, self.resume, trainer.global_step, "fit")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if self.checkpoints and self.run is not None:  # every rank: DCP's save is collective
            self.run.checkpoint()

    def on_train_epoch_start(self, trainer, pl_module):
        if (
            self._watching and self.run is not None
        ):  # no batch of this epoch is fetched yet: drop leftovers
            self.run.drop_queued_batches()  # (an epoch ended by on_train_batch_start returning -1)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._watching and self.run is not None and self.run.queued_batches() > 1:
            self.run.drop_queued_batches()  # only the batch just fetched may wait here: pairing unknown, no ids

    def on_train_end(self, trainer, pl_module):
        if self.run is not None:
            if self.final_checkpoint:
                self.run.checkpoint()
            self.run.close()

    @property
    def run_dir(self):
        return self.run.run_dir if self.run is not None else None


def _watchable_loader(trainer, model):
    """The training DataLoader when each of its batches is one forward of the DDP-wrapped module, else None."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    loader = trainer.train_dataloader
    if not isinstance(model, DistributedDataParallel) or not isinstance(loader, DataLoader):
        return None
    if type(getattr(trainer.fit_loop, "_data_fetcher", None)) is not _PrefetchDataFetcher:
        return None  # a training_step taking dataloader_iter pulls batches itself
    try:
        len(loader)
    except TypeError:  # unsized: the fetcher prefetches a batch ahead
        return None
    return loader


def _first_epoch(trainer, run, loader) -> None:
    """Lightning made the first epoch's DataLoader iterator in FitLoop.setup_data, before on_train_start, so the
    watch in place sees later epochs only. That iterator's batches are watched too when it is single-process,
    has handed out nothing and has not started its batch sampler: the run reads the sampler ahead at its first
    batch, after Lightning has set the epoch, as it would for a fresh iterator. Otherwise none for that epoch."""
    from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

    combined = getattr(trainer.fit_loop, "_combined_loader", None)
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None)
    if not isinstance(iterators, list) or len(iterators) != 1:
        return
    it = iterators[0]
    if (
        type(it) is not _SingleProcessDataLoaderIter
        or it._num_yielded
        or it._index_sampler is not loader.batch_sampler
    ):
        return
    if (
        not inspect.isgenerator(it._sampler_iter)
        or inspect.getgeneratorstate(it._sampler_iter) != inspect.GEN_CREATED
    ):
        return
    iterators[0] = run.watch_iterator(loader, it)
