"""The model's parameter names in registration order, from the manifest alone (no torch): what a fault spec
may name is checked before any process starts. `tests/test_fault_proof.py` holds this list against the
built model's `named_parameters()` and the pipeline's stage split against `run/parallel/pp.stage_layers`."""

from __future__ import annotations

BLOCK = (
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",
    "feed_forward.w2.weight",
    "feed_forward.w3.weight",
)
# a block whose FFN is a mixture of experts (model.n_experts > 0): the router, then the stacked experts
MOE_BLOCK = (
    *BLOCK[:6],
    "moe.router.gate.weight",
    "moe.experts.w1.weight",
    "moe.experts.w2.weight",
    "moe.experts.w3.weight",
)


def _stage_layers(n_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(
        n_layers, pp
    )  # as run/parallel/pp.stage_layers: earlier stages take the remainder
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def parameter_names(model: dict, pp: int = 1, stage: int = 0) -> list[str]:
    """Names of the parameters one pipeline stage holds (the whole model when pp = 1)."""
    names = ["tok_embeddings.weight"] if stage == 0 else []
    block = MOE_BLOCK if model.get("n_experts") else BLOCK
    for i in _stage_layers(int(model["n_layers"]), pp, stage):
        names += [f"layers.{i}.{b}" for b in block]
    if stage == pp - 1:
        names += ["norm.weight", "output.weight"]
    return names


# The classes a calibration measures its noise per (analysis/calibration.py): tensors of one class play one
# part in the step (an attention projection's gradient cancels through the softmax, an MLP's does not, a
# norm's weight sees a normalised input), so one class's noise is not another's.
CLASSES = ("embedding", "attention", "mlp", "norm", "output", "other")

# how a module name of each class looks: this model's names, then the usual ones of other models (an
# attached script's: Hugging Face's LLaMA, GPT-2, ...); a name's modules are tried in order, norms first
# (`attention_norm` is a norm)
_MODULES = (
    ("norm", lambda m: m.endswith("norm") or m.startswith("ln")),
    ("embedding", lambda m: "embed" in m or m in ("wte", "wpe")),
    (
        "attention",
        lambda m: m == "attention" or "attn" in m or m in ("q_proj", "k_proj", "v_proj", "o_proj"),
    ),
    (
        "mlp",
        lambda m: (
            m
            in (
                "feed_forward",
                "mlp",
                "ffn",
                "fc1",
                "fc2",
                "c_fc",
                "gate_proj",
                "up_proj",
                "down_proj",
                "moe",
                "experts",
            )
        ),
    ),
    ("output", lambda m: m in ("output", "lm_head")),
)


def tensor_class(name: str | None) -> str:
    """The class of a record's tensor, by its name: a parameter's, or its optimizer state's
    (`layers.0.feed_forward.w1.weight:exp_avg` is mlp); a record of no parameter (the loss, the global
    gradient norm, the clip coefficient, a learning rate, the model's output) is `other`."""
    base = (name or "").split(":", 1)[0].lower()
    modules = base.split(".")[:-1]  # a parameter's name ends with its own (weight, bias)
    if not modules or modules[0] == "param_groups":
        return "other"
    for cls, match in _MODULES:
        if any(match(m) for m in modules):
            return cls
    return "other"
