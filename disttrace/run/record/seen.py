"""Bytes digested once: the digests of a step's host tensors (and the step before's), by where their bytes
live, so that a tensor whose bytes were digested lately is hashed only (`Seen`)."""

from __future__ import annotations

import numpy as np
import torch
import xxhash
from torch.multiprocessing.reductions import StorageWeakRef

from disttrace.run.record.digest import _digest_host, digest_tensor, raw_bytes

# ---------------------------------------------------------------- bytes digested once
# A step's phases often hand over tensors an earlier phase of the step (or the step before) already handed:
# under tensor or pipeline parallelism the last micro-batch's local gradients are the reduced ones; a
# checkpoint saves the parameters and the optimizer state the optimizer phase has just recorded; clipping by
# a coefficient of 1 rewrites the reduced gradients unchanged; a frozen parameter, an unused one's zero
# gradient, one step counter per parameter repeat from step to step. Their sums, norms and sketches are a
# function of their bytes and placement only, so they need not be computed again: hashing the bytes (the
# digest's cheapest part, xxh3) proves the bytes are the ones the statistics were computed from.


class Seen:
    """The digests of the tensors digested in this step and the one before, by where their bytes live, so a
    tensor whose bytes were digested is hashed only (the section above).

    A tensor is looked up by its storage (held by a weak reference: a storage freed since, its address
    reused by a new tensor, is not a candidate), the address, dtype, shape and strides of its bytes in it,
    its placement, and its version counter, which every in-place torch op bumps: a tensor whose version
    changed is digested afresh (unless `recheck`). An unchanged version is not taken as proof (a write
    through `.data`, numpy or a backend outside the dispatcher does not bump it): the bytes are hashed, and
    the earlier statistics are reused only when the hash is the digest they were recorded with. A 0-d
    tensor is looked up by its bytes themselves. Only the per-tensor path (`digest_tensor`) is remembered;
    the small tensors digested together keep their batches as they were. Nothing of a tensor is kept but
    its record's numbers and a weak reference to its storage."""

    def __init__(self):
        self._now: dict = {}
        self._before: dict = {}
        # tensors whose statistics were reused, and those hashed in vain (same storage, other bytes)
        self.hits = self.misses = 0
        self.hit_bytes = 0  # the bytes of the reused ones (hashed, not digested)

    def next_step(self) -> None:
        """Entries live for the step they were made in and the next (a frozen tensor is reused every step)."""
        self._before, self._now = self._now, {}

    @staticmethod
    def _key(t: torch.Tensor, off, lshape):
        """(key, version, storage): a 0-d tensor's key is its bytes (no version, no storage)."""
        place = (tuple(off) if off else None, tuple(lshape) if lshape else None)
        if t.dim() == 0:
            return ("value", t.dtype, bytes(raw_bytes(t)), place), None, None
        try:
            version = t._version
        except RuntimeError:  # an inference-mode tensor keeps no version counter: not remembered
            return None, None, None
        storage = t.untyped_storage()
        # t.shape (a torch.Size) equals and hashes as the tuple of its sizes; t.stride() is a tuple
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), place), version, storage

    def digest(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False) -> dict:
        """digest_tensor(t, off, lshape), its statistics reused where the same bytes were digested lately."""
        if t.device.type != "cpu":
            return digest_tensor(t, off, lshape)
        with np.errstate(all="ignore"):
            return self.host_digest(t.detach(), off, lshape, recheck)

    def host_digest(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False) -> dict:
        """`digest` of a local, detached host tensor, the caller holding np.errstate (digest_many)."""
        hit, token = self.lookup(t, off, lshape, recheck)
        return hit if hit is not None else self.store(token, _digest_host(t, off, lshape))

    def lookup(self, t: torch.Tensor, off=None, lshape=None, recheck: bool = False):
        """(the record of `t`'s bytes digested lately, or None; the token `store` takes to remember the
        digest made instead): a local host tensor."""
        if not t.numel():
            return None, None
        key, version, storage = self._key(t, off, lshape)
        if key is None:
            return None, None
        entry = self._now.get(key) or self._before.get(key)
        ref = None
        if entry is not None and self._same_storage(entry[1], storage):
            ref = entry[1]  # the same storage: its weak reference serves the new entry too
            if storage is None or (
                (recheck or entry[0] == version)
                and xxhash.xxh3_128_hexdigest(raw_bytes(t)) == entry[2]["digest"]
            ):
                self.hits += 1
                self.hit_bytes += t.numel() * t.element_size()
                self._now[key] = (version, entry[1], entry[2])
                return dict(entry[2]), None
            if recheck or entry[0] == version:
                self.misses += 1
        return None, (key, version, storage, ref)

    def store(self, token, d: dict) -> dict:
        """Remember digest `d` under `lookup`'s token (None: nothing to remember); what to record."""
        if token is None:
            return d
        key, version, storage, ref = token
        if ref is None and storage is not None:
            ref = StorageWeakRef(storage)
        self._now[key] = (version, ref, d)
        return dict(d)

    @staticmethod
    def _same_storage(ref, storage) -> bool:
        if ref is None or storage is None:
            return ref is None and storage is None
        # ref.expired() without its Python frame and the deprecated torch.Storage alias it goes through
        return ref.cdata == storage._cdata and not _expired(ref.cdata)


_expired = torch.UntypedStorage._expired
