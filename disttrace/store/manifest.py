"""The manifest a run store holds, as its readers see it (`Run.manifest`).

A typed view of `manifest.lock.json`'s `manifest`, the harness's (config/manifest.py's `Manifest`) or an
attached run's (config/attached.py's `AttachedManifest`): the fields readers use, by attribute. It is not
the job's model: a store written by another version of disttrace stays readable, so every field here is
optional (None: this manifest does not say), and keys this version does not know are kept. A field a
reader uses is checked when the view is first taken (a crafted lock is one line naming the field, exit 2).

Identity is taken over the stored JSON itself (`Run.manifest_doc`): the manifest id, and diff's and the
gate's field-by-field comparisons, which must see every key, known or not.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, field_validator

from disttrace.store.records import Number


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class ExperimentView(_Section):
    name: StrictStr | None = None
    edition: StrictStr | None = None


class ParallelismView(_Section):
    world_size: StrictInt | None = None
    dp: StrictInt | None = None
    tp: StrictInt | None = None
    pp: StrictInt | None = None
    zero_stage: StrictInt | None = None
    engine: StrictStr | None = None  # an attached run's: plain, DDP, FSDP2, DTensor, DeepSpeed


class TrainingView(_Section):
    steps: StrictInt | None = None
    micro_batch_size: StrictInt | None = None
    grad_accum_steps: StrictInt | None = None
    dtype: StrictStr | None = None
    optimizer: StrictStr | None = None
    lr: Number | None = None
    beta1: Number | None = None
    beta2: Number | None = None


class RecordView(_Section):
    every: StrictInt | None = None
    # "zero-code": the command never called attach; its model, optimizer, loss and data were found through
    # torch's process-wide hooks (docs/attach.md)
    source: Literal["zero-code"] | None = None


class DebugView(_Section):
    collective_timeout_s: Number | None = None


class EvalView(_Section):
    batch_size: StrictInt | None = None
    max_batches: StrictInt | None = None


class StoredManifest(_Section):
    """The sections readers use; the others (data, tokenizer, model, optimizer, config, ...) are kept as
    stored, each a mapping (`model_extra`), and read from `Run.manifest_doc`."""

    experiment: ExperimentView = Field(default_factory=ExperimentView)
    parallelism: ParallelismView = Field(default_factory=ParallelismView)
    training: TrainingView = Field(default_factory=TrainingView)
    record: RecordView = Field(default_factory=RecordView)
    debug: DebugView = Field(default_factory=DebugView)
    eval: EvalView | None = None  # None: no held-out evaluation stated

    @field_validator("experiment", "parallelism", "training", "record", "debug", mode="before")
    @classmethod
    def _absent(cls, v: Any) -> Any:
        return {} if v is None else v  # a section stored as null says nothing
