"""The experiment manifest's schema: a TOML file's sections, validated (frozen by config/freezing.py).

Everything an experiment depends on is here and nowhere else: edition, data and its hash, tokenizer and
its hash, model shape, parallel topology, optimisation, seed, checkpoint interval, determinism flags.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from disttrace.model.shapes import ffn_hidden_default


def manifests_dir() -> Path:
    """The embedded manifests: the default, the labs (labs/) and their data. The one place that finds them.

    An installed wheel carries a copy of the repository's manifests/ as package data, disttrace/_manifests
    (setup.py's build_py copies it); a checkout (an editable install, `make demo`) has none and reads the
    repository's manifests/ itself, the folder users read and edit. The packaged copy is looked for first:
    next to an installed package, the checkout's place would be site-packages/manifests, which another
    distribution could own. Both layouts keep the tree as it is, so the paths inside a manifest (data and
    tokenizer, relative to its folder) resolve the same in both."""
    packaged = resources.files("disttrace").joinpath("_manifests")
    if packaged.is_dir():
        return Path(str(packaged))  # a plain folder: freeze records, and the ranks open, real paths
    return Path(__file__).resolve().parents[2] / "manifests"  # disttrace/config/ -> repo


DEFAULT_MANIFEST = manifests_dir() / "default.toml"


class Section(BaseModel):
    """A table of the manifest. Every field states a one-line `description`: `disttrace freeze --explain`
    prints them, and a test fails on a field without one. A description is schema, not value: the manifest
    id is the sha256 of the validated values' canonical JSON, so wording changes no id."""

    model_config = ConfigDict(extra="forbid", strict=False, frozen=False)


class Experiment(Section):
    """What this experiment is called and the seed everything random derives from."""

    name: str = Field(
        description="a human name; the run directory is keyed by the manifest id, not this"
    )
    edition: str = Field(
        description="protocol version label; runs of different editions are never silently compared"
    )
    seed: int = Field(ge=0, description="seeds the model's initialisation and the data order")
    description: str = Field(
        default="", description="free text for people; part of the manifest id"
    )


class Data(Section):
    """The corpus (JSON lines of documents) and how its held-out split is drawn."""

    path: str = Field(description="the corpus file, relative to the manifest's folder")
    sha256: str | None = Field(
        default=None, description="stated hash; computed at freeze and checked"
    )
    eval_percent: int = Field(
        default=10,
        ge=1,
        le=50,
        description="percent of documents held out for the gate's evaluation",
    )
    split_salt: str = Field(
        default="disttrace-v1",
        description="salt of the per-document hash that decides the held-out split",
    )


class Tokenizer(Section):
    """How text becomes token ids; its hash is part of the experiment."""

    kind: Literal["bpe", "byte"] = Field(
        default="bpe", description="bpe: a tokenizers JSON file; byte: raw UTF-8 bytes, no file"
    )
    path: str | None = Field(
        default=None, description="the tokenizer file (bpe), relative to the manifest's folder"
    )
    sha256: str | None = Field(
        default=None, description="stated hash of the tokenizer; computed at freeze and checked"
    )


class Model(Section):
    """The plain LLaMA-style decoder's shape (model/llama.py); parallelism is applied outside it."""

    dim: int = Field(gt=0, description="hidden size; divisible by n_heads")
    n_layers: int = Field(gt=0, description="transformer blocks")
    n_heads: int = Field(gt=0, description="query heads; divisible by n_kv_heads")
    n_kv_heads: int = Field(
        gt=0, description="key/value heads (fewer than n_heads: grouped-query attention)"
    )
    vocab_size: int = Field(gt=0, description="embedding rows; at least the tokenizer's vocabulary")
    max_seq_len: int = Field(gt=1, description="tokens in one training window")
    multiple_of: int = Field(
        default=32,
        gt=0,
        description="the FFN width is rounded up to a multiple of this (LLaMA's rule)",
    )
    ffn_hidden: int | None = Field(
        default=None,
        gt=0,
        description="FFN width; unset: derived from dim and multiple_of at freeze",
    )
    norm_eps: float = Field(default=1e-5, description="RMSNorm's epsilon")
    rope_theta: float = Field(default=10000.0, description="rotary embedding base frequency")
    n_experts: int = Field(
        default=0, ge=0, description="experts of a mixture in place of each FFN (0: dense)"
    )
    top_k: int = Field(default=2, ge=1, description="experts each token is routed to")
    aux_loss_coef: float = Field(
        default=0.0, ge=0, description="weight of the load-balancing loss (0: none)"
    )

    @model_serializer(mode="wrap")
    def _leave_out_dense_moe_keys(self, handler: SerializerFunctionWrapHandler) -> dict:
        # The manifest id is the sha256 of this dump: a dense model keeps the id it had before the mixture's
        # keys existed (the validator refuses them set on a dense model, so nothing stated is dropped).
        doc = handler(self)
        if not doc.get("n_experts"):
            for key in ("n_experts", "top_k", "aux_loss_coef"):
                doc.pop(key, None)
        return doc

    @model_validator(mode="after")
    def _shapes(self):
        if self.dim % self.n_heads:
            raise ValueError(
                f"model.dim ({self.dim}) must be divisible by model.n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be divisible by model.n_kv_heads ({self.n_kv_heads})"
            )
        if self.ffn_hidden is None:
            self.ffn_hidden = ffn_hidden_default(self.dim, self.multiple_of)  # LLaMA's rule
        if not self.n_experts and ({"top_k", "aux_loss_coef"} & self.model_fields_set):
            raise ValueError("model.top_k and model.aux_loss_coef need model.n_experts > 0")
        if self.n_experts and self.top_k > self.n_experts:
            raise ValueError(
                f"model.top_k ({self.top_k}) must not exceed model.n_experts ({self.n_experts})"
            )
        return self


class Parallelism(Section):
    """The layout (topology, not experiment: runs that differ here compare numerically)."""

    dp: int = Field(ge=1, description="data-parallel replicas (DDP, or FSDP2 under ZeRO-2/3)")
    tp: int = Field(
        default=1, ge=1, description="tensor-parallel degree (DTensor parallelize_module)"
    )
    pp: int = Field(default=1, ge=1, description="pipeline stages (torch.distributed.pipelining)")
    ep: int = Field(
        default=1, ge=1, description="expert parallel: experts sharded over ep ranks of dp"
    )
    cp: int = Field(
        default=1, ge=1, description="context parallel: the sequence split over cp ranks"
    )
    zero_stage: int = Field(
        default=0, ge=0, le=3, description="0: plain DDP; 1: ZeroRedundancyOptimizer; 2, 3: FSDP2"
    )
    pp_schedule: Literal["gpipe", "1f1b"] = Field(
        default="gpipe", description="the pipeline schedule, with pp > 1"
    )
    architecture: Literal["allreduce", "parameter-server"] = Field(
        default="allreduce",
        description="parameter-server: rank 0 holds parameters, workers push and pull",
    )
    staleness: int = Field(
        default=0,
        ge=0,
        description="parameter server: workers compute on parameters this many updates old",
    )
    world_size: int | None = Field(
        default=None, ge=1, description="if stated, must equal dp*cp*tp*pp"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto",
        description="process-group backend; auto: nccl where CUDA is present, else gloo",
    )

    @model_serializer(mode="wrap")
    def _leave_out_unit_ep_cp(self, handler: SerializerFunctionWrapHandler) -> dict:
        # as Model's: a layout without expert or context parallelism keeps the manifest id it always had
        doc = handler(self)
        for key in ("ep", "cp"):
            if doc.get(key) == 1:
                doc.pop(key)
        return doc

    @model_validator(mode="after")
    def _world(self):
        product = self.dp * self.cp * self.tp * self.pp
        if self.world_size is None:
            self.world_size = product
        elif self.world_size != product:
            raise ValueError(
                f"dp*cp*tp*pp = {self.dp}*{self.cp}*{self.tp}*{self.pp} = {product} does not equal "
                f"world_size {self.world_size}"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"parallelism.ep ({self.ep}) must divide parallelism.dp ({self.dp}): experts are "
                "sharded over ranks of the data-parallel dimension"
            )
        return self


class Training(Section):
    """The optimisation; the global batch is dp x micro_batch_size x grad_accum_steps."""

    steps: int = Field(ge=1, description="optimizer steps (counted from 1)")
    micro_batch_size: int = Field(ge=1, description="sequences per rank per forward")
    grad_accum_steps: int = Field(
        default=1, ge=1, description="micro-batches accumulated before each optimizer step"
    )
    lr: float = Field(gt=0, description="learning rate (constant)")
    optimizer: Literal["adamw", "sgd"] = Field(default="adamw", description="the torch optimizer")
    weight_decay: float = Field(default=0.0, ge=0, description="the optimizer's weight decay")
    beta1: float = Field(default=0.9, description="AdamW's first-moment decay")
    beta2: float = Field(default=0.95, description="AdamW's second-moment decay")
    dtype: Literal["float32", "float64"] = Field(
        default="float32",
        description="parameters' and computation's dtype; sets the numeric bound's roundoff",
    )
    max_grad_norm: float | None = Field(
        default=None, gt=0, description="clip the global gradient norm to this"
    )


class Checkpoint(Section):
    """Recovery checkpoints (DCP plus a sha256 INDEX.json)."""

    interval: int = Field(default=0, ge=0, description="save every N steps (0: never)")


class Debug(Section):
    """Determinism and failure detection; not what is computed."""

    deterministic: bool = Field(
        default=True,
        description="torch.use_deterministic_algorithms: a rerun is bit for bit the same",
    )
    collective_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="the process group's timeout: how long a hung rank takes to fail",
    )
    ddp_bucket_cap_mb: float | None = Field(
        default=None, gt=0, description="DDP bucket size (default: DDP's 25)"
    )
    live_check: bool = Field(
        default=False, description="compare replica digests every step; stop at the first mismatch"
    )


class DepthSpec(Section):
    """One step recorded at depth (docs/zoom.md): `module` digests every module's forward output and the
    gradient with respect to it, in execution order; `op` also every aten op's output inside them."""

    step: int = Field(ge=1, description="the step recorded at depth (steps count from 1)")
    level: Literal["module", "op"] = Field(
        default="module",
        description="module: every module's output; op: every aten op's output too",
    )


class Record(Section):
    """What the recorder writes (how much evidence, at what cost). Not part of the experiment: diff compares
    runs that differ here (on the steps both recorded)."""

    enabled: bool = Field(
        default=True,
        description="false: the unrecorded baseline (benchmarks); step wall times are still kept",
    )
    collectives: Literal["metadata", "values", "off"] = Field(
        default="metadata",
        description="metadata: read from each process group's Flight Recorder (no per-op "
        "cost); values: a dispatch-mode tracer that also digests every collective's payload; off: no trace",
    )
    every: int = Field(default=1, ge=1, description="digest every k-th step (steps k, 2k, ...)")
    forward: bool = Field(
        default=True, description="record each block's output at the forward point"
    )
    updates: bool = Field(
        default=True,
        description="record each parameter's largest update at the optimizer step (diff bounds Adam's "
        "step); costs one copy of the parameters this rank holds whole, kept between steps: false frees it",
    )
    depth: DepthSpec | None = Field(
        default=None,
        description="record one step at depth (every module's output and output gradient, or every op's "
        "output too) into depth/rank-N.arrows; None: no depth recording, no hooks installed",
    )

    @model_serializer(mode="wrap")
    def _leave_out_defaults_added_later(self, handler: SerializerFunctionWrapHandler) -> dict:
        # The manifest id is the sha256 of this dump: a manifest that leaves these at their defaults must keep
        # the id it had before the fields existed, or every stored run would stop matching its own manifest.
        doc = handler(self)
        if doc.get("depth") is None:
            doc.pop("depth", None)
        if doc.get("updates") is True:
            doc.pop("updates", None)
        return doc


class Eval(Section):
    """The gate's independent evaluation of the final checkpoint on the held-out split."""

    max_batches: int = Field(default=16, ge=1, description="held-out batches scored at most")
    batch_size: int = Field(default=4, ge=1, description="sequences per evaluation batch")
    loss_rtol: float = Field(
        default=0.02,
        ge=0,
        description="gate: eval loss within this relative tolerance of the reference's",
    )


class Manifest(Section):
    """The whole experiment, one table a section (`disttrace freeze --explain` lists every field)."""

    experiment: Experiment = Field(description="name, edition, seed")
    data: Data = Field(description="the corpus and its held-out split")
    tokenizer: Tokenizer = Field(description="how text becomes token ids")
    model: Model = Field(description="the plain model's shape")
    parallelism: Parallelism = Field(description="the layout over ranks")
    training: Training = Field(description="steps, batch and optimizer")
    checkpoint: Checkpoint = Field(default=Checkpoint(), description="recovery checkpoints")
    debug: Debug = Field(default=Debug(), description="determinism and failure detection")
    eval: Eval = Field(default=Eval(), description="the gate's evaluation")
    record: Record = Field(default=Record(), description="what the recorder writes")

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.cp * p.tp * p.pp

    @property
    def global_batch(self) -> int:
        return self.parallelism.dp * self.training.micro_batch_size * self.training.grad_accum_steps
