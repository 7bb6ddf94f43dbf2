"""The numeric tolerance of `diff`: derived from the manifests, never tuned per test.

Two runs of one experiment on different topologies (dp=2 vs dp=1 with accumulation 2, ZeRO vs DDP, ...)
compute the same mathematical quantities with the floating-point operations done in a different order.
How far apart may their statistics legitimately be?

The model (standard backward error analysis, Higham, *Accuracy and Stability of Numerical Algorithms*,
ch. 3-4, with the probabilistic rounding model of Higham & Mary 2019):

* ``u`` is the unit roundoff of the *coarser* of the two runs' compute dtypes:
  2^-53 (float64), 2^-24 (float32), 2^-11 (float16), 2^-8 (bfloat16).
* A floating-point sum of ``n`` terms has a relative error (w.r.t. the sum of magnitudes) of at most
  ``(n-1)u`` in the worst case and of order ``u*sqrt(n)`` with independent rounding errors.
  Two different summation orders of the same ``n`` terms each carry such an error, so they differ by up
  to about ``2*u*sqrt(n)``: the constant ``c = 2``.
* One element of a weight gradient ``dW[i,j] = sum_t x[t,j] * delta[t,i]`` is a sum over the ``T`` tokens
  of the global batch, ``T = global_batch * max_seq_len`` (the token sum is exactly what dp, accumulation
  and micro-batch size split differently). Each term itself comes out of inner products of length ``d``
  (``d = max(dim, ffn_hidden)``) in the forward and backward passes, which another topology may block
  differently (another GEMM shape), giving each term a relative error of order ``u*sqrt(d)``. To first
  order the errors of a composition add (``gamma_T + gamma_d``, Higham Lemma 3.3), so one step gives

      eps_1 = c * u * (sqrt(T) + sqrt(d))

  (Multiplying the two factors instead, ``sqrt(T) * sqrt(d)``, has no basis in first-order analysis and
  measured 3 to 4 orders of magnitude above the actual errors, see below.)
* Errors compound through the optimizer roughly linearly with the number of steps ``k`` taken since the
  two runs last held the same state (``k = step - since``, ``since`` = the resume step of a recovered run,
  0 for runs started from scratch). Adam divides the first moment by the root of the second, so a relative
  error in the gradient stays a relative error of the same size in the update and in the moments
  (not multiplied by the learning rate or the gradient scale); parameters move by less than that relative
  to their size, so the same bound is an upper estimate for them:

      bound(step, phase) = k * eps_1          for backward, reduce, clip, optimizer, checkpoint
      bound(step, forward|loss) = k * c * u * sqrt(d_fwd * n_layers),  d_fwd = max(dim, ffn_hidden, max_seq_len, vocab_size)
      bound(step, data) = 0                   token ids are integers: they must be equal

The figure is a relative error, compared with the ``rel_err`` that diff computes from a record's float64
sum and L2 norm: ``max(|dnorm| / max(norm_a, norm_b), |dsum| / (max(norm_a, norm_b) * sqrt(numel)))``.
A user who passes ``rtol``/``atol`` overrides it: each quantity is then within ``atol + rtol * scale``
(scale = the norm, resp. norm * sqrt(numel)).

Example (float32, global batch 8 x 64 tokens, dim 64, ffn_hidden 192): T = 512, d = 192,
eps_1 = 2 * 5.96e-8 * (22.6 + 13.9) = 4.4e-6 per step.

Measured (CPU, one thread, AdamW, float32; micro-batch 4 x accumulation 2 against micro-batch 8, i.e. other
GEMM shapes, same global batch), largest rel_err over all gradients and optimizer state against the bound:
  dim 64, 2 layers, 8 x 64 tokens, 100 steps: 4e-8 at step 1, 1e-7..9e-7 later; err/bound 4e-2 .. 1e-3
  dim 128, 4 layers, 16 x 128 tokens, 30 steps: 4e-8 at step 1, 5e-7..4e-6 later; err/bound 6e-2 .. 5e-3
Parameters differ less (1e-8..3e-8). float64: 1e-16..2.5e-15 against 8e-15 * k. The product form
sqrt(T) * sqrt(d) would have sat 3 to 4 orders of magnitude above these errors. dp=2 against dp=1 with
accumulation 2 at the same micro-batch size was bit-identical on CPU (each micro-batch computes the same,
the 1/2 scaling is exact and a two-term sum commutes), so there the measured error is 0.

Magnitudes: why a record's own norm is the wrong scale, and what replaces it
----------------------------------------------------------------------------

Everything above is relative to the norm of the *result*; rounding error is relative to the magnitudes of
what was summed (Higham Thm 3.1: ``|fl(sum x_i) - sum x_i| <= gamma_n sum |x_i|``). Where the terms cancel the
two differ by orders of magnitude, and a bound on the norm's scale calls rounding a divergence. Measured:
a 32-layer dim-32 model, dp=2 x accumulation 2 against dp=1 x accumulation 4 (same micro-batches), 60 steps:
the norm-relative bound called step 6's reduced gradient of ``layers.4.attention.wq.weight`` divergent
(and the issue's run, step 11, ``layers.28.attention.wk.weight``, norm 5.6e-8: a key projection's gradient
passes through the softmax, whose Jacobian rows sum to zero, so its sum over tokens nearly cancels).
The cancellation is inside each micro-batch's backward, so the per-micro-batch gradient records do not
bound it either.

The scale that does: a parameter's gradient is a bilinear form in what its module saw, ``dW = dY^T X``
(linear layers), ``dw_j = sum_t dy_tj xhat_tj`` (RMSNorm, ``xhat = x / rms(x)``), ``dE = onehot^T dY``
(embedding). Elementwise ``|dW| <= |dY|^T |X|`` and ``|| |dY|^T |X| ||_F <= ||X||_F ||dY||_F =: M``
(Cauchy-Schwarz). A relative error eps in X and in dY -- rounding, or a state that has drifted -- moves dW by
at most ``(2 eps + eps^2) M`` however much the sum cancels, and the GEMM's own rounding adds ``gamma_T M``.
run/record/scales.py records M per parameter and micro-batch (an RMSNorm's ``||xhat|| <= sqrt(numel)``; an
embedding's ``||onehot|| = sqrt(tokens)``), accumulated like the gradient; analysis/magnitudes.py turns it
into the scale of each record: a rank's accumulated gradient (``backward``) its own M, the reduced and the
clipped gradient (``reduce``, ``clip``; clipping multiplies by a coefficient <= 1) the sum over ranks / dp,
Adam's moments the same running averages of the gradients' M that the moments are of the gradients
(``exp_avg``: ``beta1 M_m + (1 - beta1) M_g``; ``exp_avg_sq``: ``beta2 M_v + (1 - beta2) M_g^2``, with the factor 2
of ``d(g^2) = 2 g dg``), started where the runs last agreed. With magnitudes, diff's relative error of a
record is taken against ``max(norm_a, norm_b, M_a, M_b)`` instead of ``max(norm_a, norm_b)``: at least as
large as before, so the bound is never tighter than the old one anywhere, and it is the scale the
rounding-error theorem is stated in. Stores without magnitudes (written before them, or by an attached DeepSpeed engine)
keep the norm-relative bound, and diff says so (``tolerance.scale: "norm"``).

Where no sound bound exists: a parameter under Adam moves by ``lr * m / (sqrt(v) + eps)``, a ratio of two
quantities that may both cancel; when they do, two equivalent runs' updates differ by up to the learning
rate itself, whatever the magnitudes. Diff gives those records ``bound_kind: "none"`` (their error is
reported, never called a divergence) and relies for parameters on what is sound: the step's update is
bounded (its record ``NAME:update``, analysis/updates.py), replicas of one run must be bit-identical, and
a parameter that differs changes the next step's gradients, which are bounded. Under
SGD ``dp = -lr g`` and ``M_p`` is the sum of ``lr M_g``.

Compounding
-----------

Two equivalent runs agree bit for bit only at ``since``; after k steps their states differ, and so do the
X and dY every gradient is made of. How much is not a theorem (it is the training's sensitivity); it is
measured (``bench/tolerance_growth.py A B``: per step, the largest error relative to the magnitudes divided
by eps_1, and the largest err/bound of any bounded record) and the rule ``growth(k) = k`` kept because it
stays above every measurement with margin. Measured (CPU, float32, AdamW), the largest err/bound of any
bounded record over all steps, and where:

  32 layers, dim 32, seq 32, dp=2 x accum 2 vs dp=1 x accum 4, 60 steps:  0.23 (step 4; optimizer state),
      reduce 0.19 (step 6); falling to 0.02..0.15 after step 10 (the errors grow slower than k).
      Against the norm-relative scale the same stores diverge: reduce err / (k eps_1) up to 2.36.
  dim 64, 2 layers, dp=2 x accum 2 vs dp=1 x accum 4, 20 steps:          0.020 (loss, step 2)
  dim 64, 2 layers, micro-batch 8 (no accum) vs 4 x accum 4, 20 steps:    0.52 (exp_avg_sq, step 6),
      another GEMM shape: the largest of these measurements, hence the margin of the rule, ~2x.

Bench commands (each run with `disttrace run manifests/default.toml --set ...`):
``python bench/tolerance_growth.py RUN_A RUN_B`` (``--norm``: as if no magnitudes had been recorded).
"""

from __future__ import annotations

import math

U64, U32 = 2.0**-53, 2.0**-24  # float64's and float32's unit roundoff
UNIT_ROUNDOFF = {
    "float64": U64,
    "float32": U32,
    "tf32": 2.0**-11,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}
C_ORDER = 2.0  # two different summation orders, each with an error of u*sqrt(n)

# keys of the training section that may name a (lower) precision used somewhere in the step
_DTYPE_KEYS = ("dtype", "compute_dtype", "param_dtype", "reduce_dtype")

EXACT_PHASES = ("data",)
ACTIVATION_PHASES = ("forward", "loss")


def unit_roundoff(manifest: dict) -> float:
    """The unit roundoff of the coarsest dtype a run's manifest names (float32 when it names none)."""
    t = manifest.get("training", {}) or {}
    us = [UNIT_ROUNDOFF.get(str(t[k]).removeprefix("torch."), U32) for k in _DTYPE_KEYS if t.get(k)]
    return max(us) if us else U32


def tokens_per_step(manifest: dict, observed: dict | None = None) -> int:
    """T, the tokens of one global batch: the harness states it (dp x micro-batch x accumulation x sequence
    length). An attached run states no such factors; it counted them (`observed`, written into its lock at
    close: the samples of a step summed over the world, and the tokens when its inputs were token ids).
    A factor nobody counted is taken as 1 only where nothing better is known: the bound must have a number,
    and a smaller T only makes it tighter, never looser."""
    t = _stated_tokens(manifest, observed)
    # what the records showed (diff counts the data records it compares: `tokens_shown`) caps a statement
    shown = observed.get("tokens_shown") if isinstance(observed, dict) else None
    if isinstance(shown, int) and not isinstance(shown, bool) and shown >= 1:
        return min(t, shown)
    return t


def _stated_tokens(manifest: dict, observed: dict | None) -> int:
    from disttrace.config.identity import global_batch, harness_manifest, known_global_batch

    seq = int((manifest.get("model", {}) or {}).get("max_seq_len", 1) or 1)
    if harness_manifest(manifest) or not isinstance(observed, dict):
        return global_batch(manifest) * seq
    tokens = observed.get("tokens")
    if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1:
        return tokens
    counted, _ = known_global_batch(manifest, observed)
    return (counted if counted is not None else global_batch(manifest)) * seq


def inner_dim(manifest: dict) -> int:
    """d, the widest inner dimension: the model's width or its FFN's. An attached run's manifest lists its
    tensors instead: the largest dimension of any matrix (a linear layer contracts over its input dimension
    forward and its output dimension backward; an embedding's vocabulary is counted too, which only widens
    the bound)."""
    m = manifest.get("model", {}) or {}
    if "dim" not in m and isinstance(m.get("tensors"), dict):
        dims = [
            int(n)
            for t in m["tensors"].values()
            if isinstance(t, dict) and isinstance(t.get("shape"), list) and len(t["shape"]) >= 2
            for n in t["shape"]
            if isinstance(n, int)
        ]
        return max(dims, default=1)
    dim = int(m.get("dim", 1))
    return max(dim, int(m.get("ffn_hidden") or dim))


def step_bound(
    manifest_a: dict, manifest_b: dict, phase: str, observed: tuple = (None, None)
) -> float:
    """eps for one step (k = 1) of one phase; see the module docstring. `observed`: each run's lock's
    `observed` (attached runs; see tokens_per_step)."""
    if phase in EXACT_PHASES:
        return 0.0
    u = max(unit_roundoff(manifest_a), unit_roundoff(manifest_b))
    if phase in ACTIVATION_PHASES:
        m = manifest_a.get("model", {}) or {}
        d = max(inner_dim(manifest_a), int(m.get("max_seq_len", 1)), int(m.get("vocab_size", 1)))
        return C_ORDER * u * math.sqrt(d * int(m.get("n_layers", 1)))
    t = max(tokens_per_step(manifest_a, observed[0]), tokens_per_step(manifest_b, observed[1]))
    return C_ORDER * u * (math.sqrt(t) + math.sqrt(inner_dim(manifest_a)))


def growth(k: int) -> float:
    """How the per-step bound compounds over the k steps since the runs last agreed (see "Compounding")."""
    return float(k)


def bound(
    manifest_a: dict,
    manifest_b: dict,
    step: int,
    phase: str,
    since: int = 0,
    magnitudes: bool = False,
    observed: tuple = (None, None),
    eps: float | None = None,
) -> float:
    """The largest relative error (see module docstring) two runs may show at `step` in `phase` and still
    count as the same computation: ``max(1, step - since) * step_bound(...)`` relative to the records' norms;
    with `magnitudes` (both runs recorded them), ``growth(k) * step_bound(...)`` relative to the larger of the
    norms and the magnitudes that produced the record (see "Magnitudes"). `eps`: step_bound(...) of these
    manifests and phase, when the caller has it (it does not depend on the step)."""
    k = max(1, int(step) - int(since))
    if eps is None:
        eps = step_bound(manifest_a, manifest_b, phase, observed)
    if magnitudes and phase not in ACTIVATION_PHASES:
        return growth(k) * eps
    return k * eps


def tensor_factor(name: str | None) -> float:
    """Per-tensor factor on the bound. Adam's second moment accumulates g*g: the relative error of a
    square is twice that of its root (d(g^2)/g^2 = 2 dg/g), so exp_avg_sq gets 2x the gradient's bound.
    Measured: dp=2 (micro-batch 8) vs dp=1 (micro-batch 4, accumulation 4), an RMSNorm weight's gradient
    differed by 4.8e-6 and its exp_avg_sq by 1.9e-5 at step 2 (bench/equivalence.py)."""
    return 2.0 if name and name.endswith(":exp_avg_sq") else 1.0


def projection_terms(
    ra: dict, rb: dict, scale: float, projections: int | None = None
) -> list[float]:
    """|<x_a - x_b, v>| / scale for v = the all-ones vector (the sum) and each random projection of the
    records' sketches (run/record/digest.py). Every v has ||v|| = sqrt(numel), so one scale (norm * sqrt(numel))
    and one bound serve them all: with |dx_i| <= eps |x_i|, |<dx, v>| <= eps ||x|| ||v||. A record without
    a sketch (written before it existed) compares on the sum alone; `projections`: only that many leading
    projections have the same vectors in both records (sketches of two versions:
    store.trajectory.shared_projections), the others are left out."""
    out = [abs(float(ra["sum"]) - float(rb["sum"])) / scale]
    ka, kb = ra.get("sketch"), rb.get("sketch")
    if projections is not None and isinstance(ka, list) and isinstance(kb, list):
        ka, kb = ka[:projections], kb[:projections]
    if isinstance(ka, list) and isinstance(kb, list) and len(ka) == len(kb):
        try:
            out += [abs(float(x) - float(y)) / scale for x, y in zip(ka, kb)]
        except (TypeError, ValueError):
            pass  # a malformed sketch compares on the sum alone
    return out


# run/record/digest.py contracts a float32 tensor's sketch in float32 over at most this many rows at a time (one
# GEMV per cache-sized block, accumulated in float64); float64 tensors and integers in float64
SKETCH_ROWS = 512
# dtypes whose sketch is computed (and stored) in float32: defined with the trajectory format
from disttrace.store.trajectory import SKETCH_FLOAT32  # noqa: E402


def sketch_rounding(dtype, shape) -> float:
    """The rounding of a recorded sketch projection, relative to norm * sqrt(numel) (the scale of
    projection_terms). run/record/digest.py computes sketch_k = sum_c W[c,k] * sum_r U[r,k] X[r,c] (X: rows = the
    leading axes, R of them; columns = the last axis, C; U[r,k] = u[r] for every k in the sketch's version
    2, a GEMV, and a factor per k in version 1, a GEMM: the same sums): the inner sums in float32 over
    n <= min(R, SKETCH_ROWS) rows, the rest in float64. An inner sum of n terms is off by at most gamma_n = n*u times
    its sum of magnitudes (Higham Thm 3.1), so |d sketch_k| <= gamma_n sum |U||X||W| <= gamma_n ||x||
    ||v_k|| = gamma_n ||x|| sqrt(numel) (Cauchy-Schwarz). As for the rest of this module the probabilistic
    size u*sqrt(n) is used instead of n*u (worst case n*u = 3e-5 for 512 rows would make the sketch 10x
    blunter than the sum for no measured reason); it still over-states the measured error, because the
    errors of the C columns and of the row blocks have independent signs and partly cancel
    (tests/test_sketch_cost.py checks every shape it tries against a float64 oracle within this
    figure). The float64 stages add u64*sqrt(R + C). A float32-computed sketch is also stored in float32
    (store/trajectory.py): one more rounding of at most u32 * |sketch_k| <= u32 ||x|| sqrt(numel), summed over
    shards within the same figure (Cauchy-Schwarz). A logical tensor combined from shards is bounded by
    its logical shape (each shard's R and C are at most the logical ones)."""
    try:
        shape = [int(n) for n in shape or []]
    except (TypeError, ValueError):
        return 0.0  # a malformed shape: diff reports the record's shape, not a crash
    if not shape:
        return 0.0  # a scalar's sketch is the value itself
    cols = max(shape[-1], 1)
    rows = max(math.prod(shape[:-1]), 1)
    in_float32 = str(dtype).removeprefix("torch.") in SKETCH_FLOAT32
    u = U32 if in_float32 else U64
    stored = U32 if in_float32 else 0.0
    return u * math.sqrt(min(rows, SKETCH_ROWS)) + U64 * math.sqrt(rows + cols) + stored


# run/record/digest.py reduces a float32 tensor of more than FLOAT64_STATS elements to its sum and sum of squares in
# groups of at most STAT_CHUNK elements (numpy: runs of consecutive elements, one float32 dot product each;
# run/record/fused.py: a column's elements in up to STAT_CHUNK consecutive rows), the groups added in float64;
# smaller tensors, float64 and integer ones in float64, whose rounding diff neglects (as it always has)
STAT_CHUNK = 128
FLOAT64_STATS = 1 << 14


def _in_float32(dtype, numel: int) -> bool:
    """Whether run/record/digest.py takes a tensor's sum and sum of squares in float32 runs: float32 and the
    narrower floats (converted to float32 exactly) of more than FLOAT64_STATS elements."""
    return str(dtype).removeprefix("torch.") in SKETCH_FLOAT32 and numel > FLOAT64_STATS


def _numel(shape) -> int | None:
    try:
        return max(math.prod(int(n) for n in shape or []), 1)
    except (TypeError, ValueError):
        return None  # a malformed shape: diff reports the record's shape, not a crash


def sum_rounding(dtype, shape) -> float:
    """The rounding of a recorded sum, relative to norm * sqrt(numel) (the scale of projection_terms: the sum
    is <x, 1>). run/record/digest.py sums a float32 tensor in groups of n <= STAT_CHUNK elements in float32 (runs
    of consecutive elements, a dot product with ones in whatever order the BLAS takes; in run/record/fused.py a
    column's elements in up to STAT_CHUNK consecutive rows), the groups' sums added in float64. A
    group's sum is off by at most gamma_n times its sum of magnitudes (Higham Thm 3.1), u sqrt(n) in the
    probabilistic model the sketch's rounding uses, and sum |x| <= ||x|| sqrt(numel) (Cauchy-Schwarz);
    u64 sqrt(numel) covers the float64 stage (one-row tensors and device digests take the whole sum in
    float64, which this over-states). A tensor of at most FLOAT64_STATS elements (and a float64 or integer
    one) is summed in float64, whose rounding is neglected as it always was: 0. A scalar's sum is its value. A logical tensor
    combined from shards: the shards' errors add up to at most the same figure (Cauchy-Schwarz again)."""
    numel = _numel(shape)
    if numel is None or not shape or not _in_float32(dtype, numel):
        return 0.0
    u32, u64 = U32, U64
    return u32 * math.sqrt(min(numel, STAT_CHUNK)) + u64 * math.sqrt(numel)


def norm_rounding(dtype, shape) -> float:
    """The rounding of a recorded norm, relative to the norm. run/record/digest.py adds a float32 tensor's squares
    in the same runs (a dot product: gamma_n of the run's sum, every term positive, plus u for the squares
    themselves when the products are not fused), the runs in float64 (u64 sqrt(numel) covers any float64
    order); the square root halves a relative error and rounds once more. 0 where the sum is (float64
    arithmetic: FLOAT64_STATS). A float32 sum of squares that
    overflows or reaches the subnormal range is taken again in float64 (stats_in_range), so float32's
    exponent range adds nothing."""
    numel = _numel(shape)
    if numel is None or not _in_float32(dtype, numel):
        return 0.0
    u32, u64 = U32, U64
    return 0.5 * (u32 * (math.sqrt(min(numel, STAT_CHUNK)) + 1) + u64 * math.sqrt(numel)) + u64


def stats_in_range(ss: float, numel: int) -> bool:
    """Whether a float32-computed sum of squares is one norm_rounding bounds: finite, and not so small that
    squares in float32's subnormal range (below 2^-126, absolute error up to 2^-149 each) could matter (at
    ss >= numel * 2^-100 they are below 2^-49 of it)."""
    return math.isfinite(ss) and ss >= numel * 2.0**-100


def combine_sketches(sketches: list) -> list[float] | None:
    """The logical tensor's sketch from its shards' (each placed at its offset, so they add up)."""
    if (
        not sketches
        or not all(isinstance(k, list) for k in sketches)
        or len({len(k) for k in sketches}) != 1
    ):
        return None
    try:
        return [math.fsum(float(k[i]) for k in sketches) for i in range(len(sketches[0]))]
    except (TypeError, ValueError):
        return None


def explain(manifest_a: dict, manifest_b: dict, observed: tuple = (None, None)) -> dict:
    """The ingredients of the bound, for the diff result (so a reader can redo the arithmetic)."""
    u = max(unit_roundoff(manifest_a), unit_roundoff(manifest_b))
    return {
        "formula": "k * c * u * (sqrt(T) + sqrt(d))  (gradients, optimizer); k = steps since the runs last agreed",
        "u": u,
        "c": C_ORDER,
        "T": max(
            tokens_per_step(manifest_a, observed[0]), tokens_per_step(manifest_b, observed[1])
        ),
        "d": inner_dim(manifest_a),
        "per_step": step_bound(manifest_a, manifest_b, "reduce", observed),
    }
