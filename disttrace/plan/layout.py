"""One layout's plan (`disttrace plan`): the formulas of plan/costs.py put together for the numbers
given on the command line or read from a manifest, as a `Plan` (its `--json` document)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from disttrace.errors import BadInput
from disttrace.jsondoc import JsonDoc, omit_none
from disttrace.model.shapes import ffn_hidden_default
from disttrace.plan.costs import (
    PRECISIONS,
    ZERO_STAGES,
    _optimizer,
    _positive_int,
    _precision,
    activation_variants,
    bubble_fraction,
    comm_bytes_per_device,
    count_params,
    cp_costs,
    ep_costs,
    estimate_params,
    expert_params,
    micro_batches_in_flight,
    model_state_bytes,
    optimizer_bytes_per_param,
    parse_count,
)


@dataclass(frozen=True)
class PlanRequest:
    """The layout a plan is asked for: what `plan` and `plan_cli_args` take (a plan's `inputs` state it back,
    normalised). `params` is the parameter count; `plan_cli_args` also takes it as '7.5B'-style text, or None
    to estimate it from hidden and n_layers."""

    params: int | str | None = None
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    optimizer: str = "adam"
    precision: str = "mixed"
    seq: int | None = None
    micro_batch: int = 1
    hidden: int | None = None
    heads: int | None = None
    n_layers: int | None = None
    micro_batches: int = 1  # pipeline micro-batches per step
    pp_schedule: str = "1f1b"


@dataclass
class PlanInputs(JsonDoc):
    """What a plan was worked out for (precision and optimizer as the formulas name them)."""

    params: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    optimizer: str
    precision: str
    seq: int | None
    micro_batch: int
    hidden: int | None
    heads: int | None
    n_layers: int | None
    micro_batches: int
    pp_schedule: str
    world_size: int
    dtype: str | None = omit_none()  # planned from a manifest: its training.dtype
    params_source: str | None = omit_none()  # planned from the command line: given or estimated


@dataclass
class BytesPerParam(JsonDoc):
    weights: int
    grads: int
    optimizer_K: int  # the ZeRO paper's K: optimizer-state bytes per parameter


@dataclass
class PlanModel(JsonDoc):
    """The model shape a manifest's plan counted its parameters from."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    max_seq_len: int
    ffn_hidden: int


@dataclass
class Plan(JsonDoc):
    """One layout's plan, `disttrace plan --json`. Per-stage mappings are keyed by the ZeRO stage as text
    ("0".."3"; comm_bytes_per_device also "ddp"), activations by ACTIVATION_VARIANTS' names; a
    breakdown is model_state_bytes' {params, grads, optimizer, total}."""

    params: int
    params_per_model_parallel_rank: int
    zero_stage: int
    inputs: PlanInputs
    bytes_per_param: BytesPerParam
    model_state_bytes_per_device: dict[str, int]
    model_state_breakdown_per_device: dict[str, dict[str, int]]
    activation_bytes_per_layer: dict[str, int] | None  # None: no seq, hidden and heads given
    activation_bytes_per_device: dict[str, int] | None  # None: no layer count given either
    bubble_fraction: dict[str, float]  # gpipe, 1f1b ((p-1)/m) and of_total_time ((p-1)/(m+p-1))
    comm_bytes_per_device: dict[str, int]
    model: PlanModel | None = omit_none()  # planned from a manifest
    # planned from a manifest with experts or context parallel (plan/costs.py's ep_costs, cp_costs): the
    # figures above count the dense model replicated over dp; these are the layout's own
    experts: dict[str, int] | None = omit_none()
    context: dict[str, int] | None = omit_none()
    # planned from a manifest: the recorder's copy of the parameters a rank holds whole, kept between steps for
    # the update records (run/record/updates.py); 0 where record.updates or record.enabled is off, or every
    # parameter is sharded (ZeRO-3; tensor parallel, which shards over dp too, copies only its replicated
    # norm weights, left out here), or the workers hold copies of a server's parameters
    update_copy_bytes_per_device: int | None = omit_none()


def plan(req: PlanRequest) -> Plan:
    """Everything above for one layout (`req.params` a count).

    Tensor and pipeline parallelism each hold a 1/(tp*pp) slice of the model, so the model-state and
    data-parallel traffic figures use Psi_local = ceil(Psi / (tp*pp)) (embeddings and norms are assumed to
    split evenly too, which real layouts only approximate).
    """
    _check_layout(
        req.params, req.dp, req.tp, req.pp, req.zero_stage, req.micro_batch, req.micro_batches
    )
    req = replace(req, precision=_precision(req.precision))
    req = replace(req, optimizer=_optimizer(req.optimizer))
    params, dp, tp, pp, precision = req.params, req.dp, req.tp, req.pp, req.precision
    bytes_ = PRECISIONS[precision]

    local = -(-params // (tp * pp))  # the slice of the model one model-parallel rank owns
    breakdown = {
        str(s): model_state_bytes(local, dp, s, req.optimizer, precision) for s in ZERO_STAGES
    }

    activations, per_device = _activations(
        req.seq,
        req.micro_batch,
        req.hidden,
        req.heads,
        tp,
        pp,
        req.n_layers,
        req.micro_batches,
        req.pp_schedule,
        bytes_,
    )

    return Plan(
        params=params,
        params_per_model_parallel_rank=local,
        zero_stage=req.zero_stage,
        inputs=PlanInputs(**asdict(req), world_size=dp * tp * pp),
        bytes_per_param=BytesPerParam(
            weights=bytes_["weights"],
            grads=bytes_["grads"],
            optimizer_K=optimizer_bytes_per_param(req.optimizer, precision),
        ),
        model_state_bytes_per_device={s: b["total"] for s, b in breakdown.items()},
        model_state_breakdown_per_device=breakdown,
        activation_bytes_per_layer=activations,
        activation_bytes_per_device=per_device,
        bubble_fraction=bubble_fraction(pp, req.micro_batches),
        comm_bytes_per_device=comm_bytes_per_device(local, dp, bytes_["grads"]),
    )


def _check_layout(params, dp, tp, pp, zero_stage, micro_batch, micro_batches) -> None:
    if isinstance(params, bool) or not isinstance(params, int) or params < 1:
        raise ValueError(f"params must be a positive integer, got {params!r}")
    for name, v in (
        ("dp", dp),
        ("tp", tp),
        ("pp", pp),
        ("micro_batch", micro_batch),
        ("micro_batches", micro_batches),
    ):
        _positive_int(name, v)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")


def _activations(
    seq, micro_batch, hidden, heads, tp, pp, n_layers, micro_batches, pp_schedule, bytes_
) -> tuple[dict[str, int] | None, dict[str, int] | None]:
    """(per layer, per device) activation bytes of each variant; None where the shape is not given."""
    activations: dict[str, int] | None = None
    per_device: dict[str, int] | None = None
    if seq is not None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
        activations = activation_variants(
            seq, micro_batch, hidden, heads, tp, bytes_per_value=bytes_["weights"]
        )
        if n_layers is not None:
            _positive_int("n_layers", n_layers)
            layers_per_stage = -(-n_layers // pp)
            in_flight = micro_batches_in_flight(pp, micro_batches, pp_schedule)
            per_device = {k: v * layers_per_stage * in_flight for k, v in activations.items()}
    return activations, per_device


def _section(manifest: dict, name: str) -> dict:
    sec = manifest.get(name)
    if not isinstance(sec, dict):
        raise BadInput("manifest", "missing section", field=name)
    return sec


def _need(sec: dict, section: str, key: str, default: Any = ...) -> Any:
    if key not in sec or sec[key] is None:
        if default is ...:
            raise BadInput("manifest", "missing", field=f"{section}.{key}")
        return default
    return sec[key]


_DTYPE_PRECISION = {"float32": "fp32", "float64": "fp64", "bfloat16": "mixed", "float16": "mixed"}


_MANIFEST_OPTIMIZER = {
    "adamw": "adamw",
    "adam": "adam",
    "sgd": "sgd",
    "sgd_momentum": "sgd_momentum",
}


def plan_from_manifest(manifest: Any) -> Plan:
    """Plan the layout a manifest describes, from its numbers alone (never builds the model).

    model {dim, n_layers, n_heads, n_kv_heads, vocab_size, max_seq_len, multiple_of, ffn_hidden|None}
    parallelism {dp, tp, pp, zero_stage[, pp_schedule]}
    training {micro_batch_size, grad_accum_steps, dtype[, optimizer]}

    float32 training plans as "fp32" (4-byte weights and grads, K = 8 for Adam), float64 as "fp64"
    (8 and 16), bfloat16/float16 as mixed precision (2, 2, K = 12). The pipeline runs grad_accum_steps
    micro-batches per step. Bad or missing fields raise BadInput naming the field.
    """
    if hasattr(manifest, "model_dump"):  # a pydantic Manifest works as well as its dict
        manifest = manifest.model_dump()
    if not isinstance(manifest, dict):
        raise BadInput("manifest", f"expected a mapping, got {type(manifest).__name__}")
    model, par, train = (_section(manifest, n) for n in ("model", "parallelism", "training"))
    dtype, opt = _dtype_and_optimizer(train)
    shape = _plan_model(model)
    try:
        params = count_params(
            shape.dim,
            shape.n_layers,
            shape.n_heads,
            shape.n_kv_heads,
            shape.vocab_size,
            shape.ffn_hidden,
        )
    except ValueError as e:
        raise BadInput("manifest", str(e), field="model") from None

    zero_stage = _field("parallelism", par, "zero_stage", 0)
    if zero_stage not in ZERO_STAGES:
        raise BadInput(
            "manifest", f"must be 0..3, got {zero_stage}", field="parallelism.zero_stage"
        )
    schedule = _need(par, "parallelism", "pp_schedule", "1f1b")
    req = PlanRequest(
        params,
        dp=_field("parallelism", par, "dp"),
        tp=_field("parallelism", par, "tp", 1),
        pp=_field("parallelism", par, "pp", 1),
        zero_stage=zero_stage,
        optimizer=_MANIFEST_OPTIMIZER[opt],
        precision=_DTYPE_PRECISION[dtype],
        seq=shape.max_seq_len,
        micro_batch=_field("training", train, "micro_batch_size"),
        hidden=shape.dim,
        heads=shape.n_heads,
        n_layers=shape.n_layers,
        micro_batches=_field("training", train, "grad_accum_steps", 1),
        pp_schedule=schedule,
    )
    try:
        result = plan(req)
    except ValueError as e:
        raise BadInput("manifest", str(e)) from None
    result.model = shape
    result.inputs.dtype = dtype
    _experts_and_context(result, model, par, req)
    result.update_copy_bytes_per_device = _update_copy(manifest, par, result)
    return result


def _update_copy(manifest: dict, par: dict, result: Plan) -> int:
    """The bytes of the update records' copy of the parameters on each device (Plan's field)."""
    record = manifest.get("record") or {}
    if (
        not isinstance(record, dict)
        or record.get("enabled") is False
        or record.get("updates") is False
    ):
        return 0
    if (
        result.zero_stage == 3
        or result.inputs.tp > 1
        or par.get("architecture") == "parameter-server"
    ):
        return 0
    return result.params_per_model_parallel_rank * result.bytes_per_param.weights


def _experts_and_context(result: Plan, model: dict, par: dict, req: PlanRequest) -> None:
    """A mixture's parameters and expert parallel's, and context parallel's, figures (see costs.py)."""
    shape = result.model
    n_experts = model.get("n_experts") or 0
    ep, cp = _field("parallelism", par, "ep", 1), _field("parallelism", par, "cp", 1)
    values = PRECISIONS[req.precision]["weights"]
    if n_experts:
        moe = expert_params(shape.dim, shape.n_layers, shape.ffn_hidden, n_experts)
        dense = result.params - moe["dense_ffn"] + moe["router"]
        state = (
            PRECISIONS[req.precision]["weights"]
            + PRECISIONS[req.precision]["grads"]
            + optimizer_bytes_per_param(req.optimizer, req.precision)
        )
        result.params = dense + moe["experts"]
        result.experts = {
            "n_experts": n_experts,
            "ep": ep,
            "expert_params": moe["experts"],
            "dense_params": dense,
            **ep_costs(
                dense,
                moe["experts"],
                req.dp,
                ep,
                req.micro_batch * shape.max_seq_len,
                shape.dim,
                _field("model", model, "top_k", 2),
                shape.n_layers,
                values,
                state,
            ),
        }
    if cp > 1:
        result.inputs.world_size *= cp
        kv_dim = shape.n_kv_heads * (shape.dim // shape.n_heads)
        result.context = {
            "cp": cp,
            "seq_per_device": -(-shape.max_seq_len // cp),
            **cp_costs(cp, req.micro_batch, shape.max_seq_len, kv_dim, shape.n_layers, values),
        }
        if result.activation_bytes_per_device is not None:  # each rank holds 1/cp of the sequence
            result.context["activation_bytes_per_device"] = {
                k: -(-v // cp) for k, v in result.activation_bytes_per_device.items()
            }


def _dtype_and_optimizer(train: dict) -> tuple[str, str]:
    """The training section's dtype and optimizer, each one the planner knows."""
    dtype = _need(train, "training", "dtype", "float32")
    if dtype not in _DTYPE_PRECISION:
        raise BadInput(
            "manifest",
            f"unknown dtype {dtype!r} (float32, float64, bfloat16)",
            field="training.dtype",
        )
    opt = _need(train, "training", "optimizer", "adamw")
    if opt not in _MANIFEST_OPTIMIZER:
        raise BadInput("manifest", f"unknown optimizer {opt!r}", field="training.optimizer")
    return dtype, opt


def _field(section: str, sec: dict, key: str, default: Any = ...) -> int:
    """An integer field of the manifest (zero_stage may be 0, the others positive), named if bad."""
    v = _need(sec, section, key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "zero_stage" else 1):
        raise BadInput(
            "manifest", f"must be a positive integer, got {v!r}", field=f"{section}.{key}"
        )
    return v


def _plan_model(model: dict) -> PlanModel:
    """The model section's shape, the FFN width by LLaMA's rule where the manifest leaves it out."""
    dim = _field("model", model, "dim")
    n_layers = _field("model", model, "n_layers")
    n_heads = _field("model", model, "n_heads")
    n_kv_heads = _field("model", model, "n_kv_heads", n_heads)
    vocab = _field("model", model, "vocab_size")
    seq = _field("model", model, "max_seq_len")
    ffn = model.get("ffn_hidden")
    if ffn is None:
        ffn = ffn_hidden_default(dim, _field("model", model, "multiple_of", 32))
    else:
        ffn = _field("model", model, "ffn_hidden")
    return PlanModel(dim, n_layers, n_heads, n_kv_heads, vocab, seq, ffn)


def plan_cli_args(req: PlanRequest) -> Plan:
    """What `disttrace plan --params 7.5B --dp 64 ...` runs. `req.params` may be '7.5B'-style text; without it,
    hidden and n_layers give the 12*L*h^2 estimate (noted in inputs.params_source). Errors raise BadInput
    naming the option."""
    source = "given"
    try:
        if req.params is None:
            if req.hidden is None or req.n_layers is None:
                raise BadInput("--params", "give --params, or --hidden and --layers to estimate it")
            count = estimate_params(req.hidden, req.n_layers)
            source = "estimated as 12*layers*hidden^2 (Kaplan et al. 2020), embeddings left out"
        else:
            count = parse_count(req.params)
    except ValueError as e:
        raise BadInput("--params", str(e)) from None
    try:
        result = plan(replace(req, params=count))
    except ValueError as e:
        raise BadInput("disttrace plan", str(e)) from None
    result.inputs.params_source = source
    return result
