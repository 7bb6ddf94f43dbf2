"""The bound on a parameter's update at one Adam step (docs/tolerance.md, "The update of one step").

A parameter under Adam has no sound bound across layouts (its update ``lr m / (sqrt(v) + eps)`` is a ratio
of two quantities that may both cancel), but the update itself has one, whatever cancels. torch's Adam and
AdamW move element i at step t by ``lr * (m_t / bc1) / (sqrt(v_t / bc2) + eps)`` (plus AdamW's decoupled
decay ``lr wd p``, which the record leaves out: run/record/updates.py), ``bc1 = 1 - beta1^t``,
``bc2 = 1 - beta2^t``, from moments started at zero:

    m_t = (1 - beta1) sum_{s<=t} beta1^(t-s) g_s,     v_t = (1 - beta2) sum_{s<=t} beta2^(t-s) g_s^2

Cauchy-Schwarz on ``beta1^k g = (beta1^k / beta2^(k/2)) (beta2^(k/2) g)`` gives, with
``gamma = beta1^2 / beta2 < 1``,

    |m_t| <= (1 - beta1) / sqrt(1 - beta2) * sqrt(sum_{k<t} gamma^k) * sqrt(v_t)

so ``|update| <= lr C_t``, ``C_t = (1 - beta1) / sqrt(1 - beta2) * sqrt(bc2) / bc1 * sqrt((1 - gamma^t) / (1 -
gamma))``; eps >= 0, amsgrad's larger denominator and a weight decay folded into the gradient (Adam's
L2) only make it smaller, and clipping changes no ratio. Equality is reached by gradients growing by
``beta2 / beta1`` a step, so this is the worst case, and it is above the Adam paper's ``max(1, (1 -
beta1) / sqrt(1 - beta2))`` (section 2.1, a typical case, not a bound: for betas (0.9, 0.95) the paper's
figure is 1, C_inf 1.165; for (0.9, 0.999) 3.16 against 7.27; tests/test_update_bound.py drives torch's
AdamW to it). Diff takes the supremum over t (``adam_step_bound``), so neither a resumed run nor an
optimizer whose step counter restarted needs its own t.

Each run's record is the largest element of that update over the tensor, so it lies in ``[0, lr C]`` and
two runs' records differ by at most ``max(lr_a C_a, lr_b C_b)``: the allowance a ``NAME:update`` record is
held to. The step's own rounding (the final subtraction's, at most ``u |p|`` an element; the decay's
product is rounded by the recorder as torch rounds it) is covered by ``SLACK`` while ``|p| < 2^14 lr C``. Where no such bound is sound (SGD, whose update is the
gradient's and cancels with it; beta1^2 >= beta2; an attached run, whose lock states its first group's
learning rate at attach time, before any schedule moves it) the record is reported and never judged.

No torch: a reader of the run store.
"""

from __future__ import annotations

import math

from disttrace.config.identity import harness_manifest

SUFFIX = ":update"
SLACK = 2.0**-10  # the step's own rounding, relative to the allowance (see the docstring)
_HORIZON = 1 << 16  # steps taken exactly; beyond them C_t <= C_inf / (1 - beta1^_HORIZON)


def is_update(name: str | None) -> bool:
    return bool(name) and name.endswith(SUFFIX)


def adam_step_bound(beta1: float, beta2: float) -> float | None:
    """sup over t of C_t (the module docstring): the most one Adam step moves an element, in units of lr.
    None where no finite bound exists (beta1^2 >= beta2) or the betas are not Adam's."""
    if not (0.0 <= beta1 < 1.0 and 0.0 < beta2 < 1.0):
        return None
    gamma = beta1 * beta1 / beta2
    if gamma >= 1.0:
        return None
    c_inf = (1.0 - beta1) / math.sqrt((1.0 - beta2) * (1.0 - gamma))
    best, b1t, b2t, gt = 0.0, 1.0, 1.0, 1.0
    for _ in range(_HORIZON):
        b1t, b2t, gt = b1t * beta1, b2t * beta2, gt * gamma
        best = max(best, math.sqrt((1.0 - b2t) * (1.0 - gt)) / (1.0 - b1t))
        if b1t < 1e-17 and b2t < 1e-17:  # every later term is 1 / (1 - 0) to float64: the limit
            return c_inf * max(best, 1.0)
    return c_inf * max(best, 1.0 / (1.0 - b1t))


def step_allowance(manifest: dict) -> float | None:
    """The most one run's ``NAME:update`` record may be: ``lr C`` for the harness's AdamW (a constant lr,
    the manifest's betas), None where no bound is sound (the module docstring)."""
    t = manifest.get("training", {}) or {}
    if not harness_manifest(manifest) or t.get("optimizer", "adamw") != "adamw":
        return None  # an attached run (its lr is its writer's word at attach time), or SGD
    lr, b1, b2 = t.get("lr"), t.get("beta1", 0.9), t.get("beta2", 0.95)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (lr, b1, b2)):
        return None
    c = adam_step_bound(float(b1), float(b2))
    if c is None or not math.isfinite(lr) or lr <= 0:
        return None
    return float(lr) * c * (1.0 + SLACK)


def allowance(manifest_a: dict, manifest_b: dict) -> float | None:
    """How far two runs' ``NAME:update`` records may differ: the larger run's bound (both are in [0, it])."""
    a, b = step_allowance(manifest_a), step_allowance(manifest_b)
    return None if a is None or b is None else max(a, b)


def scale(allowed: float, bound: float) -> float:
    """The magnitude diff measures an update record's difference against: the one at which the relative
    bound the phase has allows exactly `allowed` (err / bound is then |difference| / allowed)."""
    return allowed / bound if bound > 0 else math.inf
