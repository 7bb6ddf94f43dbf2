"""Attribution of a divergence at one step: persistent, transient, device, not replayable, or none.

`disttrace replay RUN --step S` re-executes RUN from its last verified checkpoint before S into a replay store
of its own (path `replay`, run.json's `replay` names RUN, the step, the rank shift). This module decides what
the three stores show, reading only their trajectories (and where each rank ran, from topology.json), never
the fault log or the fault's declared nature (docs/replay.md):

1. the replayed steps before S must equal RUN's stored ones record for record, bit for bit; else the run is
   **not replayable** (it is not deterministic from its checkpoint, or its store is not what its code
   computes), and the first differing record is named;
2. RUN agrees with the reference at S: **none** (nothing to attribute; the replay must still reproduce S);
3. the replay reproduces RUN's stored step S bit for bit: **persistent** (a deterministic cause: code, data or
   configuration, or, without --permute-ranks, a device the replay ran on again);
4. the replay agrees with the reference at S instead: **transient** (the stored step does not recur on the
   same code and inputs);
5. with --permute-ranks, the replay differs from both, and its first divergence from the reference is on
   another logical rank that ran on the slot the stored divergence's rank held: **device**, naming the slot;
6. anything else: **not replayable** (the evidence names no cause), never a guess.

No torch here (a reader): the replay's job is run by lab/replay.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from disttrace.analysis.result import DiffResult
from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.store.documents import ReplaySpec
from disttrace.store.records import PHASE_ORDER
from disttrace.store.rundir import Run

ATTRIBUTIONS = ("persistent", "transient", "device", "not-replayable", "none")


@dataclass
class RecordAt(JsonDoc):
    """One record's coordinates (docs/design.md, "Order"), and the two sides' digests where they differ."""

    step: int
    micro_batch: int
    phase: str
    rank: int
    tensor: str | None
    stored: str | None = omit_none()  # the digest RUN's store holds (None: no such record there)
    replayed: str | None = omit_none()

    def line(self) -> str:
        what = f"step {self.step} micro-batch {self.micro_batch} {self.phase} rank {self.rank}"
        return what + (f" {self.tensor}" if self.tensor else "")


@dataclass
class Slot(JsonDoc):
    """A physical slot: node, local slot (the CUDA device index on a GPU), as the job's topology.json says."""

    index: int  # node * processes per node + local slot: the launch order of the slots
    node: int
    local: int
    host: str | None = None

    def line(self) -> str:
        return f"slot {self.index} (node {self.node}, local slot {self.local}" + (
            f", host {self.host})" if self.host else ")"
        )


@dataclass
class Against(JsonDoc):
    """One side compared with the reference at the replayed step."""

    equal: bool
    first: RecordAt | None = (
        omit_none()
    )  # its first divergence at the step (rank always; more when known)
    slot: Slot | None = omit_none()  # where that rank ran


@dataclass
class ReplayResult(JsonDoc):
    """What `disttrace replay --json` prints."""

    run: str
    replay: str  # the replay's run directory
    reference: str | None
    step: int
    from_checkpoint: int  # 0: the manifest's initial state
    replayed_steps: list[int]
    permute_ranks: bool
    rank_shift: int | None
    reproduces: (
        bool | None
    )  # the replay's step equals RUN's stored step bit for bit (None: not reached)
    matches_reference: bool | None
    stored: Against | None  # RUN's stored step against the reference
    replayed: Against | None  # the replay's step against the reference
    attribution: str
    slot: Slot | None = omit_none()  # for `device`
    first_difference: RecordAt | None = (
        omit_none()
    )  # not replayable: the first record that did not reproduce
    reason: str = ""

    @property
    def replayable(self) -> bool:
        return self.attribution != "not-replayable"


# ---------------------------------------------------------------- evidence


def _key(rec: dict) -> tuple:
    return (
        rec.get("micro_batch") or 0,
        PHASE_ORDER.get(str(rec.get("phase")), len(PHASE_ORDER)),
        rec.get("rank") or 0,
        rec.get("index") if isinstance(rec.get("index"), int) else -1,
        str(rec.get("tensor")),
    )


def first_difference(stored: Run, replayed: Run, step: int) -> RecordAt | None:
    """The first record (in the order of docs/design.md) of `step` whose every field is not the same in
    both, or that exists on one side only, over every rank of both; None when the step is the same."""
    ranks = sorted(set(stored.ranks()) | set(replayed.ranks()))
    a = {_key(r): r for rank in ranks for r in stored.checked_step_records(rank, step)}
    b = {_key(r): r for rank in ranks for r in replayed.checked_step_records(rank, step)}
    if not a and not b:
        return None
    for k in sorted(set(a) | set(b)):
        ra, rb = a.get(k), b.get(k)
        if ra is not None and rb is not None and _same(ra, rb):
            continue
        r = ra or rb
        return RecordAt(
            step=step,
            micro_batch=int(r.get("micro_batch") or 0),
            phase=str(r.get("phase")),
            rank=int(r.get("rank") or 0),
            tensor=r.get("tensor"),
            stored=None if ra is None else str(ra.get("digest")),
            replayed=None if rb is None else str(rb.get("digest")),
        )
    return None


def _same(a: dict, b: dict) -> bool:
    return orjson.dumps(a, option=orjson.OPT_SORT_KEYS) == orjson.dumps(
        b, option=orjson.OPT_SORT_KEYS
    )


def slot_of(run: Run, rank: int) -> Slot | None:
    """Where `rank` ran in `run`, from its topology.json (written from each process's environment)."""
    topo = run.topology()
    if topo is None or not topo.as_read():  # an empty document holds no topology either
        return None
    me = next((r for r in topo.ranks if r.rank == rank), None)
    if me is None:
        return None
    per_node = sum(1 for r in topo.ranks if r.node_rank == me.node_rank)
    return Slot(
        index=me.node_rank * per_node + me.local_rank,
        node=me.node_rank,
        local=me.local_rank,
        host=me.host,
    )


def at_step(d: DiffResult, step: int, run: Run) -> Against:
    """A diff of (reference, X) read at one step: equal there, and X's first divergent record there."""
    f = d.first_divergence
    if f is None or f.step > step:
        return Against(equal=True)
    if f.step == step:
        first = RecordAt(
            step=step, micro_batch=f.micro_batch, phase=f.phase, rank=f.rank, tensor=f.tensor
        )
        return Against(equal=False, first=first, slot=slot_of(run, f.rank))
    entry = next((e for e in d.propagation if e.step == step), None)
    if entry is None or entry.equal:
        return Against(equal=True)
    # diverged before the step: the first rank that differs at it (its record is not singled out)
    rank = min(r for r, e in entry.ranks.items() if e.differing)
    return Against(
        equal=False,
        first=RecordAt(step=step, micro_batch=0, phase="?", rank=rank, tensor=None),
        slot=slot_of(run, rank),
    )


# ---------------------------------------------------------------- the decision


def replay_info(replay: Run) -> ReplaySpec:
    """run.json's replay spec (what the replay re-executed); BadInput where the store is not a replay's."""
    spec = replay.run_info.replay
    if spec is None or spec.step is None:
        raise BadInput(replay.path / "run.json", "not a replay store", field="replay.step")
    return spec


def attribute(
    run_dir: Path | str, replay_dir: Path | str, reference: Path | str | None
) -> ReplayResult:
    """Compare the replay with RUN's stored steps and with the reference; decide (module docstring)."""
    from disttrace.analysis.diff import diff_runs

    run, replay = Run(run_dir), Run(replay_dir)
    spec = replay_info(replay)
    step = spec.step
    resume = replay.run_info.resume
    start = resume.step if resume is not None else 0
    shift = spec.rank_shift or None
    common = dict(
        run=str(run.path),
        replay=str(replay.path),
        reference=None if reference is None else str(reference),
        step=step,
        from_checkpoint=start,
        replayed_steps=list(range(start + 1, step + 1)),
        permute_ranks=bool(shift),
        rank_shift=shift,
    )

    def verdict(attribution, reason, **kw) -> ReplayResult:
        fields = {
            "reproduces": None,
            "matches_reference": None,
            "stored": None,
            "replayed": None,
            **kw,
        }
        return ReplayResult(**common, **fields, attribution=attribution, reason=reason)

    for s in range(start + 1, step):
        diff = first_difference(run, replay, s)
        if diff is not None:
            return verdict(
                "not-replayable",
                f"not deterministic from its checkpoint: replayed step {s} does not reproduce the stored "
                f"one, first at {diff.line()}",
                reproduces=False,
                first_difference=diff,
            )
    diff = first_difference(run, replay, step)
    reproduces = diff is None
    if reference is None:
        raise BadInput("--reference", "an attribution needs the reference run")
    stored = at_step(diff_runs(reference, run.path), step, run)
    replayed = at_step(diff_runs(reference, replay.path), step, replay)
    kw = dict(
        reproduces=reproduces,
        matches_reference=replayed.equal,
        stored=stored,
        replayed=replayed,
    )
    if stored.equal:
        if reproduces:
            return verdict(
                "none",
                f"the run agrees with the reference at step {step}: nothing to attribute",
                **kw,
            )
        return verdict(
            "not-replayable",
            f"the run agrees with the reference at step {step}, but the replay does not reproduce it: "
            f"first at {diff.line()}",
            first_difference=diff,
            **kw,
        )
    if reproduces:
        where = " (the divergence moved with the logical rank)" if shift else ""
        return verdict(
            "persistent",
            f"the stored divergence at step {step} reproduces from the checkpoint bit for bit{where}: "
            "a deterministic cause (code, data or configuration"
            + (")" if shift else ", or the hardware it ran on again: try --permute-ranks)"),
            **kw,
        )
    if replayed.equal:
        return verdict(
            "transient",
            f"the replay of step {step} matches the reference, not the stored step: a fault that did "
            "not recur on the same code and inputs",
            first_difference=diff,
            **kw,
        )
    if shift and stored.first and replayed.first and stored.slot and replayed.slot:
        moved = replayed.first.rank != stored.first.rank
        if moved and replayed.slot.index == stored.slot.index:
            return verdict(
                "device",
                f"with ranks permuted the divergence left rank {stored.first.rank} and stayed on "
                f"{stored.slot.line()}, now on rank {replayed.first.rank}: bound to the slot, not to "
                "the rank's data or code",
                slot=stored.slot,
                first_difference=diff,
                **kw,
            )
    return verdict(
        "not-replayable",
        f"the replay of step {step} reproduces neither the stored step nor the reference"
        + (", and its divergence is not on the stored divergence's slot" if shift else "")
        + f": first difference from the stored step at {diff.line()}",
        first_difference=diff,
        **kw,
    )
