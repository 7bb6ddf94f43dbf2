"""The memory ledger: per rank and step, bytes of parameters, gradients and optimizer state this rank
holds (for a sharded strategy the local shard), activations saved for backward, and the peak.

Measured, not computed from shapes: every storage reachable from the model (parameters, gradients,
registered buffers and tensors kept as plain module attributes), the optimizer (its state and its own
parameter copies) and the engine (DDP's bucket buffers, as its comm hook hands them to the `backward`
point; FSDP2's unsharded parameters and all-gather outputs) is counted once, by its untyped storage's
data_ptr, at its allocated size (`nbytes`, padding included). Beside it the process's resident memory
(/proc/self/statm) and, on a GPU, the allocator's current and peak bytes. The prediction next to each
line comes from disttrace.plan.costs (the ZeRO formulas); `gap_bytes` names each measured difference.

Activations are counted with saved-tensor hooks (every tensor autograd keeps for backward, counted once
per storage).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict

from disttrace.config.manifest import Manifest
from disttrace.store.documents import MemoryGap, MemoryLine, ModelStateBytes
from disttrace.store.rundir import rank_file
from disttrace.store.writers import JsonlWriter

CATEGORIES = ("params", "grads", "optimizer", "buffers", "unregistered", "engine")


class _Read(BaseModel):
    # read from a Manifest's attributes, or from the dict an attached run builds (run/attach/)
    model_config = ConfigDict(from_attributes=True, extra="ignore", frozen=True)


class LedgerParallelism(_Read):
    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    architecture: str = "allreduce"


class LedgerTraining(_Read):
    dtype: str
    optimizer: str


class LedgerLayout(_Read):
    """What the ledger needs of a manifest: the layout and the precision and optimizer of the formula."""

    parallelism: LedgerParallelism
    training: LedgerTraining


@dataclass(frozen=True)
class Measured:
    """Bytes of the distinct storages of each category (CATEGORIES)."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    unregistered: int
    engine: int


class StorageCount:
    """Distinct storages by category: a storage seen twice (a view, a tensor shared by two owners) counts
    once, under the first category that reached it (in CATEGORIES order)."""

    def __init__(self):
        self.seen: dict[int, str] = {}
        self.bytes = dict.fromkeys(CATEGORIES, 0)  # category -> bytes, filled by `add`

    def measured(self) -> Measured:
        return Measured(**self.bytes)

    def add(self, category: str, t) -> None:
        if t is None or not torch.is_tensor(t):
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        try:
            st = t.untyped_storage()
            ptr, n = st.data_ptr(), st.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (fakes, wrappers)
            return
        if (
            n == 0 or ptr in self.seen
        ):  # freed (FSDP2 resizes unsharded storages to 0) or already counted
            return
        self.seen[ptr] = category
        self.bytes[category] += n

    def add_storage(self, category: str, ptr: int, nbytes: int) -> None:
        if nbytes and ptr not in self.seen:
            self.seen[ptr] = category
            self.bytes[category] += nbytes

    def total(self) -> int:
        return sum(self.bytes.values())


def _tensors_in(obj, depth: int = 0):
    if torch.is_tensor(obj):
        yield obj
    elif depth < 4 and isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v, depth + 1)
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v, depth + 1)


def fsdp2_param_groups(model) -> list:
    """FSDP2's parameter groups of a model ([] when it is not sharded with FSDP2). They are fixed once
    fully_shard ran, so a ledger finds them once, not on every sample (private attributes of torch
    2.5-2.13; absent ones are skipped)."""
    groups = []
    for m in model.modules():
        get_state = getattr(m, "_get_fsdp_state", None)
        if get_state is None:
            continue
        try:
            groups.append(get_state()._fsdp_param_group)
        except Exception:  # noqa: BLE001  -- not an FSDP2 module after all
            continue
    return groups


def fsdp2_engine_tensors(groups: list):
    """FSDP2's own buffers, read fresh: each FSDPParam's unsharded parameter and all-gather outputs."""
    for group in groups:
        for fp in getattr(group, "fsdp_params", None) or []:
            for name in ("_unsharded_param", "_unsharded_inner_tensors"):
                yield from _tensors_in(getattr(fp, name, None))
            yield from _tensors_in(getattr(fp, "all_gather_outputs", None))


def measure(model, optimizer, engine_storages=(), engine_tensors=()) -> StorageCount:
    """Count the distinct storages reachable from `model`, `optimizer` and the engine."""
    c = StorageCount()
    params = list(model.parameters())
    for p in params:
        c.add("params", p)
    for p in params:
        c.add("grads", p.grad)
    local = getattr(
        optimizer, "optim", optimizer
    )  # ZeroRedundancyOptimizer keeps its partition's in .optim
    for st in getattr(local, "state", {}).values():
        for t in _tensors_in(st):
            c.add("optimizer", t)
    for group in getattr(
        local, "param_groups", []
    ):  # an optimizer's own parameter copies (the PS master)
        for p in group.get("params", []):
            c.add("optimizer", p)
            c.add("optimizer", p.grad)
    for b in model.buffers():
        c.add("buffers", b)
    for m in (
        model.modules()
    ):  # tensors a module keeps as plain attributes: neither parameter nor buffer
        for v in vars(m).values():
            for t in _tensors_in(v, 2):
                c.add("unregistered", t)
    for ptr, nbytes in engine_storages:
        c.add_storage("engine", ptr, nbytes)
    for t in engine_tensors:
        c.add("engine", t)
    return c


def resident_bytes() -> int | None:
    """The process's resident set (Linux /proc/self/statm, else getrusage's peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
        except (ImportError, OSError):
            return None


class MemoryLedger:
    ORDER = 91

    def __init__(self, run_dir: Path, rank: int, manifest: Manifest | dict, strategy):
        self.out = JsonlWriter(Path(run_dir) / rank_file("memory", rank))
        self.rank = rank
        self.layout = LedgerLayout.model_validate(manifest)
        self.strategy = strategy
        self._saved: dict = {}
        self._saved_total = 0
        self._peak_act = 0
        self._groups: list | None = None  # FSDP2's parameter groups, found on first use
        self._hooks = None
        self.predicted = predict_model_state(self.layout, strategy)

    def attach(self, bus):
        bus.on("step_start", self._start, self.ORDER)
        bus.on("data", self._new_micro_batch, self.ORDER)
        bus.on("backward", self._engine_buffers, self.ORDER)
        bus.on("loss", self._sample_engine, self.ORDER)
        bus.on("reduce", self._sample_engine, self.ORDER)
        bus.on("step_end", self._end, self.ORDER)
        return self

    def _engine_buffers(self, bus, p):
        """DDP's comm hook hands the bucket's gradients, views into the bucket buffer: its storage is the
        engine's copy of the gradients (unless gradient_as_bucket_view makes it the .grad itself)."""
        if not p.before_collective:
            return
        for entry in p.grads:
            g = entry[2]
            if g is not None and torch.is_tensor(g) and not hasattr(g, "to_local"):
                st = g.untyped_storage()
                self._engine[st.data_ptr()] = st.nbytes()

    def _sample_engine(self, bus, p):
        """FSDP2's unsharded parameters exist between its all-gather and reshard: sample them after the
        forward (`loss`) and after the reduce; the step's largest sample is `engine_peak`."""
        n = 0
        seen: set = set()
        for t in fsdp2_engine_tensors(self._fsdp_groups()):
            try:
                st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
        self._engine_peak = max(self._engine_peak, n + sum(self._engine.values()))

    def _fsdp_groups(self) -> list:
        if self._groups is None:
            self._groups = fsdp2_param_groups(self.strategy.plain)
        return self._groups

    def _pack(self, t):
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
            if (
                key not in self._saved
            ):  # a running total: this hook runs for every tensor autograd saves
                self._saved[key] = st.nbytes()
                self._saved_total += self._saved[key]
                self._peak_act = max(self._peak_act, self._saved_total)
        except (
            RuntimeError,
            NotImplementedError,
        ):  # tensors without storage (DTensor wrappers, fakes)
            pass
        return t

    def _new_micro_batch(self, bus, p):
        self._saved, self._saved_total = (
            {},
            0,
        )  # the previous micro-batch's activations were freed by its backward

    def _start(self, bus, p):
        self._saved, self._saved_total, self._peak_act = {}, 0, 0
        self._engine, self._engine_peak = {}, 0  # DDP rebuilds its buckets after the first step
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _end(self, bus, p):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        s = self.strategy
        c = measure(
            s.plain, s.optimizer, self._engine.items(), fsdp2_engine_tensors(self._fsdp_groups())
        )
        b = c.measured()
        model_state = b.params + b.grads + b.optimizer
        pred = self.predicted
        total = c.total()
        gaps = measured_gaps(self.layout, s, b, pred)
        gpu = (
            {
                "allocated": int(torch.cuda.memory_allocated()),
                "peak_allocator": int(torch.cuda.max_memory_allocated()),
            }
            if torch.cuda.is_available()
            else {}
        )
        row = MemoryLine(
            step=bus.step,
            rank=self.rank,
            params=b.params,
            grads=b.grads,
            optimizer=b.optimizer,
            model_state=model_state,
            buffers=b.buffers,
            unregistered=b.unregistered,
            engine=b.engine,
            engine_peak=max(self._engine_peak, b.engine),
            measured_total=total,
            storages=len(c.seen),
            activations_saved=self._peak_act,
            peak_tracked=total + self._peak_act,
            resident=resident_bytes(),
            predicted=pred,
            ratio_model_state=round(model_state / pred.total, 4) if pred.total else None,
            ratio_total=round(total / pred.total, 4) if pred.total else None,
            gap=[f"{g.what}: {g.bytes:+d} B" + (f" ({g.why})" if g.why else "") for g in gaps],
            gap_bytes=gaps,
            **gpu,
        )
        self.out.write(row.line())
        self.out.flush()

    def close(self):
        self.out.close()


def predict_model_state(manifest: LedgerLayout, strategy) -> ModelStateBytes:
    """The ZeRO formula for this strategy, in the dtype actually used (disttrace.plan.costs)."""
    from disttrace.plan.costs import model_state_bytes

    par, tr = manifest.parallelism, manifest.training
    psi = sum(
        p.numel() for p in strategy.plain.parameters()
    )  # a DTensor's numel is the logical one
    psi = -(-psi // par.tp)  # tensor parallel divides the model before ZeRO shards it
    precision = {"float32": "fp32", "float64": "fp64"}.get(tr.dtype, "mixed")
    optimizer = "adam" if tr.optimizer == "adamw" else tr.optimizer
    stage = par.zero_stage if par.tp == 1 else 3  # dp x tp shards over dp with FSDP2 (ZeRO-3 style)
    return ModelStateBytes.model_validate(
        model_state_bytes(psi, par.dp, stage, optimizer, precision)
    )


def measured_gaps(
    manifest: LedgerLayout, strategy, b: Measured, pred: ModelStateBytes
) -> list[MemoryGap]:
    """Each difference between measured and predicted bytes, named."""
    par = manifest.parallelism
    out = []
    if b.engine:
        what = (
            "DDP bucket copy of the gradients"
            if par.zero_stage < 2
            and par.tp == 1
            and par.pp == 1
            and par.architecture != "parameter-server"
            else "engine buffers (FSDP2 unsharded parameters)"
        )
        out.append(MemoryGap(what=what, bytes=b.engine))
    if b.buffers:
        out.append(MemoryGap(what="model buffers (RoPE tables; not model state)", bytes=b.buffers))
    if b.unregistered:
        out.append(
            MemoryGap(
                what="tensors kept as plain module attributes (neither parameter nor buffer)",
                bytes=b.unregistered,
            )
        )
    for key, what, measured, predicted in (
        ("params", "parameters", b.params, pred.params),
        ("grads", "gradients", b.grads, pred.grads),
        ("optimizer", "optimizer state", b.optimizer, pred.optimizer),
    ):
        d = measured - predicted
        if d:
            why = explain_gap(manifest, b.params, b.grads, b.optimizer, pred, only=key)
            out.append(
                MemoryGap(what=f"{what} vs the formula", bytes=d, why="; ".join(why) or None)
            )
    return out


def explain_gap(
    manifest: LedgerLayout,
    params: int,
    grads: int,
    optim: int,
    pred: ModelStateBytes,
    only: str | None = None,
) -> list[str]:
    """Name the differences between measured and predicted that we can explain (`only`: those of one
    category, params, grads or optimizer, each note starting with its name)."""
    if only is not None:
        return [n for n in explain_gap(manifest, params, grads, optim, pred) if n.startswith(only)]
    notes = []
    if optim > pred.optimizer:
        notes.append(
            f"optimizer +{optim - pred.optimizer} B: Adam's per-parameter step counters (scalars) "
            "are not in the formula"
        )
    if params < pred.params and manifest.parallelism.zero_stage == 2:
        notes.append(
            "params: FSDP2 frees the gathered parameters after backward; ZeRO-2's resident copy exists "
            "during forward+backward only, and this line is measured after the optimizer step"
        )
    if manifest.parallelism.tp > 1 and params > pred.params:
        notes.append(
            f"params +{params - pred.params} B: tensor parallel keeps norm weights whole on every tp "
            "rank (replicated); the formula divides all of Psi by tp"
        )
    if grads < pred.grads:
        notes.append(
            f"grads -{pred.grads - grads} B: gradients freed or not yet allocated when measured"
        )
    return notes
