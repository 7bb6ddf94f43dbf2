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


def _stage_layers(n_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(
        n_layers, pp
    )  # as run/parallel/pp.stage_layers: earlier stages take the remainder
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def parameter_names(model: dict, pp: int = 1, stage: int = 0) -> list[str]:
    """Names of the parameters one pipeline stage holds (the whole model when pp = 1)."""
    names = ["tok_embeddings.weight"] if stage == 0 else []
    for i in _stage_layers(int(model["n_layers"]), pp, stage):
        names += [f"layers.{i}.{b}" for b in BLOCK]
    if stage == pp - 1:
        names += ["norm.weight", "output.weight"]
    return names
