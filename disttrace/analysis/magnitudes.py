"""The magnitudes that bound a record's difference (analysis/tolerance.py, "Magnitudes"), read from the
magnitudes files run/record/scales.py writes (store/scales.py: columns of step, phase (backward, reduce),
micro-batch and parameter index, the accumulated ``||X|| ||dY||`` of that rank), held as arrays: each table
below is looked up a column at a time.

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
  norm the step recorded (its `clip` scalars: the magnitudes file's, else the trajectory's `clip` records). A step whose clip scalars are not
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

import numpy as np
import pyarrow.compute as pc

from disttrace.store import scales
from disttrace.store.records import CLIP_GRAD_BASE, clip_param_index
from disttrace.store.rundir import Run

GRADIENT_PHASES = ("backward", "reduce", "clip")
_BACKWARD, _REDUCE = (scales.PHASES.index(p) for p in ("backward", "reduce"))


def _number(v, default):
    """A hyper-parameter as a number: an attached run's may be absent, null, or what another optimizer keeps
    under that name (a list, a string); then the harness's default."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return default
    return type(default)(v)


class Magnitudes:
    """One run's magnitudes, as diff asks for them. ``available`` is False for a store without them (written
    before they existed, or by an attached DeepSpeed engine): diff then keeps the norm-relative bound.
    Tables are (sorted parameter indices, magnitudes) array pairs."""

    def __init__(self, run: Run, since: int = 0):
        self.by_rank: dict[int, scales.Scales] = {}
        for r in run.ranks():
            p = scales.path_of(run.path, r)
            if p is not None:
                self.by_rank[r] = scales.read(p, run.path)
        self.available = bool(self.by_rank) and set(self.by_rank) == set(run.ranks())
        t = run.manifest.training
        self.dp = max(_number(run.manifest.parallelism.dp, 1), 1)
        # the harness writes "adamw"; an attached run the optimizer's class name ("AdamW", "SGD")
        self.optimizer = str(t.optimizer if t.optimizer is not None else "adamw").lower()
        self.beta1, self.beta2 = _number(t.beta1, 0.9), _number(t.beta2, 0.95)
        self.lr = _number(t.lr, 0.0)
        self.since = since
        self._spans = {r: _spans(c.step) for r, c in self.by_rank.items()}
        self._local: dict[int, dict[tuple[int, int], tuple]] = {}  # step -> (rank, mb) -> table
        self._reduce: dict[int, tuple] = {}
        self._clipped: dict[int, tuple] = {}
        self._run, self._entries = run, None
        self._states: dict[int, tuple] = {}
        self._universe: np.ndarray | None = None
        self._state: dict[int, tuple] = {}  # step -> (exp_avg, exp_avg_sq, param) over the universe

    def local(self, rank: int, step: int, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """The table of `rank`'s accumulated local gradients at the `backward` of micro-batch `mb`."""
        got = self._local.get(step)
        if got is None:
            if len(self._local) >= _CACHED:  # steps come in order: the older half goes
                for old in list(self._local)[: len(self._local) // 2]:
                    del self._local[old]
            got = self._local[step] = {}
            for r, c in self.by_rank.items():
                lo, hi = self._spans[r].get(step, (0, 0))
                sel = np.flatnonzero(c.phase[lo:hi] == _BACKWARD) + lo
                for m in np.unique(c.mb[sel]).tolist():
                    at = sel[c.mb[sel] == m]
                    got[(r, m)] = _as_arrays(c.index[at], c.m[at])
        return got.get((rank, mb), _NONE)

    def reduced(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The data-parallel gradient's magnitudes at `step` (sum over ranks / dp), every index the files give
        (sorted)."""
        got = self._reduce.get(step)
        if got is None:
            index, m = [], []
            for (
                r,
                c,
            ) in self.by_rank.items():  # summed in rank order, then as written: the same float sums
                lo, hi = self._spans[r].get(step, (0, 0))
                sel = np.flatnonzero(c.phase[lo:hi] == _REDUCE) + lo
                index.append(c.index[sel])
                m.append(c.m[sel])
            keys, inv = np.unique(np.concatenate(index), return_inverse=True)
            sums = np.bincount(inv.reshape(-1), weights=np.concatenate(m), minlength=len(keys))
            got = self._reduce[step] = (keys, sums / self.dp)
        return got

    def _clip_scalars(self, step: int) -> tuple[float, float] | None:
        """(grad_norm, clip_coef) the step recorded (every rank holds the same): the magnitudes file's where it
        holds them, else the trajectory's `clip` scalars; (nan, 1.0) where the step recorded no clip
        coefficient (nothing clipped: the harness records one at every step, an attached run when
        clip_grad_norm_ ran), None where the step is not in the store."""
        for r in sorted(self.by_rank):
            got = self.by_rank[r].clip.get(step)
            if got is not None:
                return got
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

    def state_params(self, rank: int | None) -> tuple[np.ndarray, np.ndarray]:
        """An optimizer state record's index -> its parameter's index, on `rank` (the lowest rank for None),
        as a table, by name ("w:exp_avg" is w's): the recorder numbers a rank's state after that rank's
        parameters (their count, then 4 per parameter), so the index alone does not say whose state it is.
        Read from the first of the rank's steps that holds optimizer state."""
        if rank is None:
            rank = min(self.by_rank, default=0)
        got = self._states.get(rank)
        if got is None:
            table: dict[int, int] = {}
            for entry in self._run.step_index(rank).records[:4]:
                params, states = {}, []
                for tensor, index in _optimizer_records(self._run, rank, entry):
                    name, index = str(tensor or ""), int(index or 0)
                    if ":" in name:
                        states.append((name.rsplit(":", 1)[0], index))
                    elif not name.startswith("param_groups."):
                        params[name] = index
                table.update({i: params[n] for n, i in states if n in params})
                if table:
                    break
            keys = sorted(table)
            got = self._states[rank] = (
                np.array(keys, dtype=np.int64),
                np.array([table[k] for k in keys], dtype=np.int64),
            )
        return got

    def clipped(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """The magnitudes of the gradient the optimizer took at `step`: the data-parallel one's, times (1 + R)
        where the step clipped by a coefficient below 1 (R = sqrt(sum_i M_i^2) / ||G||, the module
        docstring); empty where the step may have clipped and its norm is not known."""
        got = self._clipped.get(step)
        if got is None:
            keys, red = self.reduced(step)
            scalars = self._clip_scalars(step) if len(keys) else (math.nan, 1.0)
            if scalars is None:
                got = _NONE
            else:
                norm, coef = scalars
                if (
                    coef >= 1.0
                ):  # not clipped: c = 1 on both sides wherever the norm is below max_norm
                    got = (keys, red)
                elif not math.isfinite(coef) or not math.isfinite(norm) or norm <= 0:
                    got = _NONE  # clipped by a coefficient whose norm is not known: no sound magnitude
                else:
                    spread = math.sqrt(math.fsum(red * red)) / norm
                    got = (keys, red * (1.0 + spread))
            self._clipped[step] = got
        return got

    def global_norm(self, step: int) -> float | None:
        """|d ||G||| <= ||dG|| <= eps sqrt(sum_i M_i^2): the global norm's magnitude, on the scale of its parts."""
        red = self.reduced(step)[1]
        return math.sqrt(math.fsum(red * red)) if len(red) else None

    def moments(self, step: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(parameter indices, (M_m of exp_avg, M_v of exp_avg_sq, M_p of SGD's parameter)) at `step`, nan
        where an index has none, from the recursion started at `since` (the moments were equal there); an
        index leaves the recursion at a step without its magnitude (record.every > 1, a rank's file missing a
        step)."""
        universe = self._universe
        if universe is None:
            index = [c.index[c.phase == _REDUCE] for c in self.by_rank.values()]
            universe = np.unique(np.concatenate(index)) if index else _NONE[0]
            universe = self._universe = universe[(universe >= 0) & (universe < _MAX_INDEX)]
        if step in self._state:
            return universe, self._state[step]
        start = max((s for s in self._state if s < step), default=self.since)
        none = np.full(len(universe), np.nan)
        cur = self._state.get(start) or (none, none, none)
        zero = np.zeros(len(universe))
        for s in range(start + 1, step + 1):
            keys, mg = self.clipped(s)  # what the optimizer took: the clipped gradient
            g = none.copy()
            at = np.searchsorted(universe, keys)
            hit = at < len(universe)
            hit[hit] = universe[at[hit]] == keys[hit]
            g[at[hit]] = mg[hit]
            pm, pv, pp = (zero, zero, zero) if s == self.since + 1 else cur
            # nan (an index without a magnitude) stays nan: it has left the recursion
            cur = (
                self.beta1 * pm + (1 - self.beta1) * g,
                self.beta2 * pv + (1 - self.beta2) * g * g,
                pp + self.lr * g,
            )
            self._state[s] = cur
        return universe, cur

    def of(self, step: int, phase: str, index: int, name: str | None, rank: int | None, mb: int):
        """(magnitude or None, bounded): the magnitude a record's difference is measured against; bounded False
        where no sound magnitude exists (parameters under Adam)."""
        if phase == "backward":
            return (_get(self.local(rank, step, mb), index) if rank is not None else None), True
        if phase in ("reduce", "clip"):
            red = self.reduced(step)
            own = _get(red, clip_param_index(index)) is not None
            if phase == "clip" and not own and name == "grad_norm":
                return self.global_norm(step), True
            if phase == "clip" and not own and name == "clip_coef":
                return None, False  # the clip coefficient: see the note above lookup
            if phase == "clip":  # a clipped gradient carries the coefficient's difference
                return _get(self.clipped(step), clip_param_index(index)), True
            return _get(red, index), True
        if phase != "optimizer":
            return None, True
        name = name or ""
        if name.startswith("param_groups."):  # a learning rate an attached run records: an input
            return None, True
        key = name.rsplit(":", 1)[1] if ":" in name else None
        if key is None:  # a parameter
            if self.optimizer != "sgd":
                return None, False
            universe, moments = self.moments(step)
            return _get((universe, moments[2]), index), True
        if key in _OPTIMIZER_KEYS[:2]:
            param = _get(self.state_params(rank), index)
            if param is None:
                return None, True
            universe, moments = self.moments(step)
            return _get((universe, moments[_OPTIMIZER_KEYS.index(key)]), int(param)), True
        return None, True


def _optimizer_records(run: Run, rank: int, entry) -> list[tuple]:
    """(tensor, index) of each of a step's optimizer records, in order (an Arrow step's from its columns)."""
    batch = run.step_batch(rank, entry)
    if batch is None:  # a JSON-lines store
        recs = run.records_of_step(rank, entry, phases=("optimizer",))
        return [(r.get("tensor"), r.get("index")) for r in recs if r.get("phase") == "optimizer"]
    mine = batch.filter(pc.equal(batch.column("phase"), "optimizer").fill_null(False))
    return list(zip(mine.column("tensor").to_pylist(), mine.column("index").to_pylist()))


# an index beyond what a record's uint32 index (or its optimizer state's parameter) can name never matches
_MAX_INDEX = 1 << 34
_CACHED = 1 << 12  # tables held as arrays at once: a few blocks' steps, not the run's
_OPTIMIZER_KEYS = ("exp_avg", "exp_avg_sq", "param")  # the order of Magnitudes.moments' arrays
_NONE = (np.empty(0, dtype=np.int64), np.empty(0))


def _spans(step: np.ndarray) -> dict[int, tuple[int, int]]:
    """step -> (first row, end) of a rank's columns, whose steps' rows lie together."""
    if not len(step):
        return {}
    cut = np.flatnonzero(step[1:] != step[:-1]) + 1
    lo, hi = np.append(0, cut), np.append(cut, len(step))
    return dict(zip(step[lo].tolist(), zip(lo.tolist(), hi.tolist())))


def _as_arrays(index: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows (index, magnitude) as a table (sorted indices, magnitudes) for np.searchsorted; an index out of
    what a record can name left out."""
    keep = (index >= 0) & (index < _MAX_INDEX)
    order = np.argsort(index[keep], kind="stable")
    return index[keep][order], m[keep][order].astype(np.float64, copy=False)


def _get(table: tuple[np.ndarray, np.ndarray], i: int):
    """table.get(i) for one index: None where absent (or nan: an index out of the recursion)."""
    keys, vals = table
    at = int(np.searchsorted(keys, i))
    if at < len(keys) and keys[at] == i and not math.isnan(vals[at]):
        v = vals[at]
        return v.item() if hasattr(v, "item") else v
    return None


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


def _by_step(step: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """(step, its rows) for each step of the rows, in order; every row as a slice where there is one step."""
    steps = np.unique(step)
    if len(steps) == 1:
        return [(int(steps[0]), slice(None))]
    return [(int(s), np.flatnonzero(step == s)) for s in steps.tolist()]


def lookup(
    mag: Magnitudes, step, phase: str, index, names, rank, mb
) -> tuple[np.ndarray, np.ndarray]:
    """`mag.of` for rows of one phase, as (magnitudes, nan where None; bounded) arrays. step, index, rank, mb:
    int64 arrays (the rows of several steps are looked up together: a step's tables, the rest once); names: a
    bool-returning matcher over the rows' tensor names (`names(kind)` for kind in "grad_norm", "clip_coef",
    "param_groups", "colon", "exp_avg", "exp_avg_sq")."""
    n = len(index)
    bounded = np.ones(n, dtype=bool)
    out = np.full(n, np.nan)
    if phase == "backward":
        for s, at in _by_step(step):
            r, m = rank[at], mb[at]
            pairs, inv = np.unique(r * (1 << 32) + m, return_inverse=True)
            inv = inv.reshape(-1)
            got = np.full(len(r), np.nan)
            for j, p in enumerate(pairs.tolist()):
                sel = inv == j if len(pairs) > 1 else slice(None)
                got[sel] = _lookup(mag.local(p >> 32, s, p & 0xFFFFFFFF), index[at][sel])
            out[at] = got
        return out, bounded
    if phase in ("reduce", "clip"):
        if phase == "clip":  # a clipped gradient's magnitude is its parameter's (clip_param_index)
            index = np.where(index >= CLIP_GRAD_BASE, index - CLIP_GRAD_BASE, index)
        for s, at in _by_step(step):
            # a clipped gradient carries the coefficient's difference (Magnitudes.clipped)
            out[at] = _lookup(mag.clipped(s) if phase == "clip" else mag.reduced(s), index[at])
        if phase == "clip":
            missing = np.isnan(out)
            bounded[missing & names("clip_coef")] = (
                False  # the clip coefficient: see the note above
            )
            norm = missing & names("grad_norm")
            if norm.any():
                for s, at in _by_step(step[norm]):
                    got = mag.global_norm(s)
                    out[np.flatnonzero(norm)[at]] = np.nan if got is None else got
        return out, bounded
    if phase != "optimizer":
        return out, bounded
    inputs = names("param_groups")  # a learning rate an attached run records: an input, no sum
    param = ~inputs & ~names("colon")
    if param.any():
        if mag.optimizer == "sgd":
            rows = np.flatnonzero(param)
            for s, at in _by_step(step[rows]):
                universe, moments = mag.moments(s)
                out[rows[at]] = _lookup((universe, moments[2]), index[rows[at]])
        else:
            bounded[param] = False
    for k, state in enumerate(_OPTIMIZER_KEYS[:2]):
        sel = ~inputs & names(state)
        if sel.any():
            rows = np.flatnonzero(sel)
            params = _state_params(mag, index, rank, sel)
            for s, at in _by_step(step[rows]):
                universe, moments = mag.moments(s)
                out[rows[at]] = _lookup((universe, moments[k]), params[at])
    return out, bounded


def _state_params(mag: Magnitudes, index: np.ndarray, rank: np.ndarray, sel: np.ndarray):
    """Magnitudes.state_params for the rows `sel`: each state record's parameter index, -1 where unknown."""
    out = np.full(int(sel.sum()), -1, dtype=np.int64)
    idx, rk = index[sel], rank[sel]
    for r in np.unique(rk).tolist():
        keys, params = mag.state_params(int(r))
        at = np.flatnonzero(rk == r)
        if len(keys):
            pos = np.minimum(np.searchsorted(keys, idx[at]), len(keys) - 1)
            hit = keys[pos] == idx[at]
            out[at[hit]] = params[pos[hit]]
    return out
