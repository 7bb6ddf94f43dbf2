"""The memory ledger: per rank and step, bytes of parameters, gradients and optimizer state this rank
holds (for a sharded strategy the local shard), activations saved for backward, and the peak.

Activations are counted with saved-tensor hooks (every tensor autograd keeps for backward, counted once
per storage); the peak is the CUDA allocator's on GPU and the tracked sum on CPU. The prediction next to
each line comes from disttrace.plan.costs (the ZeRO formulas and the activation estimate).
"""

from __future__ import annotations

from pathlib import Path

import torch

from disttrace.store.rundir import JsonlWriter, rank_file


def _local_bytes(t) -> int:
    if t is None:
        return 0
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


class MemoryLedger:
    ORDER = 91

    def __init__(self, run_dir: Path, rank: int, manifest: dict, strategy):
        self.out = JsonlWriter(Path(run_dir) / rank_file("memory", rank))
        self.rank = rank
        self.manifest = manifest
        self.strategy = strategy
        self._saved: dict = {}
        self._peak_act = 0
        self._hooks = None
        self.predicted = predict_model_state(manifest, strategy)

    def attach(self, bus):
        bus.on("step_start", self._start, self.ORDER)
        bus.on("data", self._new_micro_batch, self.ORDER)
        bus.on("step_end", self._end, self.ORDER)
        return self

    def _pack(self, t):
        try:
            key = t.untyped_storage().data_ptr()
            if key not in self._saved:
                self._saved[key] = t.untyped_storage().nbytes()
                self._peak_act = max(self._peak_act, sum(self._saved.values()))
        except (RuntimeError, NotImplementedError):  # tensors without storage (DTensor wrappers, fakes)
            pass
        return t

    def _new_micro_batch(self, bus, p):
        self._saved = {}  # the previous micro-batch's activations were freed by its backward

    def _start(self, bus, p):
        self._saved, self._peak_act = {}, 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _end(self, bus, p):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        s = self.strategy
        params = sum(_local_bytes(p) for p in s.plain.parameters())
        grads = sum(_local_bytes(p.grad) for p in s.plain.parameters())
        from disttrace.run.parallel.common import local_optimizer_state_tensors

        optim = sum(_local_bytes(v) for v in local_optimizer_state_tensors(s.optimizer))
        model_state = params + grads + optim
        pred = self.predicted
        rec = {"step": bus.step, "rank": self.rank, "params": params, "grads": grads, "optimizer": optim,
               "model_state": model_state, "activations_saved": self._peak_act,
               "peak_tracked": model_state + self._peak_act,
               "predicted": pred, "ratio_model_state": round(model_state / pred["total"], 4) if pred["total"] else None,
               "gap": explain_gap(self.manifest, params, grads, optim, pred)}
        if torch.cuda.is_available():
            rec["peak_allocator"] = int(torch.cuda.max_memory_allocated())
        self.out.write(rec)
        self.out.flush()

    def close(self):
        self.out.close()


def predict_model_state(manifest: dict, strategy) -> dict:
    """The ZeRO formula for this strategy, in the dtype actually used (disttrace.plan.costs)."""
    from disttrace.plan.costs import model_state_bytes

    par, tr = manifest["parallelism"], manifest["training"]
    psi = sum(p.numel() for p in strategy.plain.parameters())  # a DTensor's numel is the logical one
    psi = -(-psi // par["tp"])  # tensor parallel divides the model before ZeRO shards it
    precision = {"float32": "fp32", "float64": "fp64"}.get(tr["dtype"], "mixed")
    optimizer = "adam" if tr["optimizer"] == "adamw" else tr["optimizer"]
    stage = par["zero_stage"] if par["tp"] == 1 else 3  # dp x tp shards over dp with FSDP2 (ZeRO-3 style)
    return model_state_bytes(psi, par["dp"], stage, optimizer, precision)


def explain_gap(manifest: dict, params: int, grads: int, optim: int, pred: dict) -> list[str]:
    """Name the differences between measured and predicted that we can explain."""
    notes = []
    if optim > pred["optimizer"]:
        notes.append(f"optimizer +{optim - pred['optimizer']} B: Adam's per-parameter step counters (scalars) "
                     "are not in the formula")
    if params < pred["params"] and manifest["parallelism"]["zero_stage"] == 2:
        notes.append("params: FSDP2 frees the gathered parameters after backward; ZeRO-2's resident copy exists "
                     "during forward+backward only, and this line is measured after the optimizer step")
    if manifest["parallelism"]["tp"] > 1 and params > pred["params"]:
        notes.append(f"params +{params - pred['params']} B: tensor parallel keeps norm weights whole on every tp "
                     "rank (replicated); the formula divides all of Psi by tp")
    if grads < pred["grads"]:
        notes.append(f"grads -{pred['grads'] - grads} B: gradients freed or not yet allocated when measured")
    return notes
