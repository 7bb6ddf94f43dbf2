"""The trajectory recorder: listens at the hook points and writes one record per (step, micro-batch,
phase, rank, tensor). It never changes training; it only reads what the hooks hand it.

Records of one step are buffered, sorted into the order of docs/design.md ("Order") and written together as
one Arrow record batch (store/trajectory.py), because engine
callbacks (DDP buckets) can fire in different orders on different ranks; the file is then identical for
identical computations. After each step a line goes to the step index: byte offset and length of the
step's records and a digest of their digests, so diff can skip equal steps without reading them, and the
sha256 of those bytes chained to the previous step's (`disttrace verify`, and diff checks what it skips).

Tensors on an accelerator are digested in batches on the device (run/record/devdigest.py): their numbers reach
the host a step later, so such a step is written when the next one ends (or at the next step's start if
they have arrived, or at close): the host never waits for the device to write a record.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from disttrace.run.job.hooks import HookBus
from disttrace.run.record import devdigest
from disttrace.run.record.digest import digest_of_digests
from disttrace.run.record.digestmany import digest_many
from disttrace.run.record.seen import Seen
from disttrace.run.record.updates import Updates
from disttrace.store.records import CLIP_GRAD_BASE, PHASE_ORDER, StepIndexEntry
from disttrace.store.rundir import rank_file
from disttrace.store.seal import StepChain
from disttrace.store.trajectory import SKETCH_VERSION, SUFFIX
from disttrace.store.trajectory_write import TrajectoryWriter
from disttrace.store.writers import JsonlWriter


def no_dispatch_modes():
    """The dispatch modes (the collective tracer's) left while the digests' own tensor ops run. With none to
    leave, as in a run without the tracer, a null context after two counts: torch's context manager imports
    and pops on every call (a step's hundred calls cost about two milliseconds)."""
    if not _dispatch_stack() and not _pre_dispatch_stack():
        return _NULL
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


_NULL = contextlib.nullcontext()
_dispatch_stack = torch._C._len_torch_dispatch_stack
_pre_dispatch_stack = torch._ops._len_torch_dispatch_stack_pre_dispatch


def shard_info(t) -> dict:
    """For a DTensor that is sharded, where this rank's piece sits in the logical tensor (diff combines the
    pieces' sums and norms into the logical tensor's, so a shard compares with its full tensor)."""
    if not hasattr(t, "to_local") or not hasattr(t, "placements"):
        return getattr(t, "_disttrace_shard", {})  # a piece an integration placed (DeepSpeed's)
    if all(p.is_replicate() for p in t.placements):
        return {}
    key = (tuple(t.shape), t.device_mesh, tuple(t.placements))
    try:
        return _shard_info(*key)
    except TypeError:  # an unhashable mesh or placement (another torch): computed every time
        return _shard_info.__wrapped__(*key)


@functools.lru_cache(maxsize=4096)
def _shard_info(shape: tuple, mesh, placements: tuple) -> dict:
    """Cached: a parameter's shape and placements are the same every step (this process's mesh coordinate
    too), so the offset is computed once per tensor, not once per tensor per step."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return {"shard": {"offset": list(offset), "logical_shape": list(shape)}}


def tensor_leaves(obj, prefix: str = ""):
    """(dotted name, tensor) for every tensor in nested dicts, lists and tuples (a state dict, a module's
    output, a collective's argument), in their (deterministic) order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensor_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_leaves(v, f"{prefix}.{i}" if prefix else str(i))


# checkpoint files' records sort after every saved tensor and keep their index whatever was saved, so a
# checkpoint missing tensors (optimizer-reset) shows those tensors missing, not every later record shifted
FILE_INDEX = 1 << 20


class _Step(NamedTuple):
    """A finished step whose device digests are on their way to the host (`fetch`)."""

    step: int
    records: list
    time: dict
    waiting: list  # (record, row of the step's device digests)
    fetch: object


class Recorder:
    ORDER = 90  # after faults (10): the record shows what the fault did

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        every: int = 1,
        forward: bool = True,
        reuse: bool | None = None,
        updates: bool = True,
    ):
        self.rank = rank
        self.every = (
            every  # record.every: digest steps every, 2*every, ... (diff compares those both hold)
        )
        self.forward = forward  # record.forward: each block's output
        self._on = True
        self.traj = TrajectoryWriter(Path(run_dir) / rank_file("trajectory", rank, SUFFIX))
        self.index = JsonlWriter(Path(run_dir) / rank_file("trajectory", rank, ".steps.jsonl"))
        self._buf: list[dict] = []
        self._t: dict[str, float] = {}
        self.chain = StepChain(rank)
        # device tensors: digested in batches on the device and written a step late (run/record/devdigest.py)
        self._device = devdigest.DeviceDigests()
        self._force_device = devdigest.forced()
        self._waiting: list[tuple[dict, int]] = []  # (record, row of this step's device digests)
        self._pending: _Step | None = (
            None  # the step whose device digests are on their way to the host
        )
        # host tensors whose bytes were digested lately are hashed only (digest.Seen); reuse=False (or
        # DISTTRACE_DIGEST_REUSE=0) digests every one in full: bench/overhead.py's baseline, the tests' oracle
        if reuse is None:
            reuse = os.environ.get("DISTTRACE_DIGEST_REUSE") != "0"
        self._seen = Seen() if reuse else None
        # record.updates: each parameter's largest |update| (run/record/updates.py); a copy of the parameters
        self._updates = Updates() if updates else None

    def attach(self, bus: HookBus) -> Recorder:
        bus.on(
            "step_start", self._write_arrived, 1
        )  # before any fault at step_start can end the process
        bus.on("step_start", self._step_start, self.ORDER)
        bus.on("data", self._data, self.ORDER)
        if self.forward:
            bus.on("forward", self._forward, self.ORDER)
        bus.on("loss", self._loss, self.ORDER)
        bus.on("backward", self._grads("backward"), self.ORDER)
        bus.on("reduce", self._grads("reduce"), self.ORDER)
        bus.on("clip", self._clip, self.ORDER)
        bus.on("before_optimizer", self._before_optimizer, self.ORDER)
        bus.on("optimizer", self._optimizer, self.ORDER)
        bus.on("before_checkpoint", self._saved_state, self.ORDER)
        bus.on("checkpoint", self._saved_files, self.ORDER)
        bus.on("step_end", self._step_end, self.ORDER)
        bus.on("process_exit", lambda bus, p: self.flush(), self.ORDER)
        return self

    # ---------------------------------------------------------- records
    def add(
        self,
        bus: HookBus,
        phase: str,
        index: int,
        name: str,
        tensor,
        micro_batch: int | None = None,
        **extra,
    ):
        """One tensor's record (`add_all` for a hook's list)."""
        if not self._on:
            return
        self._records(bus, phase, [(index, name, tensor)], micro_batch=micro_batch, extra=extra)

    def add_all(self, bus: HookBus, phase: str, refs, base: int = 0, recheck: bool = False) -> None:
        """`add` for a hook's list of (index, name, tensor): the dispatch modes left once for all of them, the
        small host tensors digested together (digest_many), device tensors queued (devdigest).
        `recheck`: tensors likely rewritten with the bytes they had (digest.Seen)."""
        if not self._on:
            return
        self._records(bus, phase, list(refs), base=base, recheck=recheck)

    def _records(
        self,
        bus,
        phase,
        refs,
        base: int = 0,
        micro_batch: int | None = None,
        extra=None,
        recheck: bool = False,
    ) -> None:
        # the digest's own tensor ops are not the job's: keep them out of the collective tracer's mode
        # (which otherwise sees, and costs, every one of them)
        with no_dispatch_modes():
            shards, places = [], []
            for _, _, t in refs:
                s = shard_info(t)
                shards.append(s)
                piece = s.get("shard") if s else None
                places.append(
                    (t, piece.get("offset"), piece.get("logical_shape"))
                    if piece
                    else (t, None, None)
                )
            mb = bus.micro_batch if micro_batch is None else micro_batch
            head = {"step": bus.step, "micro_batch": mb, "phase": phase, "rank": self.rank}
            buf = self._buf
            for (index, name, _), d, s in zip(refs, self._digests(places, recheck), shards):
                # the fields in the order they always had: the record's place, then its digest's
                # an int: a row of this step's device digests, filled in when they arrive
                if isinstance(d, int):
                    rec = {**head, "index": base + index, "tensor": name, **s, **(extra or {})}
                    self._waiting.append((rec, d))
                else:
                    rec = {**head, "index": base + index, "tensor": name, **s, **(extra or {}), **d}
                buf.append(rec)

    def _digests(self, places: list[tuple], recheck: bool = False) -> list:
        """Per (tensor, offset, logical shape): the digest dict of a host tensor, the row of a device one."""
        # devdigest.wanted of each: CUDA tensors, or every one when forced
        on_device = (
            [True] * len(places) if self._force_device else [t.is_cuda for t, _, _ in places]
        )
        if not any(on_device):
            return digest_many(places, self._seen, recheck)
        rows = iter(self._device.add([p for p, dev in zip(places, on_device) if dev]))
        host = iter(
            digest_many([p for p, dev in zip(places, on_device) if not dev], self._seen, recheck)
        )
        return [next(rows) if dev else next(host) for dev in on_device]

    def _step_start(self, bus, p):
        self._on = bus.step % self.every == 0
        self._t = {"start": time.time()}
        if self._seen is not None:
            self._seen.next_step()

    def _data(self, bus, p):
        self.add(bus, "data", 0, "inputs", p.batch.inputs, samples=list(p.batch.sample_ids))

    def _forward(self, bus, p):
        self.add(bus, "forward", p.index, p.name, p.tensor)

    def _loss(self, bus, p):
        self.add(bus, "loss", 0, "loss", p.loss, tokens=int(p.tokens))

    def _grads(self, phase):
        def handler(bus, p):
            if phase == "backward" and "collective_issue" not in self._t and p.before_collective:
                self._t["collective_issue"] = time.time()
            self.add_all(bus, phase, p.grads)

        return handler

    def _clip(self, bus, p):
        # a coefficient of 1 multiplies the reduced gradients into the bytes they had (their version moves on)
        coef = next((t for _, n, t in p.scalars if n == "clip_coef"), None)
        unchanged = (
            coef is not None
            and not hasattr(coef, "to_local")
            and coef.device.type == "cpu"
            and coef.numel() == 1
            and float(coef) == 1.0
        )
        # the scalars first in the phase's order, as they were computed (store/records.py, CLIP_GRAD_BASE)
        self.add_all(bus, "clip", p.grads, base=CLIP_GRAD_BASE, recheck=unchanged)
        self.add_all(bus, "clip", p.scalars)

    def _before_optimizer(self, bus, p):
        if self._on and self._updates is not None:
            self._updates.before(p.params)

    def _optimizer(self, bus, p):
        self.add_all(bus, "optimizer", p.params)
        # the updates after the state, each in its parameter's last state slot (run/record/updates.py)
        updates = [] if self._updates is None else self._updates.after(p.params, p.optimizer)
        state = [*p.state, *updates]
        self.add_all(bus, "optimizer", state, base=len(p.params))

    # the `checkpoint` phase: what was saved, so diff sees a checkpoint that differs from the reference's
    def _saved_state(self, bus, p):
        """Each tensor handed to DCP (after any fault at before_checkpoint); per-rank RNG entries are left
        out (they are not the experiment's state)."""
        n = 0
        for name, t in tensor_leaves(p.state):
            if not name.startswith("rng/"):
                self.add(bus, "checkpoint", n, name, t)
                n += 1

    def _saved_files(self, bus, p):
        """The bytes this rank wrote, read back from the published checkpoint (after any fault at
        `checkpoint`): a shard file damaged on disk differs here though every tensor above was right.
        Bytes have no float statistics (sum/norm null): only the digest compares them, so a numeric diff
        of two runs that round differently leaves them to the tensor records above."""
        import xxhash

        if not self._on:
            return
        for i, f in enumerate(sorted(Path(p.path).glob(f"__{self.rank}_*.distcp"))):
            data = f.read_bytes()
            self._buf.append(
                {
                    "step": bus.step,
                    "micro_batch": bus.micro_batch,
                    "phase": "checkpoint",
                    "rank": self.rank,
                    "index": FILE_INDEX + i,
                    "tensor": f"file:{f.name}",
                    "dtype": "bytes",
                    "shape": [len(data)],
                    "numel": len(data),
                    "digest": xxhash.xxh3_128_hexdigest(data),
                    "sum": None,
                    "norm": None,
                    "nonfinite": 0,
                }
            )

    def step_records(self) -> list[dict]:
        """The current step's records with their digests (the live check reads them before the step is
        written): device digests are fetched now, which waits for the device."""
        self._resolve(self._waiting, self._device.collect() if self._waiting else None)
        self._waiting = []
        return self._buf

    def _step_end(self, bus, p):
        if not self._on:  # a step record.every leaves out: no records, no index line
            self._buf, self._waiting = [], []
            return
        t = {**self._t, "end": time.time()}
        if p.spans:
            t["spans"] = p.spans
        step = _Step(
            bus.step, self._buf, t, self._waiting, self._device.collect() if self._waiting else None
        )
        self._buf, self._waiting = [], []
        self._write_pending()  # the step before this one first: its device digests arrived long ago
        if step.fetch is None:
            self._write(step.step, step.records, step.time)
        else:
            self._pending = step

    def _write_arrived(self, bus, p) -> None:
        """The step before, written as soon as its device digests are on the host (never waiting for them)."""
        if self._pending is not None and self._pending.fetch.ready():
            self._write_pending()

    def _write_pending(self) -> None:
        if self._pending is not None:
            p, self._pending = self._pending, None
            self._resolve(p.waiting, p.fetch)
            self._write(p.step, p.records, p.time)

    @staticmethod
    def _resolve(waiting: list[tuple[dict, int]], fetch) -> None:
        if fetch is not None:
            digests = fetch.result()
            for rec, row in waiting:
                rec.update(digests[row])

    def _write(self, step: int, records: list[dict], t: dict) -> None:
        records.sort(key=lambda r: (r["micro_batch"], PHASE_ORDER[r["phase"]], r["index"]))
        offset = self.traj.offset
        data = self.traj.write_step(records)  # one Arrow record batch (store/trajectory.py)
        # the step's raw bytes hashed and chained to the previous step (disttrace.store.seal)
        entry = StepIndexEntry(
            step=step,
            offset=offset,
            length=len(data),
            records=len(records),
            digest=digest_of_digests([r["digest"] for r in records]),
            time=t,
            sketch=SKETCH_VERSION,
        )
        self.index.write(self.chain.seal_entry(entry.line(), data))
        self.index.flush()

    def flush(self) -> None:
        """Write the finished step still awaiting its device digests (waiting for them): the process is about to
        end before the next step would have written it. The step in progress stays unwritten: it never ended."""
        self._write_pending()

    def close(self):
        self.flush()
        self.traj.close()
        self.index.close()
