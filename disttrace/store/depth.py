"""Reading a run's depth records (`depth/rank-NNNNN.jsonl`, written by run/record/depth.py; docs/zoom.md). No torch.

Each line is validated by `store.documents.DepthRecord` before any field of it is used, through the run store's
confined reader (store/safeio.py); a torn last line (a crash mid-write) is reported, not fatal."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrace.store import safeio
from disttrace.store.documents import DepthRecord
from disttrace.store.jsonlines import iter_jsonl
from disttrace.store.rundir import Run

KIND = "depth"


@dataclass
class DepthRead:
    by_rank: dict[int, list[DepthRecord]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.by_rank.values())


def read_depth(run: Run) -> DepthRead:
    """Every rank's depth records, in the order each rank wrote them (execution order)."""
    out = DepthRead()
    for rank in run.ranks(KIND):
        path = run.rank_path(KIND, rank)
        if safeio.size(path, run.path) > safeio.LIMITS["jsonl"]:
            from disttrace.errors import BadInput

            raise BadInput(path, "more than a depth file may hold; refused unread")
        torn: list[str] = []
        recs = []
        for n, obj in enumerate(iter_jsonl(path, torn, run.path), 1):
            rec = DepthRecord.parse_line(obj, path, n)
            if rec.rank != rank:
                from disttrace.errors import BadInput

                raise BadInput(path, f"line {n}: a record of rank {rec.rank}", field="rank")
            recs.append(rec)
        out.warnings += torn
        out.by_rank[rank] = recs
    return out


def origin(run_path, step: int, level: str) -> dict:
    """What a depth run's run.json names as its origin (lab/zoom.py writes it): the run it re-computes."""
    from pathlib import Path

    return {"depth_of": str(Path(run_path).resolve()), "step": step, "level": level}


def find_depth_run(run: Run, step: int, level: str, manifest_id: str) -> Run | None:
    """The complete run that recorded `run`'s `step` at depth `level`, if `zoom` made one: under the same
    runs root, in the directory of its depth manifest's id (`manifest_id`, record.depth set), naming `run` as
    its origin. Reads nothing outside that one directory's run.json files."""
    from disttrace.errors import BadInput

    want = origin(run.path, step, level)
    base = run.path.parent.parent / str(manifest_id)[:12]
    if not safeio.store_name(base.name) or not base.is_dir():
        return None
    for info in sorted(base.glob("*/run.json")):
        try:
            r = Run(info.parent)
            if r.manifest_id == manifest_id and r.run_info.origin == want and r.complete:
                return r
        except BadInput:
            continue
    return None


def depth_replays(run: Run, step: int, level: str) -> list[Run]:
    """The complete replays of an attached `run` that recorded its `step` at depth `level` (`disttrace replay
    RUN --step S --depth LEVEL -- CMD`), newest first: the `replay-*` directories beside it whose run.json
    names it, the step and the level. Reads nothing outside those directories' run.json files."""
    from disttrace.errors import BadInput

    here = str(run.path.resolve())
    out = []
    for info in sorted(run.path.parent.glob("replay-*/run.json")):
        if not safeio.store_name(info.parent.name):
            continue
        try:
            r = Run(info.parent)
            doc, spec = r.run_info.replay, r.run_info.depth
            if doc is None or not isinstance(
                spec, dict
            ):  # depth: free-form, run/record/depth.py checks it
                continue
            if (doc.of, doc.step, spec.get("step"), spec.get("level")) != (
                here,
                step,
                step,
                level,
            ):
                continue
            if r.complete:
                out.append(r)
        except BadInput:
            continue
    order = [r.run_info.created or 0 for r in out]
    return [r for _, r in sorted(zip(order, out), key=lambda x: x[0], reverse=True)]
