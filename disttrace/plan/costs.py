"""The planner: how much memory and traffic a training layout needs, worked out on paper, with no job.

Every number here is closed-form arithmetic from a published paper, so a student can check it by hand:

* model-state memory (parameters, gradients, optimizer states) per device under ZeRO stages 0-3:
  Rajbhandari, Rasley, Ruwase, He (2020), "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models", SC'20 (arXiv:1910.02054), Section 3.1, Section 5 and Figure 1 / Table 1;
* activation memory per transformer layer, with tensor parallelism, sequence parallelism and
  selective or full recomputation: Korthikanti, Casper, Lym, McAfee, Andersch, Shoeybi, Catanzaro
  (2022), "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198,
  MLSys 2023), Section 4 and Table 2;
* the pipeline bubble (p-1)/m: Huang et al. (2019) "GPipe"; Narayanan et al. (2021) "Memory-Efficient
  Pipeline-Parallel DNN Training" (PipeDream-Flush, i.e. 1F1B); Narayanan et al. (2021) "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Section 2.2;
* data-parallel traffic per device per step (ring collectives): ZeRO paper, Section 7.

This module imports no torch and never builds a model: a 1T-parameter plan is as instant as a tiny one.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from disttrace.model.shapes import ffn_hidden_default  # noqa: F401  (the planner's public name too)

GB = 10**9  # the ZeRO paper's "GB" (decimal)
GiB = 2**30  # what views/plan.py prints (binary)
MiB = 2**20

ZERO_STAGES = (0, 1, 2, 3)

# Bytes per element of each model-state tensor, by training precision.
#   weights, grads: the copies that forward/backward use;
#   master:         an fp32 copy of the weights kept by the optimizer (only under mixed precision);
#   state:          one optimizer state tensor (Adam's momentum or variance), kept in fp32 under mixed precision.
# ZeRO paper Section 3.1: "mixed-precision training of a model with Psi parameters using Adam requires
# enough memory to hold an fp16 copy of the parameters and the gradients, with memory requirements of
# 2Psi and 2Psi bytes respectively. In addition, it needs to hold the optimizer states: an fp32 copy of the
# parameters, momentum and variance, with memory requirements of 4Psi, 4Psi, and 4Psi bytes" -> K = 12.
# Without mixed precision there is no separate master copy: the weights are the master, so for fp32
# Adam K = 4 + 4 = 8 (momentum + variance) and weights/grads take 4 bytes each; fp64 doubles everything.
PRECISIONS: dict[str, dict[str, int]] = {
    "mixed": {
        "weights": 2,
        "grads": 2,
        "master": 4,
        "state": 4,
    },  # fp16/bf16 compute, fp32 optimizer
    "fp32": {"weights": 4, "grads": 4, "master": 0, "state": 4},
    "fp64": {"weights": 8, "grads": 8, "master": 0, "state": 8},
}
_PRECISION_ALIASES = {
    "bf16": "mixed",
    "fp16": "mixed",
    "bfloat16": "mixed",
    "float16": "mixed",
    "float32": "fp32",
    "float64": "fp64",
}

# Number of per-parameter state tensors each optimizer keeps.
OPTIMIZER_STATES = {
    "adam": 2,  # momentum (exp_avg) and variance (exp_avg_sq)
    "adamw": 2,
    "sgd": 0,  # plain SGD, torch's default momentum=0: no state at all
    "sgd_momentum": 1,  # one momentum buffer
}

# Activation variants planned by plan(), with the Korthikanti et al. (2022) Table 2 formula each one uses.
ACTIVATION_VARIANTS = {
    "none": ("sbh(34 + 5as/h)", "no parallelism, no recomputation"),
    "tp": ("sbh(10 + 24/t + 5as/(ht))", "tensor parallel"),
    "tp_selective": ("sbh(10 + 24/t)", "tensor parallel + selective recomputation"),
    "tp_sp": ("sbh(34/t + 5as/(ht))", "tensor + sequence parallel"),
    "selective": ("sbh(34/t)", "tensor + sequence parallel + selective recomputation"),
    "full": ("2sbh", "full recomputation: only the layer input is kept"),
}


def _ceil(x: Fraction | int) -> int:
    """Round a non-negative exact fraction up to an integer number of bytes."""
    x = Fraction(x)
    return -((-x.numerator) // x.denominator)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _precision(precision: str) -> str:
    p = _PRECISION_ALIASES.get(precision, precision)
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return p


def _optimizer(optimizer: str) -> str:
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    return optimizer


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def count_params(
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    vocab_size: int,
    ffn_hidden: int,
    untied: bool = True,
) -> int:
    """Exact parameter count of the LLaMA-style decoder in disttrace/model.py (no biases anywhere).

    per layer:
        attention  wq: dim*dim, wk and wv: dim*(n_kv_heads*head_dim) each (grouped-query attention),
                   wo: dim*dim, with head_dim = dim // n_heads
        SwiGLU     w1 and w3: dim*ffn_hidden each, w2: ffn_hidden*dim
        two RMSNorm weights: dim each
    plus token embedding vocab*dim, the final RMSNorm dim, and the output head vocab*dim (0 if tied).
    """
    for name, v in (
        ("dim", dim),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("n_kv_heads", n_kv_heads),
        ("vocab_size", vocab_size),
        ("ffn_hidden", ffn_hidden),
    ):
        _positive_int(name, v)
    if dim % n_heads:
        raise ValueError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
    head_dim = dim // n_heads
    kv_dim = n_kv_heads * head_dim
    attention = dim * dim + 2 * dim * kv_dim + dim * dim
    feed_forward = 3 * dim * ffn_hidden
    norms = 2 * dim
    per_layer = attention + feed_forward + norms
    embedding = vocab_size * dim
    head = vocab_size * dim if untied else 0
    return n_layers * per_layer + embedding + dim + head


def estimate_params(hidden: int, n_layers: int) -> int:
    """Rough size of a GPT-style transformer when only hidden and layers are known: 12 * L * h^2
    (4h^2 attention + 8h^2 MLP per layer; Kaplan et al. 2020, "Scaling Laws for Neural Language Models",
    Section 2.1). Embeddings and norms are left out."""
    return 12 * _positive_int("layers", n_layers) * _positive_int("hidden", hidden) ** 2


def parse_count(text: str | int) -> int:
    """'7.5B' -> 7_500_000_000; also K, M, T and plain integers ('6738415616', '6_738_415_616')."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", str(text))
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (try 7.5B, 350M, 1T or an integer)")
    scale = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}[m.group(2).lower()]
    value = Fraction(m.group(1).replace("_", "")) * scale
    if value.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of parameters")
    return int(value)


# --------------------------------------------------------------------------------------------------
# Model states under ZeRO (Rajbhandari et al. 2020)
# --------------------------------------------------------------------------------------------------


def optimizer_bytes_per_param(optimizer: str = "adam", precision: str = "mixed") -> int:
    """K in the ZeRO paper: bytes of optimizer state per parameter.
    mixed Adam: 4 (fp32 master) + 4 (momentum) + 4 (variance) = 12; fp32 Adam: 8; fp64 Adam: 16."""
    bytes_ = PRECISIONS[_precision(precision)]
    return bytes_["master"] + OPTIMIZER_STATES[_optimizer(optimizer)] * bytes_["state"]


def model_state_bytes(
    params: int, dp: int, zero_stage: int, optimizer: str = "adam", precision: str = "mixed"
) -> dict[str, int]:
    """Bytes of model states one data-parallel rank holds (ZeRO paper, Section 5 and Figure 1).

    With Psi parameters, N = dp ranks, and (mixed precision Adam) 2 bytes weights, 2 bytes grads, K = 12:

        stage 0 (plain DDP)  (2 + 2 + K) * Psi             = 16 Psi
        stage 1 (P_os)        2 Psi + 2 Psi + K * Psi / N
        stage 2 (P_os+g)      2 Psi + (2 + K) * Psi / N
        stage 3 (P_os+g+p)    (2 + 2 + K) * Psi / N

    fp32/fp64 training uses the same shape with 4/8-byte weights and grads and K = 8/16 for Adam.
    A sharded tensor is split into N flat pieces of ceil(Psi / N) elements (the last one padded, as
    DeepSpeed and FSDP do), so every number is a whole count of bytes.
    Returns {"params", "grads", "optimizer", "total"} in bytes.
    """
    if isinstance(params, bool) or not isinstance(params, int) or params < 0:
        raise ValueError(f"params must be a non-negative integer, got {params!r}")
    _positive_int("dp", dp)
    if zero_stage not in ZERO_STAGES:
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    b = PRECISIONS[_precision(precision)]
    k = optimizer_bytes_per_param(optimizer, precision)

    shard = -(-params // dp)  # ceil(Psi / N): the elements of one rank's piece of a sharded tensor
    opt_elems = shard if zero_stage >= 1 else params  # stage 1 shards the optimizer states (P_os)
    grad_elems = shard if zero_stage >= 2 else params  # stage 2 also shards the gradients (P_g)
    param_elems = shard if zero_stage >= 3 else params  # stage 3 also shards the parameters (P_p)

    out = {
        "params": b["weights"] * param_elems,
        "grads": b["grads"] * grad_elems,
        "optimizer": k * opt_elems,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


# --------------------------------------------------------------------------------------------------
# Activations (Korthikanti et al. 2022)
# --------------------------------------------------------------------------------------------------


def activation_bytes_per_layer(
    seq: int,
    micro_batch: int,
    hidden: int,
    heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    bytes_per_value: int = 2,
) -> int:
    """Bytes of activations one transformer layer keeps for its backward pass, on one device.

    Korthikanti et al. (2022), Section 4.1 counts, for s = sequence length, b = micro-batch size,
    h = hidden size, a = attention heads, 16-bit activations (2 bytes) and 1-byte dropout masks:

        attention block   11 sbh + 5 as^2 b   (QKV input 2, Q and K 4, V 2, output-projection input 2,
                                               dropout mask 1; softmax output 2as^2b, its dropout mask
                                               as^2b, dropout output 2as^2b)
        MLP block         19 sbh              (input 2, GeLU input 8, second linear input 8, mask 1)
        two LayerNorms     4 sbh
        one layer         sbh (34 + 5as/h)    Table 2, "no parallelism"

    Their Table 2, which this function reproduces exactly (t = tensor-parallel size):

        tensor parallel                              sbh (10 + 24/t + 5as/(ht))
        tensor + sequence parallel                   sbh (34/t + 5as/(ht))
        tensor parallel + selective recompute        sbh (10 + 24/t)
        tensor + sequence parallel + selective       sbh (34/t)
        full recomputation                           sbh (2)

    Under plain tensor parallelism, 10 sbh are replicated on every rank (the two LayerNorm inputs 4,
    the attention and MLP inputs 2 + 2, the two dropout masks 1 + 1) and 24 sbh are split t ways;
    sequence parallelism splits the 10 too. Selective recomputation drops the 5as/h attention-score term.
    Full recomputation keeps only the layer input; the paper's Table 2 prints it as 2sbh whatever t
    and sequence parallelism are, and so does this function.

    bytes_per_value: 2 gives the paper's numbers. For 4- or 8-byte activations the values grow and the
    two 1-byte dropout masks do not: 34 -> 16v + 2, 5 -> 2v + 1, 10 -> 4v + 2, 24 -> 12v, 2 -> v.
    The result is rounded up to whole bytes.
    """
    s = _positive_int("seq", seq)
    b = _positive_int("micro_batch", micro_batch)
    h = _positive_int("hidden", hidden)
    a = _positive_int("heads", heads)
    t = _positive_int("tp", tp)
    v = _positive_int("bytes_per_value", bytes_per_value)
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")

    sbh = s * b * h
    replicated = 4 * v + 2  # 10 with 16-bit activations: kept whole on every tensor-parallel rank
    split = 12 * v  # 24 with 16-bit activations: divided by t under tensor parallelism
    score = (
        2 * v + 1
    )  # 5 with 16-bit activations: per element of the a*s*s*b attention-score tensors

    if recompute == "full":
        return v * sbh  # 2sbh: only the input of the layer is stored

    if sequence_parallel:
        linear = Fraction(replicated + split, t)  # 34/t
    else:
        linear = replicated + Fraction(split, t)  # 10 + 24/t (= 34 when t = 1)
    quadratic = Fraction(score * a * s, h * t)  # 5as/(ht)
    if recompute == "selective":
        quadratic = Fraction(0)  # the attention scores are recomputed in the backward pass
    return _ceil(sbh * (linear + quadratic))


def activation_variants(
    seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1, bytes_per_value: int = 2
) -> dict[str, int]:
    """Every row of Korthikanti et al. (2022) Table 2 for one configuration (see ACTIVATION_VARIANTS)."""
    args = (seq, micro_batch, hidden, heads)
    f = activation_bytes_per_layer
    return {
        "none": f(*args, tp=1, bytes_per_value=bytes_per_value),
        "tp": f(*args, tp=tp, bytes_per_value=bytes_per_value),
        "tp_selective": f(*args, tp=tp, recompute="selective", bytes_per_value=bytes_per_value),
        "tp_sp": f(*args, tp=tp, sequence_parallel=True, bytes_per_value=bytes_per_value),
        "selective": f(
            *args,
            tp=tp,
            sequence_parallel=True,
            recompute="selective",
            bytes_per_value=bytes_per_value,
        ),
        "full": f(*args, tp=tp, recompute="full", bytes_per_value=bytes_per_value),
    }


def micro_batches_in_flight(pp: int, micro_batches: int, schedule: str = "1f1b") -> int:
    """How many micro-batches' activations the first pipeline stage holds at its peak.
    GPipe runs every forward before any backward: all m. 1F1B (PipeDream-Flush) starts backwards after
    p forwards: min(p, m) (Korthikanti et al. 2022, Section 4.2.3; Narayanan et al. 2021)."""
    _positive_int("pp", pp)
    _positive_int("micro_batches", micro_batches)
    if schedule == "gpipe":
        return micro_batches
    if schedule == "1f1b":
        return min(pp, micro_batches)
    raise ValueError(f"schedule must be 'gpipe' or '1f1b', got {schedule!r}")


# --------------------------------------------------------------------------------------------------
# Pipeline bubble
# --------------------------------------------------------------------------------------------------


def bubble_fraction(pp: int, micro_batches: int) -> dict[str, float]:
    """Idle time of a pipeline with p stages and m micro-batches per step.

    "gpipe" and "1f1b" are bubble time / ideal compute time = (p-1)/m: a pipeline of p stages needs
    m + p - 1 slots for m micro-batches, so it idles p - 1 slots against m slots of useful work
    (GPipe, Huang et al. 2019; PipeDream-Flush (1F1B), Narayanan et al. 2021; Megatron-LM, Narayanan et al.
    2021, Section 2.2.1: "bubble time fraction = (p-1)/m"). 1F1B has the same bubble as GPipe; it only
    holds fewer micro-batches' activations at once.

    "of_total_time" is the same bubble measured against the whole step instead: (p-1)/(m+p-1)
    (GPipe's O((K-1)/(M+K-1))).
    """
    p = _positive_int("pp", pp)
    m = _positive_int("micro_batches", micro_batches)
    ideal = (p - 1) / m
    return {"gpipe": ideal, "1f1b": ideal, "of_total_time": (p - 1) / (m + p - 1)}


# --------------------------------------------------------------------------------------------------
# Data-parallel traffic (ZeRO paper, Section 7)
# --------------------------------------------------------------------------------------------------


def comm_bytes_per_device(params: int, dp: int, bytes_per_grad: int = 2) -> dict[str, int]:
    """Bytes each rank sends (and receives) per optimizer step for data parallelism, ring algorithms.

    A ring all-reduce of Psi elements is a reduce-scatter plus an all-gather, each moving (n-1)/n of
    the data through every rank: 2(n-1)/n * Psi elements (ZeRO paper Section 7.1: "2Psi").
        ddp, stage 0  all-reduce of the gradients                          2(n-1)/n * Psi * bytes
        stage 1, 2    reduce-scatter gradients + all-gather updated params  2(n-1)/n * Psi * bytes
        stage 3       + one more all-gather of params (forward and backward each gather; the
                      paper counts 3Psi in all, "1.5x" DDP, Section 7.2.2)   3(n-1)/n * Psi * bytes
    Rounded up to whole bytes; 0 when n = 1.
    """
    if isinstance(params, bool) or not isinstance(params, int) or params < 0:
        raise ValueError(f"params must be a non-negative integer, got {params!r}")
    n = _positive_int("dp", dp)
    _positive_int("bytes_per_grad", bytes_per_grad)
    volume = params * bytes_per_grad
    allreduce = _ceil(Fraction(2 * (n - 1), n) * volume)
    stage3 = _ceil(Fraction(3 * (n - 1), n) * volume)
    return {"ddp": allreduce, "0": allreduce, "1": allreduce, "2": allreduce, "3": stage3}


# --------------------------------------------------------------------------------------------------
# Expert and context parallel
# --------------------------------------------------------------------------------------------------


def expert_params(dim: int, n_layers: int, ffn_hidden: int, n_experts: int) -> dict[str, int]:
    """A mixture's parameters beside the dense model's: each layer's E SwiGLU experts (3 dim ffn_hidden
    each) replace its FFN, and its router adds dim E. {"experts": all layers' experts, "router": ...,
    "dense_ffn": the FFN weights they replace}."""
    for name, v in (("dim", dim), ("n_layers", n_layers), ("ffn_hidden", ffn_hidden)):
        _positive_int(name, v)
    _positive_int("n_experts", n_experts)
    return {
        "experts": n_layers * n_experts * 3 * dim * ffn_hidden,
        "router": n_layers * dim * n_experts,
        "dense_ffn": n_layers * 3 * dim * ffn_hidden,
    }


def ep_costs(
    dense: int,
    experts: int,
    dp: int,
    ep: int,
    tokens: int,
    dim: int,
    top_k: int,
    n_layers: int,
    bytes_per_value: int,
    state_bytes_per_param: int,
) -> dict[str, int]:
    """Expert parallel over `ep` of `dp` ranks, per device. Model state: the dense part (router included)
    whole, the experts' 1/ep slice; `state_bytes_per_param` is weights + grads + K. Traffic per micro-batch of
    `tokens` tokens a rank: each MoE layer sends its tokens' k routed copies to the experts' ranks and the
    outputs back, forward and again in backward (4 all-to-alls of tokens k dim values); with routing
    uniform over ranks (ep-1)/ep of them leave the rank. Per step: the dense gradients' ring all-reduce over
    dp, the expert slice's over the dp/ep ranks holding it."""
    _positive_int("dp", dp)
    _positive_int("ep", ep)
    if dp % ep:
        raise ValueError(f"ep ({ep}) must divide dp ({dp})")
    local = dense + -(-experts // ep)
    edp = dp // ep
    a2a = _ceil(Fraction(ep - 1, ep) * 4 * n_layers * tokens * top_k * dim * bytes_per_value)
    return {
        "params_per_device": local,
        "model_state_bytes_per_device": local * state_bytes_per_param,
        "all_to_all_bytes_per_micro_batch": a2a,
        "dense_allreduce_bytes_per_step": _ceil(
            Fraction(2 * (dp - 1), dp) * dense * bytes_per_value
        ),
        "expert_allreduce_bytes_per_step": _ceil(
            Fraction(2 * (edp - 1), edp) * -(-experts // ep) * bytes_per_value
        ),
    }


def cp_costs(
    cp: int, micro_batch: int, seq: int, kv_dim: int, n_layers: int, bytes_per_value: int
) -> dict[str, int]:
    """Context parallel over `cp` ranks (the all-gather form), per device and micro-batch: each layer
    gathers the whole sequence's keys and values (2 b S kv_dim values, (cp-1)/cp of them from others,
    held through backward), and backward all-reduces their gradients (ring: 2(cp-1)/cp of that volume)."""
    _positive_int("cp", cp)
    kv = 2 * micro_batch * seq * kv_dim * bytes_per_value
    return {
        "gathered_kv_bytes_per_layer": kv,
        "gathered_kv_bytes_per_device": kv * n_layers,
        "all_gather_bytes_per_micro_batch": _ceil(Fraction(cp - 1, cp) * kv * n_layers),
        "kv_grad_allreduce_bytes_per_micro_batch": _ceil(
            Fraction(2 * (cp - 1), cp) * kv * n_layers
        ),
    }
