"""Loader watching: the batches a training DataLoader hands out become the `data` records of the forwards
that consume them, with the sample ids its sampler planned."""

from __future__ import annotations

import weakref
from collections import deque
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from disttrace.run.attach.run import AttachedRun


class LoaderWatch:
    """AttachedRun's watched loaders and their queue of batches (a mixin)."""

    def _start_watching(self) -> None:
        # (inputs, sample ids) a watched DataLoader handed out, one per forward
        self._pending: deque = deque()
        # the inputs of the batch the last training forward took (see _take_batch)
        self._taken = None
        self._loaders: list = []  # loaders whose class attach swapped (restored at close)

    def watch_loader(self, loader) -> WatchedLoader:
        """The training DataLoader as the run sees it: iterate what this returns instead of `loader`. Each
        batch it hands out is the `data` record of the next forward of the model, with the sample ids its
        DistributedSampler yielded for that batch (empty for samplers that cannot be read without drawing
        randomness). `attach(..., loader=loader)` does the same to the loader in place."""
        return WatchedLoader(self, loader)

    # what the integrations (integrations/hf.py, lightning.py) need of a watched loader's queue, where they
    # know better than the order of forwards which batch a forward reads
    def queued_inputs(self):
        """The inputs of the batch the next training forward will be paired with (None: nothing queued)."""
        return self._pending[0][0] if self._pending else None

    def queued_batches(self) -> int:
        return len(self._pending)

    def drop_queued_batches(self) -> None:
        """Forget the batches a watched loader handed out that no forward has taken: the forwards that follow
        record their own inputs, without sample ids (no id rather than another batch's)."""
        self._pending.clear()

    def watch_iterator(self, loader, iterator):
        """`iterator`, an iterator `loader` already made, watched as `attach(loader=)` watches the ones it makes."""
        return self._batches_of(loader, lambda: iterator)

    def _watch_in_place(self, loader) -> None:
        base = type(loader)
        ref = weakref.ref(
            self
        )  # the swapped class outlives close() until a collection: it must not hold the run

        def __iter__(self):
            run = ref()
            if run is None or run._closed:
                return base.__iter__(self)
            return run._batches_of(self, lambda: base.__iter__(self))

        namespace = {"__iter__": __iter__, "__module__": base.__module__, "_disttrace_base": base}
        swap = object.__dict__["__class__"].__set__  # the instance's class slot itself
        own = next(
            (k.__dict__["__class__"] for k in base.__mro__[:-1] if "__class__" in k.__dict__), None
        )
        if (
            own is not None
        ):  # accelerate's DataLoaderShard reports its inner DataLoader's class (a read-only
            if not isinstance(
                own, property
            ):  # property): keep reporting it, and let close() swap the class back
                return
            namespace["__class__"] = property(own.fget, swap)
        swap(loader, type(base.__name__, (base,), namespace))
        self._loaders.append((loader, base))

    def _batches_of(self, loader, make_iterator):
        """Yield the loader's batches, queueing each batch's inputs and sample ids for the forward that
        consumes it (a queue, not a record at once: a loop may fetch a whole accumulation window first)."""
        planned = _planned_sample_ids(loader)
        for n, batch in enumerate(make_iterator()):
            inputs = batch_inputs(batch)
            # an evaluation pass (no_grad or eval mode) runs no micro-batch to consume the batch: not queued
            training = torch.is_grad_enabled() and self.inner.training
            if inputs is not None and training and not self._closed:
                ids = planned[n] if planned is not None and n < len(planned) else []
                self._pending.append((inputs.detach(), ids))
            yield batch

    def _take_batch(self, args, kwargs):
        """The queued batch this forward consumes: the next in order, unless the forward reads the batch the
        previous forward took (its input in that batch's storage, and not in the next one's: the model run twice
        on one batch), which takes none: by order it took the next batch, and its ids. Storage addresses only,
        so the device is never waited for; an input copied to another device is not recognised (docs/attach.md)."""
        where = _storage(first_tensor(args, kwargs))
        if (
            where is not None
            and where == _storage(self._taken)
            and not (self._pending and _storage(self._pending[0][0]) == where)
        ):
            return None
        watched = self._pending.popleft() if self._pending else None
        # held (one batch's inputs, until the next take) so its address cannot be reused by a later batch
        self._taken = watched[0] if watched is not None else None
        return watched


def first_tensor(args, kwargs):
    for v in (*args, kwargs.get("input_ids"), *kwargs.values()):
        if isinstance(v, (tuple, list)) and v:  # a (inputs, targets) batch handed whole (Lightning)
            v = v[0]
        if torch.is_tensor(v):
            return v
    return None


def _storage(t) -> int | None:
    """The address of a tensor's storage (a slice or `.to()` on its own device shares it), None if none."""
    if not torch.is_tensor(t) or hasattr(t, "to_local"):
        return None
    try:
        return t.untyped_storage().data_ptr() or None
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def batch_inputs(batch):
    """What a batch's `data` record digests: the batch itself, the first tensor of an (inputs, targets)
    pair, or a dict's input_ids (else its first tensor)."""
    if isinstance(batch, dict):
        batch = batch.get(
            "input_ids", next((v for v in batch.values() if torch.is_tensor(v)), None)
        )
    return first_tensor((batch,), {})


def _planned_sample_ids(loader) -> list[list[int]] | None:
    """Each batch's sample ids for the epoch about to start, read from the loader's sampler where reading it
    changes nothing and the loader hands out its batches in the sampler's order: a DistributedSampler, a
    SequentialSampler (or accelerate's SeedableRandomSampler) is a pure function of its seed and epoch, batched
    by torch's own BatchSampler (sharded by accelerate's BatchSamplerShard in a DataLoaderShard, which sets the
    sampler's epoch to its own iteration count when it starts an epoch). The sampler read is the batch
    sampler's, not `loader.sampler` (with a batch_sampler given, that is a default SequentialSampler nobody
    iterates). None for anything else: other samplers (a RandomSampler draws its seed from the global
    generator: reading it ahead would change the training), other loader classes (a DataLoader subclass with
    its own iteration, torchdata's StatefulDataLoader resuming mid-epoch, accelerate's DataLoaderDispatcher
    slicing rank 0's batches), and workers allowed to hand batches out of order (in_order=False)."""
    import sys

    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

    kind = type(loader).__dict__.get(
        "_disttrace_base", type(loader)
    )  # the loader's own class, when watched
    acc = sys.modules.get(
        "accelerate.data_loader"
    )  # a DataLoaderShard exists only if accelerate is imported
    pure = (DistributedSampler, SequentialSampler) + ((acc.SeedableRandomSampler,) if acc else ())
    shard = acc is not None and kind is acc.DataLoaderShard
    if shard:
        if type(loader.base_dataloader) is not DataLoader:  # a StatefulDataLoader underneath
            return None
    elif not (
        isinstance(kind, type)
        and issubclass(kind, DataLoader)
        and kind.__iter__ is DataLoader.__iter__
        and kind._get_iterator is DataLoader._get_iterator
    ):
        return None
    if getattr(loader, "num_workers", 0) > 0 and getattr(loader, "in_order", True) is False:
        return None
    batches = getattr(loader, "batch_sampler", None)
    if batches is None:  # batch_size=None: one sample per batch
        sampler = getattr(loader, "sampler", None)
        return [[int(i)] for i in sampler] if not shard and type(sampler) in pure[:2] else None
    inner = batches.batch_sampler if shard and type(batches) is acc.BatchSamplerShard else batches
    if type(inner) is not BatchSampler:
        return None
    sampler = inner.sampler
    if type(sampler) not in pure:
        return None
    epoch = getattr(
        sampler, "epoch", None
    )  # a SeedableRandomSampler counts its epochs as it is read
    if shard and epoch is not None:  # the epoch DataLoaderShard.__iter__ is about to set
        sampler.set_epoch(loader.iteration)
    try:
        ids = [[int(i) for i in b] for b in batches]
    finally:
        if epoch is not None:
            sampler.set_epoch(epoch)
    return ids[loader.skip_batches :] if shard else ids


class WatchedLoader:
    """A DataLoader seen by an attached run (AttachedRun.watch_loader): same batches, same length."""

    def __init__(self, run: AttachedRun, loader):
        self.run, self.loader = run, loader

    def __iter__(self):
        return self.run._batches_of(self.loader, lambda: iter(self.loader))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)
