"""The magnitudes that bound a record's difference (analysis/tolerance.py, "Magnitudes"), read from the
``trajectory/rank-N.scales.jsonl`` files run/scales.py writes: per step, phase (backward, reduce),
micro-batch and parameter index, the accumulated ``||X|| ||dY||`` of that rank.

* ``backward`` (a rank's accumulated local gradient): that rank's own figure.
* ``reduce`` and ``clip`` (the data-parallel gradient, then the same times a clip coefficient <= 1): the sum
  over every rank's figure at the reduce divided by dp, the data-parallel mean the loop takes. Exact for
  DDP and ZeRO (each rank contributed its local gradient); over tensor-parallel ranks it adds the local
  output gradients' magnitudes (whose sum bounds the reduced one's), an over-estimate by at most sqrt(tp).
* the clip phase's global gradient norm: ``|d||G||| <= ||dG|| <= eps sqrt(sum_i M_i^2)``, the root of the
  squared magnitudes of every parameter's reduced gradient. (The clip coefficient and the learning rate
  keep the norm-relative bound: a coefficient below 1 is ``max_norm / ||G||``, whose relative error is the
  norm's; the learning rate is an input.)
* what a clip coefficient below 1 scales (the clipped gradients, then Adam's moments and SGD's parameter
  downstream): ``c g_i`` with ``c = max_norm / ||G||``, whose relative difference is the norm's,
  ``|d||G||| / ||G|| <= eps sqrt(sum_j M_j^2) / ||G|| =: eps R`` (R is the whole gradient's cancellation:
  above 1 where it cancels). So ``|d(c g_i)| <= c (eps M_i + ||g_i|| eps R) <= eps M_i (1 + R)``
  (``c <= 1``, ``||g_i|| <= M_i``): the magnitude of a clipped gradient is ``M_i (1 + R)``, with ||G|| the
  norm the step recorded (its `clip` scalars, read from the store). A step whose clip scalars are not
  there but which may have clipped has no magnitude (the norm's scale, as a step without magnitudes).
* optimizer state: Adam's moments are running averages of the gradient; a difference of the gradients
  ``|dg| <= eps M_g`` reaches the first moment as ``sum_s beta1^(t-s) (1-beta1) eps_s M_g(s)`` and the second
  (``|d g^2| <= 2 |g| |dg|``) as ``2 sum_s beta2^(t-s) (1-beta2) eps_s M_g(s)^2``; the recursion starts at
  the step the two runs last agreed (their moments were equal there). With eps nondecreasing in s both are
  at most ``eps_t`` times ``M_m(t)``, resp. ``2 eps_t M_v(t)`` (tolerance.tensor_factor gives the 2).
* parameters: an Adam update ``m / sqrt(v)`` is a ratio of two quantities that may both cancel; its
  difference has no bound in terms of what the store holds (it reaches the learning rate itself when
  ``m`` cancels). No magnitude: diff says ``bound_kind: none`` for parameters under Adam and relies on
  replicas being bit-identical (which they must be in one run) and on the next step's gradients, which
  do carry a bound. Under SGD ``dp = -lr g``: ``M_p(t) = M_p(t-1) + lr M_g(t)``.

No torch: a reader of the run store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from disttrace.errors import BadInput
from disttrace.store import safeio
from disttrace.store.records import CLIP_GRAD_BASE, clip_param_index
from disttrace.store.rundir import Run, rank_file

SUFFIX = ".scales.jsonl"
GRADIENT_PHASES = ("backward", "reduce", "clip")


def _read(path) -> dict[int, dict]:
    """step -> {phase: {micro-batch: {index: magnitude}}}; a torn last line is left out."""
    out: dict[int, dict] = {}
    data = safeio.read_bytes(path, Path(path).parent.parent, "jsonl")  # inside its run, bounded
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif lines:
        lines.pop()  # torn last line: written when the process died
    for n, line in enumerate(lines, 1):
        try:
            doc = orjson.loads(line)
            step, m = int(doc["step"]), doc["m"]
            parsed = {
                str(ph): {
                    int(mb): {int(i): float(v) for i, v in idx.items()} for mb, idx in mbs.items()
                }
                for ph, mbs in m.items()
            }
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise BadInput(path, f"line {n} is not a magnitudes line", field="m") from None
        if any(
            not math.isfinite(v) or v < 0
            for mbs in parsed.values()
            for idx in mbs.values()
            for v in idx.values()
        ):
            raise BadInput(path, f"line {n}: a magnitude is not a finite number >= 0", field="m")
        out[step] = parsed
    return out


@dataclass
class Moments:
    """Per parameter index, at one step: the magnitudes of Adam's running averages (`exp_avg` M_m,
    `exp_avg_sq` M_v) and of SGD's parameter (`param` M_p)."""

    exp_avg: dict[int, float] = field(default_factory=dict)
    exp_avg_sq: dict[int, float] = field(default_factory=dict)
    param: dict[int, float] = field(default_factory=dict)

    def of(self, state: str) -> dict[int, float]:
        """The table of an optimizer state by the name a record gives it (exp_avg, exp_avg_sq)."""
        return self.exp_avg if state == "exp_avg" else self.exp_avg_sq


def _number(v, default):
    """A hyper-parameter as a number: an attached run's may be absent, null, or what another optimizer keeps
    under that name (a list, a string); then the harness's default."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return default
    return type(default)(v)


class Magnitudes:
    """One run's magnitudes, as diff asks for them. ``available`` is False for a store without them (written
    before they existed, or by an attached DeepSpeed engine): diff then keeps the norm-relative bound."""

    def __init__(self, run: Run, since: int = 0):
        self.by_rank: dict[int, dict[int, dict]] = {}
        for r in run.ranks():
            p = run.path / rank_file("trajectory", r, SUFFIX)
            if p.is_file():
                self.by_rank[r] = _read(p)
        self.available = bool(self.by_rank) and set(self.by_rank) == set(run.ranks())
        t = run.manifest.training
        self.dp = max(_number(run.manifest.parallelism.dp, 1), 1)
        # the harness writes "adamw"; an attached run the optimizer's class name ("AdamW", "SGD")
        self.optimizer = str(t.optimizer if t.optimizer is not None else "adamw").lower()
        self.beta1, self.beta2 = _number(t.beta1, 0.9), _number(t.beta2, 0.95)
        self.lr = _number(t.lr, 0.0)
        self.since = since
        self._reduce: dict[int, dict[int, float]] = {}
        self._clipped: dict[int, dict[int, float]] = {}
        self._run, self._entries = run, None
        self._states: dict[int, dict[int, int]] = {}
        self._state: dict[int, Moments] = {}
        self._arrays: dict[tuple, tuple] = {}

    def local(self, rank: int, step: int, phase: str, mb: int, index: int) -> float | None:
        return self.by_rank.get(rank, {}).get(step, {}).get(phase, {}).get(mb, {}).get(index)

    def reduced(self, step: int) -> dict[int, float]:
        """index -> the data-parallel gradient's magnitude at `step` (sum over ranks / dp)."""
        got = self._reduce.get(step)
        if got is None:
            got = {}
            for steps in self.by_rank.values():
                for mbs in (steps.get(step, {}).get("reduce") or {}).values():
                    for i, v in mbs.items():
                        got[i] = got.get(i, 0.0) + v
            got = {i: v / self.dp for i, v in got.items()}
            self._reduce[step] = got
        return got

    def _clip_scalars(self, step: int) -> tuple[float, float] | None:
        """(grad_norm, clip_coef) the step recorded (a rank's `clip` scalars; every rank holds the same),
        (nan, 1.0) where the step recorded no clip coefficient (nothing clipped: the harness records one at
        every step, an attached run when clip_grad_norm_ ran), None where the step is not in the store."""
        if self._entries is None:
            self._entries = {}
            for r in sorted(self.by_rank):
                for e in self._run.step_index(r).records:
                    self._entries.setdefault(e.step, (r, e))
        got = self._entries.get(step)
        if got is None:
            return None
        rank, entry = got
        norm, coef = math.nan, 1.0
        for rec in self._run.records_of_step(rank, entry, phases=("clip",)):
            if rec.get("phase") != "clip" or rec.get("tensor") not in ("grad_norm", "clip_coef"):
                continue
            v = rec.get("sum")
            v = float(v) if isinstance(v, (int, float)) and not rec.get("nonfinite") else math.nan
            if rec["tensor"] == "grad_norm":
                norm = v
            else:
                coef = v
        return norm, coef

    def state_params(self, rank: int | None) -> dict[int, int]:
        """An optimizer state record's index -> its parameter's index, on `rank` (the lowest rank for None),
        by name ("w:exp_avg" is w's): the recorder numbers a rank's state after that rank's parameters
        (their count, then 4 per parameter), so the index alone does not say whose state it is. Read from
        the first of the rank's steps that holds optimizer state."""
        if rank is None:
            rank = min(self.by_rank, default=0)
        got = self._states.get(rank)
        if got is None:
            got = self._states[rank] = {}
            for entry in self._run.step_index(rank).records[:4]:
                params, states = {}, []
                for rec in self._run.records_of_step(rank, entry):
                    if rec.get("phase") != "optimizer":
                        continue
                    name, index = str(rec.get("tensor") or ""), int(rec.get("index") or 0)
                    if ":" in name:
                        states.append((name.rsplit(":", 1)[0], index))
                    elif not name.startswith("param_groups."):
                        params[name] = index
                got.update({i: params[n] for n, i in states if n in params})
                if got:
                    break
        return got

    def clipped(self, step: int) -> dict[int, float]:
        """index -> the magnitude of the gradient the optimizer took at `step`: the data-parallel one's, times
        (1 + R) where the step clipped by a coefficient below 1 (R = sqrt(sum_i M_i^2) / ||G||, the module
        docstring); empty where the step may have clipped and its norm is not known."""
        got = self._clipped.get(step)
        if got is None:
            red = self.reduced(step)
            scalars = self._clip_scalars(step) if red else (math.nan, 1.0)
            if scalars is None:
                got = {}
            else:
                norm, coef = scalars
                if (
                    coef >= 1.0
                ):  # not clipped: c = 1 on both sides wherever the norm is below max_norm
                    got = red
                elif not math.isfinite(coef) or not math.isfinite(norm) or norm <= 0:
                    got = {}  # clipped by a coefficient whose norm is not known: no sound magnitude
                else:
                    spread = math.sqrt(math.fsum(v * v for v in red.values())) / norm
                    got = {i: v * (1.0 + spread) for i, v in red.items()}
            self._clipped[step] = got
        return got

    def _moments(self, step: int) -> Moments:
        """Per parameter index: M_m (exp_avg), M_v (exp_avg_sq), M_p (SGD's parameter) at `step`, from the
        recursion started at `since` (the moments were equal there); an index leaves the recursion at a step
        without its magnitude (record.every > 1, a rank's file missing a step)."""
        if step in self._state:
            return self._state[step]
        start = max((s for s in self._state if s < step), default=self.since)
        cur = self._state.get(start) or Moments()
        for s in range(start + 1, step + 1):
            g = self.clipped(s)  # what the optimizer took: the clipped gradient
            first = s == self.since + 1
            nxt = Moments()
            for i, mg in g.items():
                pm = 0.0 if first else cur.exp_avg.get(i)
                pv = 0.0 if first else cur.exp_avg_sq.get(i)
                pp = 0.0 if first else cur.param.get(i)
                if pm is not None:
                    nxt.exp_avg[i] = self.beta1 * pm + (1 - self.beta1) * mg
                if pv is not None:
                    nxt.exp_avg_sq[i] = self.beta2 * pv + (1 - self.beta2) * mg * mg
                if pp is not None:
                    nxt.param[i] = pp + self.lr * mg
            self._state[s] = cur = nxt
        return cur

    def of(self, step: int, phase: str, index: int, name: str | None, rank: int | None, mb: int):
        """(magnitude or None, bounded): the magnitude a record's difference is measured against; bounded False
        where no sound magnitude exists (parameters under Adam)."""
        if phase == "backward":
            return (self.local(rank, step, phase, mb, index) if rank is not None else None), True
        if phase in ("reduce", "clip"):
            red = self.reduced(step)
            if phase == "clip" and clip_param_index(index) not in red and name == "grad_norm":
                # |d ||G||| <= ||dG|| <= eps sqrt(sum_i M_i^2): the global norm on the scale of its parts
                return (math.sqrt(math.fsum(v * v for v in red.values())) if red else None), True
            if phase == "clip" and clip_param_index(index) not in red and name == "clip_coef":
                return None, False  # the clip coefficient: see the note above lookup
            if phase == "clip":  # a clipped gradient carries the coefficient's difference
                return self.clipped(step).get(clip_param_index(index)), True
            return red.get(index), True
        if phase != "optimizer":
            return None, True
        name = name or ""
        if name.startswith(
            "param_groups."
        ):  # a learning rate an attached run records: an input, no sum
            return None, True
        key = name.rsplit(":", 1)[1] if ":" in name else None
        if key is None:  # a parameter
            if self.optimizer == "sgd":
                return self._moments(step).param.get(index), True
            return None, False
        if key in ("exp_avg", "exp_avg_sq"):
            param = self.state_params(rank).get(index)
            return (None if param is None else self._moments(step).of(key).get(param)), True
        return None, True


# an index beyond what a record's uint32 index (or its optimizer state's parameter) can name never matches
_MAX_INDEX = 1 << 34
_CACHED = 1 << 12  # tables held as arrays at once: a few blocks' steps, not the run's
_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "param")
_NONE = (np.empty(0, dtype=np.int64), np.empty(0))


def _as_arrays(table: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """A table {index: magnitude} as (sorted indices, magnitudes) for np.searchsorted."""
    keys = sorted(k for k in table if 0 <= k < _MAX_INDEX)
    if not keys:
        return _NONE
    return np.array(keys, dtype=np.int64), np.array([table[k] for k in keys], dtype=np.float64)


def _lookup(arrays: tuple[np.ndarray, np.ndarray], index: np.ndarray) -> np.ndarray:
    """table.get(i) for each of `index`: nan where absent."""
    keys, vals = arrays
    out = np.full(len(index), np.nan)
    if len(keys):
        at = np.minimum(np.searchsorted(keys, index), len(keys) - 1)
        hit = keys[at] == index
        out[hit] = vals[at[hit]]
    return out


# The clip coefficient is max_norm / (grad_norm + 1e-6), clamped at 1: a function of the recorded norm, whose
# own bound (above) is sound, so the coefficient's difference is the norm's relative difference and no bound
# of its own is needed. Held to its own value instead, it was flagged between equivalent layouts (torchtitan's
# TP 2 against dp=1: 5.7e-5 where the norm of 6M sharded elements was within its bound); a changed max_norm
# still shows, in the clipped gradients that follow it.


def lookup(
    mag: Magnitudes, step: int, phase: str, index, names, rank, mb
) -> tuple[np.ndarray, np.ndarray]:
    """`mag.of` for rows of one step and phase, as (magnitudes, nan where None; bounded) arrays. index, rank,
    mb: int64 arrays; names: a bool-returning matcher over the rows' tensor names (`names(kind)` for kind in
    "grad_norm", "clip_coef", "param_groups", "colon", "exp_avg", "exp_avg_sq")."""
    n = len(index)
    bounded = np.ones(n, dtype=bool)
    cache = mag._arrays
    if len(cache) >= _CACHED:  # steps come in order: the older half goes
        for old in list(cache)[: len(cache) // 2]:
            del cache[old]
    if phase == "backward":
        out = np.full(n, np.nan)
        pairs, inv = np.unique(rank * (1 << 32) + mb, return_inverse=True)
        inv = inv.reshape(-1)
        for j, p in enumerate(pairs.tolist()):
            rk, m = p >> 32, p & 0xFFFFFFFF
            key = ("backward", step, rk, m)
            arrays = cache.get(key)
            if arrays is None:
                table = mag.by_rank.get(rk, {}).get(step, {}).get(phase, {}).get(m, {})
                arrays = cache[key] = _as_arrays(table)
            sel = inv == j
            out[sel] = _lookup(arrays, index[sel])
        return out, bounded
    if phase in ("reduce", "clip"):
        key = (phase, step)
        arrays = cache.get(key)
        if (
            arrays is None
        ):  # a clipped gradient carries the coefficient's difference (Magnitudes.clipped)
            arrays = cache[key] = _as_arrays(
                mag.clipped(step) if phase == "clip" else mag.reduced(step)
            )
        if phase == "clip":  # a clipped gradient's magnitude is its parameter's (clip_param_index)
            index = np.where(index >= CLIP_GRAD_BASE, index - CLIP_GRAD_BASE, index)
        out = _lookup(arrays, index)
        if phase == "clip":
            bounded[np.isnan(out) & names("clip_coef")] = (
                False  # the clip coefficient: see the note above lookup
            )
            norm = np.isnan(out) & names("grad_norm")
            if norm.any():
                red = mag.reduced(step)
                # |d ||G||| <= ||dG|| <= eps sqrt(sum_i M_i^2): the global norm on the scale of its parts
                out[norm] = math.sqrt(math.fsum(v * v for v in red.values())) if red else np.nan
        return out, bounded
    if phase != "optimizer":
        return np.full(n, np.nan), bounded
    out = np.full(n, np.nan)
    inputs = names("param_groups")  # a learning rate an attached run records: an input, no sum
    param = ~inputs & ~names("colon")
    if param.any():
        if mag.optimizer == "sgd":
            out[param] = _lookup(_moment_arrays(mag, step, "param"), index[param])
        else:
            bounded[param] = False
    for state in ("exp_avg", "exp_avg_sq"):
        sel = ~inputs & names(state)
        if sel.any():
            out[sel] = _lookup(
                _moment_arrays(mag, step, state), _state_params(mag, index, rank, sel)
            )
    return out, bounded


def _state_params(mag: Magnitudes, index: np.ndarray, rank: np.ndarray, sel: np.ndarray):
    """Magnitudes.state_params for the rows `sel`: each state record's parameter index, -1 where unknown."""
    out = np.full(int(sel.sum()), -1, dtype=np.int64)
    idx, rk = index[sel], rank[sel]
    for r in np.unique(rk).tolist():
        table = mag.state_params(int(r))
        at = rk == r
        out[at] = [table.get(i, -1) for i in idx[at].tolist()]
    return out


def _moment_arrays(mag: Magnitudes, step: int, state: str):
    key = ("moments", step)
    got = mag._arrays.get(key)
    if got is None:
        m = mag._moments(step)
        got = mag._arrays[key] = {
            k: _as_arrays(t) for k, t in zip(_OPTIMIZER_KEYS, (m.exp_avg, m.exp_avg_sq, m.param))
        }
    return got[state]
