"""Where an attached run is in the user's training step: the step's state, and the step closed and the next
opened. The hooks (points.py) move it; the user's calls read it."""

from __future__ import annotations

import torch

from disttrace.run.job.complete import gather_released
from disttrace.run.job.hooks import StepEnd, StepStart
from disttrace.store.jsonlines import read_json
from disttrace.store.rundir import LOCK
from disttrace.store.writers import write_json_atomic


class StepCycle:
    """The step cycle of an attached run (a mixin of AttachedRun). A step opens at attach (or at the first
    forward after the optimizer stepped), counts its forwards as micro-batches, records its reduce once
    (at the first clip, scalar or optimizer step that needs the final gradients) and its clip once, and
    closes at the next forward, checkpoint or close after the optimizer stepped."""

    def _start_cycle(self) -> None:
        self.step = 1
        self._forwards = 0  # forwards of the model since the last optimizer step: the micro-batches
        self._data_mb: set[int] = set()  # micro-batches whose data record is written
        # a backward pass reported by DDP's comm hook; its end-of-backward callback queued; the step's
        # reduce and clip recorded
        self._comm_fired = self._bw_queued = self._reduced = self._clipped = False
        # samples this rank's micro-batches of the current step held (None: one could not be counted), and
        # the first completed step's count: the experiment's global batch is summed from it at close
        self._samples: int | None = 0
        self._tokens: int | None = (
            0  # and the tokens they held (the numeric bound's reduction size)
        )
        self._observed: dict | None = None
        self.completed = 0  # the last step whose optimizer stepped
        # inside our own checkpoint load/save: DCP's helpers may step the optimizer
        self._paused = False
        # the optimizer has stepped; the step's records close at the next forward
        self._stepped = False
        self._closed = False

    def _count(self, inputs) -> None:
        """Add a micro-batch's samples (its data tensor's leading dimension) to the step's count, and its
        tokens (`tokens_of`) to the step's tokens."""
        if self.depth is not None:
            self.depth.saw_batch(inputs)
        if self._tokens is not None:
            n = tokens_of(inputs)
            self._tokens = self._tokens + n if n is not None else None
        if self._samples is None:
            return
        if torch.is_tensor(inputs) and inputs.dim() >= 1:
            self._samples += int(inputs.shape[0])
        else:
            self._samples = None

    def _finish_step(self, start_next: bool = True):
        """Close the stepped step (its records are written) and open the next; deferred from the optimizer
        step to the next forward so a checkpoint saved right after the step belongs to it."""
        if not self._stepped:
            return
        self._stepped = False
        self.bus.emit(StepEnd())
        if not start_next:
            return
        self.step += 1
        self._forwards = 0
        self._data_mb = set()
        self._reduced = self._clipped = False
        self._samples = self._tokens = 0
        self.bus.step, self.bus.micro_batch = self.step, 0
        self.bus.emit(StepStart())

    def _write_observed(self, dist) -> None:
        """Collective: every rank's first completed step's sample count to rank 0, which writes the global
        batch it sums to into the lock (as `observed`, beside the manifest the id was taken of), before the
        seal hashes the lock."""
        mine = self._observed or {"step": None, "samples": None, "micro_batches": 0}
        parts = [mine]
        if dist is not None:
            parts = [None] * dist.get_world_size()
            gather_released(dist, parts, mine)
        if self.rank != 0:
            return
        topo = read_json(self.run_dir / "topology.json")
        observed = observed_batch(parts, topo["groups"]["tp"])
        lock = read_json(self.run_dir / LOCK)
        lock["observed"] = observed
        write_json_atomic(self.run_dir / LOCK, lock)


def observed_batch(parts: list[dict], tp_groups: list[list[int]]) -> dict:
    """The global batch an attached job ran, from each rank's count of its first completed step (`parts`,
    by rank): the ranks of a tensor-parallel group read one batch, so each group counts once (its first
    rank's; the replica check's data rule holds the others to it), and the groups' counts are summed. None,
    with why, when a rank counted nothing or the group's ranks stepped at different steps."""
    per_rank = {str(r): p.get("samples") for r, p in enumerate(parts)}
    doc = {
        "global_batch": None,
        "step": parts[0].get("step") if parts else None,
        "samples": per_rank,
        "micro_batches": {str(r): p.get("micro_batches") for r, p in enumerate(parts)},
    }
    if not parts or any(p.get("step") is None for p in parts):
        doc["why"] = "a rank completed no optimizer step"
        return doc
    if len({p["step"] for p in parts}) > 1:
        doc["why"] = "the ranks' first completed steps differ"
        return doc
    counts = [parts[g[0]].get("samples") for g in tp_groups]
    if any(c is None for c in counts):
        doc["why"] = "a micro-batch's input had no leading dimension to count"
        return doc
    doc["global_batch"] = sum(counts)
    # the numeric bound's reduction size (analysis/tolerance.py): the tokens one step summed over, where
    # every group counted them
    tokens = [parts[g[0]].get("tokens") for g in tp_groups]
    if all(isinstance(t, int) and t >= 1 for t in tokens):
        doc["tokens"] = sum(tokens)
    return doc


def tokens_of(inputs) -> int | None:
    """The tokens of a micro-batch's data tensor: every element of integer inputs (token ids), every vector
    of floating ones (the last dimension is a token's features; a 1-D tensor is one value a sample); None
    for anything else."""
    if not torch.is_tensor(inputs) or inputs.dim() < 1:
        return None
    if not (torch.is_floating_point(inputs) or torch.is_complex(inputs)):
        return int(inputs.numel())
    if inputs.dim() == 1:
        return int(inputs.shape[0])
    return int(inputs.numel() // max(int(inputs.shape[-1]), 1))
