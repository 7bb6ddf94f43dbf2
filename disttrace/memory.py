"""The memory ledger: per rank and step, bytes of parameters, gradients and optimizer state this rank
holds (for a sharded strategy the local shard), activations saved for backward, and the peak.

Activations are counted with saved-tensor hooks (every tensor autograd keeps for backward, counted once
per storage); the peak is the CUDA allocator's on GPU and the tracked sum on CPU. The prediction next to
each line comes from disttrace.plan (the ZeRO formulas and the activation estimate).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .store import JsonlWriter, rank_file


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
        from .parallel.common import local_optimizer_state_tensors

        optim = sum(_local_bytes(v) for v in local_optimizer_state_tensors(s.optimizer))
        model_state = params + grads + optim
        rec = {"step": bus.step, "rank": self.rank, "params": params, "grads": grads, "optimizer": optim,
               "model_state": model_state, "activations_saved": self._peak_act,
               "peak_tracked": model_state + self._peak_act}
        if torch.cuda.is_available():
            rec["peak_allocator"] = int(torch.cuda.max_memory_allocated())
        self.out.write(rec)
        self.out.flush()

    def close(self):
        self.out.close()
