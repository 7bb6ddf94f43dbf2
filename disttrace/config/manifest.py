"""The experiment manifest: a TOML file, validated, frozen into canonical JSON whose sha256 is the id.

Everything an experiment depends on is here and nowhere else: edition, data and its hash, tokenizer and
its hash, model shape, parallel topology, optimisation, seed, checkpoint interval, determinism flags.
"""

from __future__ import annotations

import hashlib
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from disttrace.config.identity import get_field
from disttrace.config.support import _not_supported_yet
from disttrace.errors import BadInput
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
    depth: DepthSpec | None = Field(
        default=None,
        description="record one step at depth (every module's output and output gradient, or every op's "
        "output too) into depth/rank-N.arrows; None: no depth recording, no hooks installed",
    )

    @model_serializer(mode="wrap")
    def _leave_out_unset_depth(self, handler: SerializerFunctionWrapHandler) -> dict:
        # The manifest id is the sha256 of this dump: a manifest without depth recording must keep the id it
        # had before the field existed, or every stored run would stop matching its own manifest.
        doc = handler(self)
        if doc.get("depth") is None:
            doc.pop("depth", None)
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


# ---------------------------------------------------------------- loading


def parse_override(text: str) -> tuple[list[str], Any]:
    """'section.key=value' -> (['section','key'], value). The value is read as a TOML value when it
    parses as one (2, 1e-3, true, "x"), else taken as a plain string."""
    if "=" not in text:
        raise BadInput("--set", f"'{text}' is not of the form section.key=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise BadInput("--set", f"'{key}' must be section.key", field=key)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_overrides(doc: dict, overrides: list[str]) -> dict:
    for text in overrides or []:
        (section, key), value = parse_override(text)
        if section not in Manifest.model_fields:
            raise BadInput("--set", f"unknown section '{section}'", field=f"{section}.{key}")
        sec = doc.setdefault(section, {})
        if not isinstance(sec, dict):
            raise BadInput("--set", f"'{section}' is not a table", field=section)
        sec[key] = value
    return doc


def read_text_file(path: Path, what: str) -> str:
    """A UTF-8 text file the user named (`what`: "manifest", "DeepSpeed config"), or BadInput saying why not."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BadInput(path, f"{what} file not found") from None
    except IsADirectoryError:
        raise BadInput(path, f"is a directory, not a {what} file") from None
    except UnicodeDecodeError:
        raise BadInput(path, "not UTF-8 text") from None
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror})") from None


def read_toml(path: Path) -> dict:
    text = read_text_file(path, "manifest")
    try:
        return tomllib.loads(text)
    except (
        ValueError,
        RecursionError,
    ) as e:  # TOMLDecodeError; an int past Python's digit limit; deep nesting
        raise BadInput(path, f"invalid TOML ({e})") from None


def validate(doc: dict, where: str | Path) -> Manifest:
    try:
        return Manifest.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err["loc"]) or None
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r})"
        msg = msg.removeprefix("Value error, ")
        raise BadInput(where, msg, field=field) from None


def canonical_json(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Frozen(BaseModel):
    """What `freeze` produces and `manifest.lock.json` holds."""

    manifest: dict
    manifest_id: str
    source: str
    overrides: list[str]
    resolved: dict  # absolute paths of data and tokenizer on the machine that froze it

    def model(self) -> Manifest:
        return Manifest.model_validate(self.manifest)

    @property
    def data_path(self) -> str | None:
        """The data file, resolved on the machine that froze it (None: the lock names none)."""
        return self.resolved.get("data_path")

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer file, resolved likewise (None for the byte tokenizer, which has none)."""
        return self.resolved.get("tokenizer_path")


def freeze(path: Path | str | None, overrides: list[str] | None = None) -> Frozen:
    """Load, override, validate, resolve and check hashes; refuse anything that cannot run."""
    path = Path(path) if path else DEFAULT_MANIFEST
    return freeze_doc(read_toml(path), path, overrides)


def parse_lock(path: Path | str) -> Frozen:
    """A lock's shape alone (`Frozen`), for a job whose launcher already checked the rest with read_lock:
    its ranks re-read it without hashing the data again. Bad JSON or another shape is refused, naming the
    lock and the field."""
    path = Path(path)
    try:
        doc = orjson.loads(read_text_file(path, "lock"))
    except orjson.JSONDecodeError as e:
        raise BadInput(path, f"not valid JSON ({e})") from None
    try:
        return Frozen.model_validate(doc)
    except ValidationError as e:
        err = e.errors()[0]
        raise BadInput(path, err["msg"], field=".".join(map(str, err["loc"])) or None) from None


def read_lock(path: Path | str) -> Frozen:
    """A lock `freeze -o` wrote (e.g. from `--from-deepspeed`), as the harness would run it: its manifest
    validated, its id recomputed, its data and tokenizer files (the paths it resolved) hashed against it and
    the features it needs supported. Refused, naming the lock and the field, where any of these fails: a lock
    is run exactly as frozen, or not at all."""
    path = Path(path)
    frozen = parse_lock(path)
    m = validate(frozen.manifest, path)
    canonical = orjson.loads(canonical_json(m.model_dump(mode="json")))
    if canonical != frozen.manifest:
        raise BadInput(path, "not in the canonical form freeze writes", field="manifest")
    if hashlib.sha256(canonical_json(canonical)).hexdigest() != frozen.manifest_id:
        raise BadInput(path, "is not the sha256 of the lock's manifest", field="manifest_id")
    for key, what, stated in (
        ("data_path", "data", m.data.sha256),
        ("tokenizer_path", "tokenizer", m.tokenizer.sha256),
    ):
        file = frozen.resolved.get(key)
        if file is None and what == "tokenizer" and m.tokenizer.kind == "byte":
            continue
        if not isinstance(file, str) or not Path(file).is_file():
            raise BadInput(path, f"{what} file not found: {file}", field=f"resolved.{key}")
        if what == "data":
            actual = sha256_file(Path(file))
        else:
            from disttrace.data.tokenizer import load_tokenizer

            actual = load_tokenizer(m.tokenizer.kind, file).sha256
        if actual != stated:
            raise BadInput(
                path,
                f"{file} has sha256 {actual[:12]}..., not the lock's {str(stated)[:12]}...",
                field=f"manifest.{what}.sha256",
            )
    unsupported = _not_supported_yet(m)
    if unsupported:
        raise BadInput(path, unsupported[1], field=f"manifest.{unsupported[0]}")
    return frozen


def _resolve_data(m: Manifest, path: Path, base: Path) -> Path:
    """The data file, found beside the manifest, its sha256 checked against the stated one and recorded."""
    data_path = (base / m.data.path).resolve()
    if not data_path.is_file():
        raise BadInput(path, f"data file not found: {data_path}", field="data.path")
    data_sha = sha256_file(data_path)
    if m.data.sha256 and m.data.sha256 != data_sha:
        raise BadInput(
            path,
            f"stated sha256 {m.data.sha256[:12]}... does not match the file's {data_sha[:12]}...",
            field="data.sha256",
        )
    m.data.sha256 = data_sha
    return data_path


def _resolve_tokenizer(m: Manifest, path: Path, base: Path) -> Path | None:
    """The tokenizer (its file, for a 'bpe' one), its sha256 checked and recorded, its vocabulary checked
    against the model's."""
    from disttrace.data.tokenizer import load_tokenizer  # tokenizers is light; no torch here

    tok_path = None
    if m.tokenizer.kind == "bpe":
        if not m.tokenizer.path:
            raise BadInput(path, "a 'bpe' tokenizer needs a path", field="tokenizer.path")
        tok_path = (base / m.tokenizer.path).resolve()
        if not tok_path.is_file():
            raise BadInput(path, f"tokenizer file not found: {tok_path}", field="tokenizer.path")
    tok = load_tokenizer(m.tokenizer.kind, str(tok_path) if tok_path else None)
    if m.tokenizer.sha256 and m.tokenizer.sha256 != tok.sha256:
        raise BadInput(
            path,
            f"stated sha256 {m.tokenizer.sha256[:12]}... does not match the tokenizer's "
            f"{tok.sha256[:12]}...",
            field="tokenizer.sha256",
        )
    m.tokenizer.sha256 = tok.sha256
    if tok.vocab_size > m.model.vocab_size:
        raise BadInput(
            path,
            f"{m.model.vocab_size} is smaller than the tokenizer's vocabulary ({tok.vocab_size})",
            field="model.vocab_size",
        )
    return tok_path


def freeze_doc(doc: dict, where: Path | str, overrides: list[str] | None = None) -> Frozen:
    """`freeze` after the TOML is read: `doc` is a manifest document in the TOML's shape (e.g. built from a
    DeepSpeed config), `where` the manifest file it stands for (errors name it; data and tokenizer paths
    resolve against its folder)."""
    path = Path(where)
    doc = apply_overrides(doc, overrides or [])
    m = validate(doc, path)
    base = path.resolve().parent

    data_path = _resolve_data(m, path, base)
    tok_path = _resolve_tokenizer(m, path, base)

    if m.parallelism.dp < 1 or m.world_size > 4096:
        raise BadInput(path, f"world size {m.world_size} is out of range", field="parallelism.dp")
    unsupported = _not_supported_yet(m)
    if unsupported:
        raise BadInput(path, unsupported[1], field=unsupported[0])

    canonical = orjson.loads(canonical_json(m.model_dump(mode="json")))
    manifest_id = hashlib.sha256(canonical_json(canonical)).hexdigest()
    return Frozen(
        manifest=canonical,
        manifest_id=manifest_id,
        source=str(path),
        overrides=list(overrides or []),
        resolved={
            "data_path": str(data_path),
            "tokenizer_path": str(tok_path) if tok_path else None,
        },
    )


def verified_data(source) -> tuple[str, str | None]:
    """The data and tokenizer paths `source`'s lock resolved (`source` a store's `Run`), each hash-checked against its manifest's
    `data.sha256` / `tokenizer.sha256` (BadInput naming the file otherwise)."""
    from disttrace.data.tokenizer import load_tokenizer

    resolved = source.lock_info.resolved
    lock = source.path / "manifest.lock.json"
    if not isinstance(resolved, dict) or not isinstance(resolved.get("data_path"), str):
        raise BadInput(lock, "names no data file", field="resolved.data_path")
    data_path, tok_path = resolved["data_path"], resolved.get("tokenizer_path")
    want = get_field(source.manifest_doc, "data.sha256")
    try:
        got = sha256_file(Path(data_path))
    except OSError as e:
        raise BadInput(data_path, f"cannot read ({e.strerror})") from None
    if not isinstance(want, str) or got != want:
        raise BadInput(
            data_path,
            f"sha256 {got[:12]}... is not the {want!s:.12}... {lock} states",
            field="data.sha256",
        )
    kind = get_field(source.manifest_doc, "tokenizer.kind")
    tok = load_tokenizer(kind, tok_path)
    if tok.sha256 != get_field(source.manifest_doc, "tokenizer.sha256"):
        raise BadInput(
            tok_path or lock,
            f"tokenizer sha256 {tok.sha256[:12]}... is not the one {lock} states",
            field="tokenizer.sha256",
        )
    return data_path, tok_path


def checkpoint_identity(manifest) -> str:
    """The manifest id a checkpoint loaded by this job must carry: the manifest's own, computed without
    `record.depth` (what is recorded at depth is not what is computed: a replay recording step S at depth
    resumes from the checkpoint of the run it replays)."""
    doc = manifest.model_dump(mode="json")
    doc["record"].pop("depth", None)
    return hashlib.sha256(canonical_json(doc)).hexdigest()
