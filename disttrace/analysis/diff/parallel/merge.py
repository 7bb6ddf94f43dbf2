"""Combining payloads into the result (`_combine`, `_fold`) and reading partial documents someone else
wrote: size-capped, validated, bound to the same runs and options, covering every rank or step once."""

from __future__ import annotations

from pathlib import Path

from pydantic import (
    BaseModel,
    ValidationError,
)

from disttrace.analysis.diff.fold import Fold, fold_result
from disttrace.analysis.diff.parallel.doc import _Covers, _Payload, _SideFacts, _Sides
from disttrace.analysis.diff.parallel.steps import (
    MAX_PARTIAL_BYTES,
    MAX_STEPS_HELD,
    _spans,
    _Step,
    _unspan,
)
from disttrace.analysis.diff.prepare import compared_steps
from disttrace.analysis.diff.side import common_steps, side_warnings
from disttrace.analysis.result import DiffResult
from disttrace.errors import BadInput
from disttrace.fmt import ranges
from disttrace.store import safeio
from disttrace.store.rundir import MAX_WORLD


def _combine(payloads: list[_Payload]) -> _Payload:
    """One payload from shares of one comparison (already checked to belong together)."""
    first = payloads[0]
    if len(payloads) == 1:
        return first
    by_rank = first.by_rank
    ranks = sorted({r for p in payloads for r in _unspan(p.covers.ranks)})
    steps = None if by_rank else sorted({s for p in payloads for s in _unspan(p.covers.steps)})
    covers = _Covers(
        ranks=_spans(ranks),
        steps=_spans(steps) if steps is not None else None,
        of_ranks=first.covers.of_ranks,
    )
    sides = first.sides
    if by_rank:

        def joined(label: str) -> _SideFacts:
            rs = {r: v for p in payloads for r, v in getattr(p.sides, label).rank_steps}
            rw = {r: v for p in payloads for r, v in getattr(p.sides, label).rank_warnings}
            return getattr(first.sides, label).model_copy(
                update={"rank_steps": sorted(rs.items()), "rank_warnings": sorted(rw.items())}
            )

        sides = _Sides(a=joined("a"), b=joined("b"))
    parts: dict[int, list[_Step]] = {}
    for p in payloads:
        for e in p.steps:
            parts.setdefault(e.step, []).append(e)
    steps_out = [_Step.joined(parts[s], by_rank) for s in sorted(parts)]
    return first.model_copy(update={"covers": covers, "sides": sides, "steps": steps_out})


class _SideView:
    """A side as `compared_steps` reads it, rebuilt from a payload."""

    def __init__(self, f: _SideFacts, steps: list[int]):
        self.label, self.path, self.kind = f.label, Path(f.path), f.kind
        self.complete, self.resume_step, self.steps = f.complete, f.resume_step, steps
        self.manifest = {"training": {"steps": f.n_total}, "record": {"every": f.every}}


def _fold(payload: _Payload, whole: bool) -> DiffResult:
    """The result of a payload: the one-process result when it covers every rank and step (`whole`), else
    the result of what it covers."""
    run = payload.run
    warnings = list(run.pre)
    views, summaries = {}, {}
    held = {label: f.held() for label, f in payload.sides}
    for label, f in payload.sides:
        rank_steps = held[label]
        all_ranks = _unspan(f.all_ranks)
        steps = common_steps(rank_steps[r] for r in sorted(rank_steps))
        if not rank_steps and all_ranks and not whole:  # a share of ranks this side lacks
            other = held["b" if label == "a" else "a"]
            steps = common_steps(other[r] for r in sorted(other))
        rw = dict(f.rank_warnings)
        for r in sorted(rank_steps):
            warnings.extend(rw.get(r, ()))
        warnings.extend(side_warnings(f.label, Path(f.path), all_ranks, f.world, f.complete, steps))
        views[label] = _SideView(f, steps)
        summaries[label] = f.summary(steps)
    warnings.extend(run.post)
    steps, compared = compared_steps(views["a"], views["b"])
    have = {e.step: e for e in payload.steps}
    if whole:
        _check_whole(payload, steps, have)
    fold = Fold(run.mode, warnings)
    for s in steps:
        if s in have:
            fold.add(have[s].outcome(run.user))
    grid = _unspan(run.grid_ranks)
    if not whole and payload.by_rank:  # a share of ranks draws only its own rows
        mine = set(_unspan(payload.covers.ranks))
        grid = [r for r in grid if r in mine]
    return fold_result(
        fold,
        mode=run.mode,
        a=summaries["a"],
        b=summaries["b"],
        topo_differs=run.topology_differs,
        compared=compared,
        ranks=grid,
        tolerance=run.tolerance.tolerance(),
        use_index=run.use_index,
        warnings=warnings,
        logical=run.logical,
    )


def _check_whole(payload: _Payload, steps: list[int], have: dict[int, _Step]) -> None:
    """A merge holds every step every rank holds, and (same topology) every rank at each exactly once."""
    lacking = [s for s in steps if s not in have]
    if lacking:
        raise BadInput(
            "--merge",
            f"no partial holds step(s) {ranges(lacking)} of the steps every rank holds",
            field="steps",
        )
    if payload.run.logical:
        return
    of = _unspan(payload.covers.of_ranks)
    for s in steps:  # one process compares every rank at every step
        got = have[s].held_ranks()
        if got != of:
            raise BadInput(
                "--merge",
                f"step {s}: results of rank(s) {ranges(set(of) ^ set(got))} missing or twice",
                field="steps",
            )


def _read_partial(path: Path) -> _Payload:
    import orjson

    with safeio.open_file(path, None, MAX_PARTIAL_BYTES) as f:  # a regular file, size-capped
        data = f.read(MAX_PARTIAL_BYTES + 1)
    if len(data) > MAX_PARTIAL_BYTES:
        raise BadInput(path, f"more than the {MAX_PARTIAL_BYTES} bytes a partial document may hold")
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise BadInput(
            path, "not a JSON document (a `disttrace diff --ranks ... --json` partial)"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("partial"), dict):
        raise BadInput(
            path,
            "not a partial diff document (no 'partial' object: write one with "
            "`disttrace diff A B --ranks SPEC --json`)",
            field="partial",
        )
    try:
        payload = _Payload.model_validate(doc["partial"])
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in ("partial", *err["loc"]))
        raise BadInput(path, err["msg"].lower(), field=loc) from None
    _check_sizes(payload, path)
    return payload


def _span_count(spans, path, field: str, limit: int) -> int:
    """How many numbers `spans` name: each span low to high, all of them at most `limit` (they are
    expanded in memory)."""
    n = 0
    for lo, hi, *_ in spans:
        if hi < lo:
            raise BadInput(path, f"a span runs from {lo} down to {hi}", field=field)
        n += hi - lo + 1
        if n > limit:
            raise BadInput(path, f"names more than {limit}", field=field)
    return n


def _check_sizes(p: _Payload, path) -> None:
    _span_count(p.covers.ranks, path, "partial.covers.ranks", MAX_WORLD)
    _span_count(p.covers.of_ranks, path, "partial.covers.of_ranks", MAX_WORLD)
    if p.covers.steps is not None:
        _span_count(p.covers.steps, path, "partial.covers.steps", MAX_STEPS_HELD)
    _span_count(p.run.grid_ranks, path, "partial.run.grid_ranks", MAX_WORLD)
    held = 0
    for label, side in p.sides:
        _span_count(side.all_ranks, path, f"partial.sides.{label}.all_ranks", MAX_WORLD)
        for _, spans in side.rank_steps:
            held += _span_count(
                spans, path, f"partial.sides.{label}.rank_steps", MAX_STEPS_HELD - held
            )
    for n, e in enumerate(p.steps):
        _span_count(e.equal, path, f"partial.steps.{n}.equal", MAX_WORLD)


def _differing_field(x: BaseModel, y: BaseModel, skip=()) -> str | None:
    return next(
        (k for k in type(x).model_fields if k not in skip and getattr(x, k) != getattr(y, k)),
        None,
    )


def _belongs(first: _Payload, p: _Payload, where: Path, first_where: Path) -> None:
    """`p` is a share of the same comparison as `first`: the same runs (manifest ids, seals), options and
    version, the same facts of the runs."""
    for key in ("binding", "run"):
        sub = _differing_field(getattr(p, key), getattr(first, key))
        if sub is not None:
            raise BadInput(
                where,
                f"is not a share of the same comparison as {first_where}: its {key}.{sub} differs "
                "(other runs, other seals or other options)",
                field=f"partial.{key}.{sub}",
            )
    if p.covers.of_ranks != first.covers.of_ranks:
        raise BadInput(
            where, f"the runs' ranks differ from {first_where}'s", field="partial.covers.of_ranks"
        )
    for (label, x), (_, y) in zip(p.sides, first.sides):
        k = _differing_field(x, y, skip=("rank_steps", "rank_warnings"))
        if k is not None:
            raise BadInput(
                where,
                f"run {label.upper()}'s {k} differs from {first_where}'s",
                field=f"partial.sides.{label}.{k}",
            )


def _check_covers(payloads: list[_Payload], paths: list[Path]) -> None:
    """Together the partials cover every rank (or step) exactly once, each only what it says it covers."""
    first, first_where = payloads[0], paths[0]
    by_rank = [p.by_rank for p in payloads]
    if len(set(by_rank)) > 1:
        raise BadInput(
            paths[by_rank.index(not by_rank[0])],
            f"splits by {'ranks' if not by_rank[0] else 'steps'} and {first_where} by the other",
            field="partial.covers",
        )
    of = _unspan(first.covers.of_ranks)
    seen: dict[int, Path] = {}
    key = "ranks" if by_rank[0] else "steps"
    for p, where in zip(payloads, paths):
        mine = _unspan(getattr(p.covers, key))
        again = [x for x in mine if x in seen]
        if again:
            raise BadInput(
                where,
                f"{key} {ranges(again)} are also covered by {seen[again[0]]}",
                field=f"partial.covers.{key}",
            )
        seen.update(dict.fromkeys(mine, where))
        if key == "steps" and _unspan(p.covers.ranks) != of:
            raise BadInput(
                where, "a share of steps must cover every rank", field="partial.covers.ranks"
            )
        if key == "ranks":  # what it says it covers is what it holds
            held = {r for _, side in p.sides for r, _ in side.rank_steps}
            if not held <= set(mine):
                raise BadInput(where, "holds ranks it does not cover", field="partial.sides")
            if any(r not in set(mine) for e in p.steps for r in e.held_ranks()):
                raise BadInput(
                    where, "holds results of ranks it does not cover", field="partial.steps"
                )
        elif any(e.step not in set(mine) for e in p.steps):
            raise BadInput(where, "holds results of steps it does not cover", field="partial.steps")
    if key == "ranks":
        lacking = [r for r in of if r not in seen]
        if lacking:
            raise BadInput(
                "--merge",
                f"no partial covers rank(s) {ranges(lacking)} of {ranges(of)}",
                field="ranks",
            )
