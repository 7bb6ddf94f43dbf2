"""The store's files other than the trajectory's records and the events, typed.

Each JSON document and JSON line a reader takes from a store is validated against one of these before any
field of it is used (a crafted store's one-field edit is then one line naming the file and field, exit 2,
never a KeyError deep in a view). They state what readers rely on; extra fields are kept (another
version of disttrace may add some). Readers take the model they validated (`as_read()` is the line as
stored, for documents that echo it).
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from disttrace.errors import BadInput
from disttrace.store.records import NonNegative, Number, _Line


class Check(_Line):
    """One check of the gate. passed None: not applicable (it neither passes nor fails, unless the policy
    requires every check); required False: advisory under the policy."""

    name: str
    passed: bool | None
    reason: str
    required: bool = True

    def line(self) -> dict:
        return self.model_dump()  # passed None (n/a) is written, not left out


class Verdict(_Line):
    """verdict.json, written by the gate: the decision, each check, and the policy it applied (and from whom)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    passed: bool = Field(alias="pass")
    run: str
    reference: str | None = None
    policy: dict = Field(default_factory=dict)
    checks: list[Check]
    flags: list[str] = Field(default_factory=list)
    eval: dict | None = None
    reference_eval: dict | None = None
    time: float
    replay: dict | None = None  # `gate --replay K`: the seed, the steps drawn, each re-execution
    trust: dict | None = (
        None  # what the verdict recomputed and what it took on trust (docs/trust.md)
    )
    # the attribution of a replay of the run (`disttrace replay`, docs/replay.md), recomputed by the gate
    # from the stores; left out of the document when the run has no replay
    attribution: dict | None = None

    def line(self) -> dict:
        doc = self.model_dump(
            by_alias=True
        )  # "pass" on disk and in --json, as the CLI contract says
        if doc.get("attribution") is None:
            doc.pop("attribution", None)
        return doc


_L = TypeVar("_L", bound=_Line)
Groups = dict[str, list[list[StrictInt]]]


class TopologyRank(_Line):
    rank: StrictInt = NonNegative
    host: StrictStr
    node_rank: StrictInt
    local_rank: StrictInt
    coords: dict[str, StrictInt]


class Topology(_Line):
    """topology.json: the mesh and where each rank ran (run/job/topology.py)."""

    groups: Groups = Field(default_factory=dict)
    mesh_dims: list[StrictStr] = Field(default_factory=list)
    mesh_shape: dict[str, StrictInt] = Field(default_factory=dict)
    ranks: list[TopologyRank] = Field(default_factory=list)
    world_size: StrictInt | None = None
    engine: StrictStr | None = None  # an attached run's (run/attach/replicas.py)

    @model_validator(mode="after")
    def _mesh(self):
        """Sizes of at least 1 whose product is the number of ranks listed, every rank's coordinates inside
        them: what the views draw (a crafted size of 2**63 would draw forever)."""
        if any(n < 1 for n in self.mesh_shape.values()):
            raise ValueError("mesh_shape: every size must be at least 1")
        named = [*self.mesh_dims, *self.groups]
        if any(d not in self.mesh_shape for d in named):
            raise ValueError("mesh_shape: a size for every dimension mesh_dims and groups name")
        if any(d not in r.coords for r in self.ranks for d in self.mesh_dims):
            raise ValueError("ranks: a coordinate for every dimension of mesh_dims")
        if self.ranks and math.prod(self.mesh_shape.values()) != len(self.ranks):
            raise ValueError(
                f"mesh_shape: sizes whose product is not the {len(self.ranks)} ranks listed"
            )
        for r in self.ranks:
            for dim, c in r.coords.items():
                if dim in self.mesh_shape and not 0 <= c < self.mesh_shape[dim]:
                    raise ValueError(
                        f"ranks: rank {r.rank}'s {dim} coordinate {c} is outside the mesh"
                    )
        return self


class ReplicaRule(_Line):
    phase: StrictStr
    dim: StrictStr
    relation: StrictStr
    tensors: StrictStr | list[StrictStr] = "*"
    exclude: StrictStr | None = None  # a pattern of tensors the rule leaves out


class Replicas(_Line):
    """replicas.json: which copies agree across which mesh dimension (`check` reads nothing else)."""

    groups: Groups
    rules: list[ReplicaRule]


class FileHash(_Line):
    sha256: StrictStr
    bytes: StrictInt = NonNegative


class CheckpointIndex(_Line):
    """A checkpoint's INDEX.json: every file's hash and size, and whose checkpoint it is."""

    format: StrictStr = "dcp"
    step: StrictInt | None = None
    manifest_id: StrictStr | None = None
    world_size: StrictInt | None = None
    contents: list[StrictStr] = Field(default_factory=list)
    files: dict[str, FileHash]


class ChainEnd(_Line):
    chain: StrictStr | None = None
    steps: StrictInt = NonNegative


class Seal(_Line):
    version: StrictInt = 1
    hash: StrictStr = "sha256"
    files: dict[str, FileHash]
    chains: dict[str, ChainEnd] = Field(default_factory=dict)
    events: FileHash | None = None


class SealPart(_Line):
    """One rank's share of the seal (store/seal.py's `rank_part`), gathered as JSON by rank 0: the files it
    wrote and its step chain's last hash."""

    rank: StrictInt = NonNegative
    files: dict[str, FileHash] = Field(default_factory=dict)
    chain: StrictStr | None = None
    steps: StrictInt = NonNegative


class Complete(_Line):
    """COMPLETE: written last by global rank 0, with the seal (store/seal.py)."""

    completed: Number | None = None
    seal: Seal | None = None


class StoredLock(_Line):
    """manifest.lock.json as a reader takes it: the manifest (a mapping, read through store/manifest.py's
    view; identity is taken over it as stored), its id, and what the freeze or the attach added."""

    manifest: dict
    manifest_id: StrictStr
    source: StrictStr | None = None  # the TOML frozen, or one of ATTACHED_SOURCES
    overrides: list[StrictStr] | None = None
    resolved: dict | None = None  # data and tokenizer paths on the machine that froze it
    observed: dict | None = None  # an attached run's observed batch (run/attach/steps.py)


class FaultSpec(_Line):
    """run.json's fault (`Fault.record`): which fault, where, with which parameters (free-form: the
    fault's own), and the hook point and signature it was catalogued with."""

    name: StrictStr
    step: StrictInt
    rank: StrictInt
    params: dict = Field(default_factory=dict)
    point: StrictStr | None = None
    expect: Any = None


class ResumeSpec(_Line):
    """run.json's resume: a checkpoint relative to runs/<id12>/ (store/paths.py confines it), its step."""

    checkpoint: StrictStr
    step: StrictInt
    from_run: StrictStr | None = None  # the run whose checkpoint it is
    copied_from: StrictStr | None = None  # recovered into another root: where the checkpoint lay


class ReplaySpec(_Line):
    """run.json's replay (`disttrace replay`, docs/replay.md): which run and step it re-executes."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    of: StrictStr | None = None
    step: StrictInt | None = None
    rank_shift: StrictInt | None = None  # --permute-ranks: logical rank r runs in launch slot r + k
    from_: StrictStr | None = Field(default=None, alias="from")  # where it starts, in words
    depth: StrictStr | None = None


class Perturb(_Line):
    """run.json's perturb (`disttrace calibrate`): the initial parameters moved by `relative`."""

    relative: Number
    seed: StrictInt = 0


class RunInfo(_Line):
    """run.json: which path, the fault spec, where it resumed from, and what the command that prepared it
    adds. Built by every writer (`store.writers.write_run_info`), validated by every reader (`Run.run_info`).
    `doc()` is what the writer stated: a field passed as None is written as null, one left out is absent."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    path: StrictStr | None = None
    fault: FaultSpec | None = None
    resume: ResumeSpec | None = None
    origin: dict | None = None  # a depth run: the run it re-computes (store/depth.py's `origin`)
    created: Number | None = None
    argv: list[StrictStr] | None = None
    run_id: StrictStr | None = None  # a multi-node run's id, shared by every node's launcher
    pid: StrictInt | None = None
    command: list[StrictStr] | None = None  # `run -- CMD`: the user's command
    stop_after: StrictInt | None = None  # the last step to run (a replay)
    replay: ReplaySpec | None = None
    replay_of: StrictStr | None = None  # `gate --replay`: the run it re-executes
    perturb: Perturb | None = None
    depth: Any = None  # an attached replay at depth: checked by run/record/depth.py's attached_spec

    @model_validator(mode="wrap")
    @classmethod
    def _nested_as_read(cls, data: Any, handler):
        """Each nested line (fault, resume, replay, perturb) keeps the object it was validated from, so that
        its `as_read()` is run.json's part as stored, as the whole line's is."""
        out = handler(data)
        if isinstance(data, dict):
            for name in ("fault", "resume", "replay", "perturb"):
                part = getattr(out, name)
                if isinstance(part, _Line) and isinstance(data.get(name), dict):
                    part._read = data[name]
        return out

    def updated(self, **fields: Any) -> RunInfo:
        """A copy with `fields` set (validated), the others as they were stated."""
        return type(self).model_validate({**self.doc(), **fields})


class CollectiveLine(_Line):
    """A line of the collective trace (collectives/rank-N.frames or .jsonl): one collective (the Flight
    Recorder's ring, run/record/flightrec.py, or the dispatch-mode tracer, run/record/collectives.py), its end, or the
    entries the ring lost (`RingLost`). The writers build it, fields in the order written (`line()`: what
    the writer stated)."""

    seq: StrictInt | None = None
    group: StrictStr | None = None
    op: StrictStr | None = None
    step: StrictInt | None = None
    shapes: list[list[StrictInt]] | None = None
    dtype: StrictStr | None = None
    bytes: StrictInt | None = None
    start: Number | None = None
    digests: Any = None  # record.collectives = "values": the payload's digests
    pg: StrictStr | None = None  # the Flight Recorder's process-group name
    fr_seq: StrictInt | None = None  # its collective (or point-to-point) sequence number
    done: StrictBool | None = None
    end: Number | None = None
    lost: StrictInt | None = None  # entries the ring overwrote before they were copied
    after_record: StrictInt | None = None

    def line(self) -> dict:
        return self.doc()

    @model_validator(mode="after")
    def _keyed(self):
        if (self.op is not None or self.end is not None) and (
            self.seq is None or self.group is None
        ):
            raise ValueError("a collective (or its end) needs its 'seq' and 'group'")
        return self


class RingLost(_Line):
    """The collectives line of the entries the Flight Recorder's ring overwrote before they were copied,
    in the order written (read as a `CollectiveLine`)."""

    lost: StrictInt
    after_record: StrictInt  # the last ring record copied before them
    step: StrictInt


class ModelStateBytes(_Line):
    """The ZeRO formula's bytes of model state one rank holds (plan/costs.py's `model_state_bytes`)."""

    params: Number | None = None
    grads: Number | None = None
    optimizer: Number | None = None
    total: Number | None = None


class MemoryGap(_Line):
    """One named difference between the measured and the predicted bytes."""

    what: StrictStr | None = None
    bytes: StrictInt | None = None
    why: StrictStr | None = (
        None  # what explains it, where something does (written as null otherwise)
    )


class MemoryLine(_Line):
    """A line of memory/rank-N.jsonl: one step's memory ledger of one rank (run/record/memory.py builds it, in
    this order; `allocated` and `peak_allocator` only on a GPU). Readers rely on step and rank; the
    other fields are optional, for stores from other versions."""

    step: StrictInt
    rank: StrictInt
    params: StrictInt | None = None
    grads: StrictInt | None = None
    optimizer: StrictInt | None = None
    model_state: StrictInt | None = None
    buffers: StrictInt | None = None
    unregistered: StrictInt | None = None
    engine: StrictInt | None = None  # DDP's bucket buffers, FSDP2's unsharded parameters
    engine_peak: StrictInt | None = None
    measured_total: StrictInt | None = None
    storages: StrictInt | None = None
    activations_saved: StrictInt | None = None
    peak_tracked: StrictInt | None = None
    resident: StrictInt | None = None  # the process's resident set
    predicted: ModelStateBytes | None = None
    ratio_model_state: Number | None = None
    ratio_total: Number | None = None
    gap: list[StrictStr] | None = None  # gap_bytes in words
    gap_bytes: list[MemoryGap] | None = None
    allocated: StrictInt | None = None
    peak_allocator: StrictInt | None = None

    def line(self) -> dict:
        return self.doc()


class StepTimes(_Line):
    """The `time` of a step-index line: when the step started, issued its collective and ended."""

    start: Number | None = None
    collective_issue: Number | None = None
    end: Number | None = None
    spans: list | dict | None = None


def parse_doc(model: type[_L], obj: Any, path) -> _L:
    """`obj` (a whole JSON document read from `path`) validated by `model`; BadInput naming the field."""
    try:
        out = model.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or "document"
        raise BadInput(path, f"'{field}' {err['msg'].lower()}", field=field) from None
    out._read = obj
    return out


# ---------------------------------------------------------------- depth records (docs/zoom.md)

DEPTH_DIRECTIONS = ("forward", "backward")
DEPTH_KINDS = ("module", "op")


class DepthShard(_Line):
    offset: list[StrictInt]
    logical_shape: list[StrictInt]


class DepthRecord(_Line):
    """A line of depth/rank-N.jsonl (run/record/depth.py): one tensor inside the step recorded at depth.

    `module`: a module's forward output (direction forward) or the gradient with respect to it (backward),
    `module` its path in the plain model and `call` which of its calls in the micro-batch; `op`: an aten op's
    output, `module` the innermost module it ran in (backward: the module whose output gradient arrived last)
    and `op_index` its place among that module call's ops. `seq`: execution order inside (micro_batch,
    direction) on this rank. `shard` places the tensor in the step's logical tensor (the batch dimension over
    the step's micro-batches and data-parallel ranks, DTensor shards over tp); `weight` turns this rank's
    statistics into the logical tensor's (an output gradient of a local mean loss: 1 / dp)."""

    step: StrictInt = NonNegative
    micro_batch: StrictInt = NonNegative
    rank: StrictInt = NonNegative
    direction: str = Field(pattern="^(forward|backward)$")
    kind: str = Field(pattern="^(module|op)$")
    seq: StrictInt = NonNegative
    module: StrictStr
    call: StrictInt = NonNegative
    op: StrictStr | None = None
    op_index: StrictInt | None = Field(default=None, ge=0)
    output: StrictInt = NonNegative
    dtype: StrictStr
    shape: list[StrictInt]
    numel: StrictInt = NonNegative
    digest: StrictStr
    sum: Number | None = None
    norm: Number | None = None
    sketch: list[Number] | None = None
    nonfinite: StrictInt = 0
    shard: DepthShard | None = None
    weight: Number = 1.0
