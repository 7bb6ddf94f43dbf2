"""Before any step is compared: both sides read and held to one experiment, the mode chosen, the steps both
hold, the step since which the runs agree, the calibration found, the bound settled (`Setup`)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import orjson
import pyarrow.compute as pc

from disttrace.analysis import readahead, tolerance
from disttrace.analysis.diff import sensitivity
from disttrace.analysis.diff.blocks import (
    BLOCK_ROWS,
    WINDOW_ROWS,
    _block,
    _blocks_read,
    _compare_block,
    _Plan,
    _take,
)
from disttrace.analysis.diff.fold import StepOutcome
from disttrace.analysis.diff.layout import same_shown
from disttrace.analysis.diff.side import Side
from disttrace.analysis.diff.tol import _Tol
from disttrace.analysis.diff.window import compare_logical_steps
from disttrace.analysis.result import (
    BoundKind,
    ComparedSteps,
    Tolerance,
)
from disttrace.config.identity import (
    TOPOLOGY_FIELDS,
    experiment_differences,
    get_field,
    harness_manifest,
    observed_topology_differences,
    unknown_line,
)
from disttrace.errors import BadInput
from disttrace.fmt import ranges
from disttrace.store import safeio, trajectory, trajectory_decode, trajectory_read
from disttrace.store.rundir import LOCK

MODES = ("bitwise", "numeric")


# ---------------------------------------------------------------- compatibility


def _leaves(manifest: dict, dotted: str) -> dict[str, Any]:
    v = get_field(manifest, dotted)
    if isinstance(v, dict):
        out: dict[str, Any] = {}
        for k in v:
            out.update(_leaves(manifest, f"{dotted}.{k}"))
        return out
    return {dotted: v}


def _field_diffs(ma: dict, mb: dict, fields) -> list[tuple[str, Any, Any]]:
    out = []
    for f in fields:
        la, lb = _leaves(ma, f), _leaves(mb, f)
        for k in sorted(set(la) | set(lb)):
            if la.get(k) != lb.get(k):
                out.append((k, la.get(k), lb.get(k)))
    return out


def _short(v: Any) -> str:
    s = repr(v)
    return s[:14] + "...'" if isinstance(v, str) and len(v) > 16 else s


def _check_compatible(a: Side, b: Side, allow_edition_mismatch: bool, warnings: list[str]) -> None:
    ma, mb = a.manifest, b.manifest
    where = b.path / LOCK
    ea, eb = get_field(ma, "experiment.edition"), get_field(mb, "experiment.edition")
    if ea != eb:
        if not allow_edition_mismatch:
            raise BadInput(
                where,
                f"edition {eb!r} differs from {ea!r} of {a.path}; runs of different editions are "
                "never compared silently (allow it explicitly to compare anyway)",
                field="experiment.edition",
            )
        warnings.append(
            f"editions differ ({ea!r} vs {eb!r}): compared because it was explicitly allowed"
        )
    diffs, unknown = experiment_differences(a.run.lock, b.run.lock)
    if unknown:
        warnings.append(unknown_line(unknown))
    if diffs:
        names = ", ".join(k for k, _, _ in diffs)
        detail = "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in diffs)
        raise BadInput(where, f"not the same experiment as {a.path}: {detail}", field=names)


def compared_steps(a: Side, b: Side) -> tuple[list[int], ComparedSteps]:
    common = sorted(set(a.steps) & set(b.steps))
    n_total = int(get_field(a.manifest, "training.steps") or 0)
    why: list[str] = []
    for s in (a, b):
        if not s.steps:
            why.append(f"run {s.label} has no complete step")
            continue
        first, last = s.steps[0], s.steps[-1]
        every = max(
            1, int(get_field(s.manifest, "record.every") or 1)
        )  # it digests steps every, 2*every, ...
        if every > 1:
            why.append(f"run {s.label} records one step in {every} (record.every)")
        if first > every:
            if s.kind == "recovered" or s.resume_step:
                why.append(
                    f"run {s.label} is a recovered run resumed from the checkpoint of step "
                    f"{s.resume_step or first - 1}: its records start at step {first}"
                )
            else:
                why.append(f"run {s.label} has no records before step {first}")
        if n_total and last < n_total - n_total % every:
            if not s.complete:
                why.append(f"run {s.label} is incomplete: stops at step {last}")
            else:
                why.append(f"run {s.label} stops at step {last} of {n_total}")
        gaps = sorted({x for x in range(first, last + 1) if x % every == 0} - set(s.steps))
        if gaps:
            why.append(f"run {s.label} lacks step(s) {ranges(gaps)}")
    if not common:
        raise BadInput(
            f"{a.path} vs {b.path}",
            "the runs share no step to compare" + (f" ({'; '.join(why)})" if why else ""),
        )
    if not why:
        why.append(f"all {len(common)} steps")
    return common, ComparedSteps(
        first=common[0],
        last=common[-1],
        count=len(common),
        why="; ".join(why),
        full=bool(n_total) and len(common) == n_total,
    )


def _agreed_since(x: Side, other: Side) -> int:
    """The step at which x last held the other run's state: its resume step when it resumed from a
    checkpoint inside the other run's directory; else 0 (both started from the same initial state)."""
    if not x.resume_step or not x.resume_checkpoint:
        return 0
    ck = Path(str(x.resume_checkpoint))
    for cand in (
        [ck]
        if ck.is_absolute()
        else [x.path / ck, x.path.parent / ck, x.path.parent.parent / ck, ck]
    ):
        try:
            cand.resolve().relative_to(other.path.resolve())
            return x.resume_step
        except ValueError:
            continue
    return 0


def _shared_projections(side_a: Side, side_b: Side, warnings: list[str]) -> int:
    """How many leading sketch projections the two runs' records share the vectors of
    (store.trajectory.shared_projections): all within one sketch version; fewer between two, and a warning
    says so (the others are not compared; digest, sum and norm are, as always)."""
    va, vb = side_a.sketch_versions, side_b.sketch_versions
    shared = trajectory.shared_projections(va, vb)
    if shared < trajectory.SKETCH_K:

        def said(v: set) -> str:
            return " and ".join("unknown" if x is None else str(x) for x in sorted(v, key=str))

        what = "its first projection is" if shared == 1 else "none is"
        warnings.append(
            f"sketches of version {said(va)} (run A) and {said(vb)} (run B) are other random "
            f"projections: {what} compared (records still compare on digest, sum and norm)"
        )
    return shared


def _choose_mode(side_a: Side, side_b: Side, mode: str | None, rtol, atol, warnings: list[str]):
    """bitwise when the topologies are equal and no explicit bound is given, else numeric; refuses a bitwise
    comparison across topologies and bad bounds. Returns (mode, the topology fields that differ)."""
    ma, mb = side_a.manifest, side_b.manifest
    topo = _field_diffs(ma, mb, TOPOLOGY_FIELDS) + observed_topology_differences(
        side_a.run.lock, side_b.run.lock
    )
    algorithm = [
        (k, x, y)
        for k, x, y in _field_diffs(ma, mb, ("parallelism.architecture", "parallelism.staleness"))
        if (k != "parallelism.architecture" and (x or y))  # an attached run states no staleness: 0
        or ma.get("parallelism", {}).get("staleness")
        or mb.get("parallelism", {}).get("staleness")
    ]
    if algorithm:
        warnings.append(
            "different algorithms, not a bug: "
            + "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in algorithm)
            + " (a stale parameter server computes other updates; "
            "a divergence here is expected)"
        )
    if (
        mode is None
        and topo
        and rtol is None
        and atol is None
        and same_shown(side_a.run, side_b.run)
    ):
        # the locks' word against the records': a stated layout may not loosen bit for bit (diff/layout.py)
        warnings.append(
            "the manifests state different layouts ("
            + "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in topo)
            + "), but both runs' records show the same one: compared bit for bit "
            "(--mode numeric compares them numerically)"
        )
        topo = []
    if mode is None:
        mode = "bitwise" if not topo and rtol is None and atol is None else "numeric"
    if mode not in MODES:
        raise BadInput(
            "--mode", f"unknown mode {mode!r}; use one of {', '.join(MODES)}", field="mode"
        )
    if mode == "bitwise" and topo:
        raise BadInput(
            side_b.path / LOCK,
            "a bitwise comparison needs the same topology, and these differ: "
            + "; ".join(f"{k} {_short(x)} vs {_short(y)}" for k, x, y in topo)
            + " (compare them numerically)",
            field=", ".join(k for k, _, _ in topo),
        )
    if mode == "bitwise" and (rtol is not None or atol is not None):
        warnings.append("rtol/atol are ignored in bitwise mode")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
            raise BadInput(f"--{name}", f"must be a finite number >= 0 (got {v!r})", field=name)
    return mode, topo


def _load_calibration(path, side_a: Side, side_b: Side):
    from disttrace.analysis.calibration import Calibration

    cal = Calibration(path)
    if cal.manifest_id not in (side_a.run.manifest_id, side_b.run.manifest_id):
        raise BadInput(
            cal.path,
            f"calibrates manifest {cal.manifest_id[:12]}, neither run A's "
            f"({str(side_a.run.manifest_id)[:12]}) nor B's ({str(side_b.run.manifest_id)[:12]})",
            field="manifest_id",
        )
    return cal


CALIBRATION = "calibration.json"


def _found_calibration(side_a: Side, side_b: Side) -> Path | None:
    """The reference's own measured noise, used by default: `disttrace calibrate` writes calibration.json
    beside the runs of its manifest (runs/<id12>/), so a reference carries it; A's first, then B's. A file
    there that calibrates another manifest is not this run's and is left alone."""
    from disttrace.analysis.calibration import KIND

    for side in (side_a, side_b):
        p = side.path.parent / CALIBRATION
        if not p.is_file():
            continue
        try:  # beside the run, in its runs/<id12>/: read as a store's file is (store/safeio.py)
            doc = orjson.loads(safeio.read_bytes(p, p.parent, "json"))
        except orjson.JSONDecodeError:
            raise BadInput(p, "not valid JSON (a calibration beside the run)") from None
        if isinstance(doc, dict) and doc.get("kind") == KIND:
            if doc.get("manifest_id") == side.run.manifest_id:
                return p
    return None


def _shown(run) -> tuple[str | None, int | None, dict]:
    """What a store's records show of the bound's inputs, from each rank's first recorded step: the coarsest
    floating dtype of any record (None if no record states one), the tokens of a step (every element of its
    distinct data records, when they are token ids; None without data records or with floating ones) and,
    per rank, the micro-batches and their sizes."""
    coarsest, tokens, seen, per_rank, counted = None, 0, set(), {}, True
    for rank in run.ranks():
        entries = run.step_index(rank).records
        if not entries:
            continue
        dtypes, data = _first_step(run, rank, entries[0])
        for dtype in dtypes:
            dtype = str(dtype or "").removeprefix("torch.")
            u = tolerance.UNIT_ROUNDOFF.get(dtype)
            if u is not None and (coarsest is None or u > tolerance.UNIT_ROUNDOFF[coarsest]):
                coarsest = dtype
        for rec in data:
            dtype = str(rec.get("dtype") or "").removeprefix("torch.")
            shape = rec.get("shape") or []
            per_rank.setdefault(rank, {})[int(rec.get("micro_batch") or 0)] = (
                shape[0] if shape else 1
            )
            key = (rec.get("digest"), rec.get("tensor"))
            if not dtype.startswith(("int", "uint")):
                counted = False  # floating inputs: what a vector is, the records do not say
            if key in seen or not shape or not all(isinstance(n, int) for n in shape):
                continue
            seen.add(key)
            tokens += math.prod(shape)
    return coarsest, (tokens if counted and tokens else None), per_rank


def _first_step(run, rank: int, entry) -> tuple[list, list[dict]]:
    """What _shown reads of a step: the dtypes of its records outside the data phase (each once, in order of
    first appearance) and its data records (an Arrow step's other records are not made dicts)."""
    batch = run.step_batch(rank, entry)
    if batch is None:  # a JSON-lines store
        recs = run.records_of_step(rank, entry)
        rest = dict.fromkeys(r.get("dtype") for r in recs if r.get("phase") != "data")
        return list(rest), [r for r in recs if r.get("phase") == "data"]
    is_data = pc.equal(batch.column("phase"), "data").fill_null(False)
    rest = pc.unique(batch.column("dtype").filter(pc.invert(is_data))).to_pylist()
    return rest, trajectory_read.to_records(batch.filter(is_data))


def _as_shown(side_a, side_b, ma: dict, mb: dict, observed: tuple, warnings: list):
    """The bound's inputs as both stores' records show them: a lock's precision or batch is its writer's
    word, and a claim coarser or larger than its records show would loosen what both runs are held to. The
    stated value is kept where it is no looser than the records'; a claim the records contradict is named
    (one line a side) and the records' value taken."""
    out = []
    for label, side, m, obs in (("A", side_a, ma, observed[0]), ("B", side_b, mb, observed[1])):
        dtype, tokens, per_rank = _shown(side.run)
        said = []
        t = dict(m.get("training") or {})
        keys = [k for k in tolerance._DTYPE_KEYS if t.get(k)]
        if dtype is not None and tolerance.unit_roundoff(m) > tolerance.UNIT_ROUNDOFF[dtype]:
            u = tolerance.UNIT_ROUNDOFF[dtype]
            said += [
                f"training.{k} = {t[k]!r}"
                for k in keys
                if tolerance.UNIT_ROUNDOFF.get(str(t[k]).removeprefix("torch."), u) > u
            ]
            for k in keys:
                t.pop(k)
            t["dtype"] = dtype
            m = {**m, "training": t}
        stated = tolerance.tokens_per_step(m, obs)
        if tokens is not None:
            if stated > tokens:
                said.append(f"{stated} tokens a step")
            obs = {**(obs if isinstance(obs, dict) else {}), "tokens_shown": tokens}
        size, accum = t.get("micro_batch_size"), t.get("grad_accum_steps")
        if (
            harness_manifest(m)
            and per_rank
            and any(
                len(v) != accum or any(n != size for n in v.values()) for v in per_rank.values()
            )
        ):
            said.append(f"micro-batch {size} x accumulation {accum}")
        if said:
            shown = [
                f"{dtype} at most" if dtype else None,
                f"{tokens} tokens a step" if tokens else None,
            ]
            if per_rank:
                counts = sorted({len(v) for v in per_rank.values()})
                sizes = sorted({n for v in per_rank.values() for n in v.values()})
                shown.append(
                    f"{'/'.join(map(str, counts))} micro-batch(es) of {'/'.join(map(str, sizes))} a rank"
                )
            warnings.append(
                f"{label}'s manifest states {'; '.join(said)}, which its records contradict (they show "
                f"{', '.join(x for x in shown if x)}): the bound takes what the records show, no looser"
            )
        out.append((m, obs))
    return out[0][0], out[1][0], (out[0][1], out[1][1])


def _tolerance_doc(
    mode: str, tol: _Tol, cal, since: int, ma: dict, mb: dict, rtol, atol, found: bool = False
) -> Tolerance:
    """What the comparison was held to, for the result (and the views that print the bound)."""
    if mode == "bitwise":
        return Tolerance(BoundKind.BITWISE, bound=0.0)
    if tol.user:
        return Tolerance(BoundKind.USER, rtol=rtol or 0.0, atol=atol or 0.0)
    if cal is not None:
        return Tolerance(
            BoundKind.CALIBRATED,
            file=str(cal.path),
            safety=cal.safety,
            manifest_id=cal.manifest_id,
            elsewhere="derived",
            since_step=since,
            derivation=tolerance.explain(ma, mb, tol.observed),
            scale="magnitudes" if tol.mags is not None else "norm",
            found=found,
            sensitivity_classes=sensitivity.classes(tol) or None,
        )
    return Tolerance(
        BoundKind.DERIVED,
        since_step=since,
        derivation=tolerance.explain(ma, mb, tol.observed),
        scale="magnitudes" if tol.mags is not None else "norm",
        sensitivity_classes=sensitivity.classes(tol) or None,
    )


class Setup:
    """Both sides read and checked, the mode chosen, the steps and the bound settled: what comparing any
    rank's steps needs. `only` restricts the ranks read (a partial diff, one process of `--jobs`)."""

    def __init__(
        self,
        a,
        b,
        mode,
        rtol,
        atol,
        allow_edition_mismatch,
        use_index,
        calibration,
        find_calibration,
        only: set[int] | None = None,
        compare: bool = True,
    ):
        self.warnings = warnings = []
        self.side_a = side_a = Side("A", a, use_index, warnings, only)
        self.side_b = side_b = Side("B", b, use_index, warnings, only)
        _check_compatible(side_a, side_b, allow_edition_mismatch, warnings)
        self.n_pre = len(warnings)
        side_a.load()
        side_b.load()
        if only is not None:  # a side that holds none of these ranks does not limit their steps
            for x, y in ((side_a, side_b), (side_b, side_a)):
                if not x.ranks and x.all_ranks:
                    x.steps = y.steps
        self.n_loaded = len(warnings)
        self.rtol, self.atol, self.use_index = rtol, atol, use_index
        self.ma, self.mb = side_a.manifest, side_b.manifest
        self.mode, self.topo = _choose_mode(side_a, side_b, mode, rtol, atol, warnings)
        self.projections = _shared_projections(side_a, side_b, warnings)
        self.n_setup = len(warnings)
        self.same_topology = not self.topo
        self.logical = self.mode == "numeric" and not self.same_topology
        self.ranks = sorted(set(side_a.ranks) | set(side_b.ranks))  # the ranks compared here
        all_ranks = sorted(set(side_a.all_ranks) | set(side_b.all_ranks))
        self.grid_ranks = sorted(side_b.all_ranks) if self.logical else all_ranks
        if compare:
            self._settle(rtol, atol, calibration, find_calibration)

    def _settle(self, rtol, atol, calibration, find_calibration) -> None:
        """The steps both sides hold, the step since which they agree, the calibration and the bound."""
        side_a, side_b, ma, mb, warnings = self.side_a, self.side_b, self.ma, self.mb, self.warnings
        self.steps, self.compared = compared_steps(side_a, side_b)
        self.since = since = max(_agreed_since(side_b, side_a), _agreed_since(side_a, side_b))
        found = False
        if (
            calibration is None
            and find_calibration
            and self.mode == "numeric"
            and rtol is None
            and atol is None
        ):
            calibration = _found_calibration(side_a, side_b)
            found = calibration is not None
        self.calibration, self.found = calibration, found
        cal = _load_calibration(calibration, side_a, side_b) if calibration is not None else None
        from disttrace.analysis.magnitudes import Magnitudes

        mags = (
            (Magnitudes(side_a.run, since), Magnitudes(side_b.run, since))
            if self.mode == "numeric" and rtol is None and atol is None
            else None
        )
        # each lock's `observed` (attached runs count their batch: the reduction size of the bound)
        observed = tuple(
            o if isinstance(o := s.run.lock.get("observed"), dict) else None
            for s in (side_a, side_b)
        )
        if self.mode == "numeric" and rtol is None and atol is None:
            ma, mb, observed = _as_shown(side_a, side_b, ma, mb, observed, warnings)
            self.n_setup = len(warnings)
        self.tol = tol = _Tol(
            self.mode, ma, mb, rtol, atol, since, cal, mags, observed, self.projections
        )
        if tol.ignored_calibration is not None:
            warnings.append(
                f"calibration {tol.ignored_calibration.path} not used: its noise was measured against the "
                "magnitudes, and these runs do not both record them (derived bounds instead)"
            )
            self.n_setup = len(
                warnings
            )  # a warning of the setup: every share of a partial diff says it
        self.tolerance = _tolerance_doc(self.mode, tol, tol.cal, since, ma, mb, rtol, atol, found)

    def outcomes(self, steps: list[int], propagate: bool = True, on_step=None):
        """StepOutcome of each of `steps`, in order, computed as they are asked for (a block of steps at once;
        one at a time when the first divergent step ends the comparison). Where every step will be read (same
        topology, propagating), the next blocks are read and decoded in a second thread while this one
        compares (analysis/readahead.py)."""
        side_a, side_b = self.side_a, self.side_b
        plan = _Plan(steps, self.ranks, (side_a, side_b), self.logical) if propagate else None
        reader = (
            readahead.ReadAhead(_blocks_read(plan, self.ranks, side_a, side_b))
            if plan is not None
            and not self.logical
            and readahead.worth_it(plan.mean_records(), native=trajectory_decode.native_decoder())
            else None
        )
        try:
            yield from self._outcomes(steps, propagate, on_step, reader, plan)
        finally:
            if reader is not None:
                reader.close()

    def _outcomes(self, steps: list[int], propagate: bool, on_step, reader, plan):
        side_a, side_b, tol, ranks = self.side_a, self.side_b, self.tol, self.ranks
        ahead: dict = {}  # steps compared ahead of the loop (a block)
        nothing = [0, 0]
        for n, step in enumerate(steps):
            if on_step is not None:
                on_step(n, len(steps))
            if step not in ahead:
                block = (
                    plan.block(n, WINDOW_ROWS if self.logical else BLOCK_ROWS)
                    if plan is not None
                    else _block(steps, n, ranks, (side_a, side_b), BLOCK_ROWS if propagate else 0)
                )
                if self.logical:  # a window of steps, every rank of each
                    ahead = compare_logical_steps(block, side_a, side_b, tol)
                else:
                    ahead = _compare_block(
                        block,
                        ranks,
                        side_a,
                        side_b,
                        tol,
                        read=None if reader is None else functools.partial(_take, reader, block[0]),
                    )
            if self.logical:
                (per_rank, ev), read = ahead.pop(step), 1
                events, both = ev.events, ev.both
            else:
                (per_rank, read), events, both = ahead.pop(step), [], set()
            # each side's count of the step, handed to the outcome and let go (a dict by step grew with the steps)
            io = (side_a.io.pop(step, nothing), side_b.io.pop(step, nothing))
            yield StepOutcome(step, per_rank, read, io, events, both, tol)
