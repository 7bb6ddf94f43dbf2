"""diff spread over processes and machines (docs/scale.md): `--jobs N`, `--ranks SPEC`, `--steps SPEC`, `--merge`.

    result = diff_runs(a, b, jobs=4)                    # the one-process result, computed in 4 processes
    part = diff_partial(a, b, ranks=parse_spec("0-63", "--ranks"))  # what ranks 0..63 show
    result = merge_partials(["p0.json", "p1.json"])     # the one-process result, from partial documents

What can be split. Where both runs have the same topology, every rank's records are compared with the same
rank's records of the other run, and nothing else: ranks are split (each process reads only its ranks' step
index and trajectory; the magnitudes, which a numeric bound sums over all ranks, are read whole). Across
topologies a logical tensor is combined from shards of several ranks, each of B's replicas is compared with
A's lowest rank's copy, replicas of one run are checked against each other and losses are matched by the
samples of their micro-batch, across ranks: a step's records of every rank are read together, and steps
are split instead.

How results combine. A process compares its share and returns, per step, each rank's result (`RankStep`:
counts, the largest errors and bounds per phase, the first divergent unit with its key), the warnings the
step raised and where its bounds came from; per rank, the steps its index holds and what reading it warned
of. The combination replays these in step order through the same fold one process uses (analysis/diff/fold.py's `Fold`),
and derives what depends on every rank (the steps all ranks hold, the compared steps and why, the
incomplete-run warnings) from the ranks' steps: so the document is byte for byte the one-process document
(tests/test_diff_jobs.py compares the bytes).

A partial document is a diff document of the ranks (or steps) read, with `equal` null unless a divergence
was found there (then false: the runs differ whatever the others hold), and a `partial` object: what it
covers, what it is bound to (both runs' manifest ids and the sha256 of their COMPLETE, which seals every
rank's files, and the diff's options), and the per-step data a merge needs. Its exit code is 1 when its
share diverges and 4 (no verdict) when it does not, never 0. A merge reads documents someone else wrote:
each is size-capped, validated by pydantic models, bound to the same runs and options as the others, and
together they must cover every rank (or step) exactly once; anything else is exit 2 naming the file.

No torch: readers only.
"""

from __future__ import annotations

from pathlib import Path

from disttrace.analysis.diff.parallel.doc import _Payload
from disttrace.analysis.diff.parallel.merge import (
    _belongs,
    _check_covers,
    _combine,
    _fold,
    _read_partial,
)
from disttrace.analysis.diff.parallel.share import _plan, _run_shares
from disttrace.analysis.diff.parallel.steps import MAX_PARTIALS, MAX_SPEC_ITEMS, _unspan
from disttrace.analysis.diff.serial import diff_serial
from disttrace.analysis.result import DiffResult
from disttrace.errors import EXIT_DIVERGED, EXIT_PARTIAL, BadInput
from disttrace.fmt import ranges
from disttrace.store.rundir import MAX_WORLD

# ---------------------------------------------------------------- specs


def parse_spec(spec: str, option: str, limit: int = MAX_WORLD) -> list[int]:
    """'0-63', '0,2,4-7' -> the sorted numbers; anything else is BadInput naming the option."""
    text = spec.strip()
    if not text:
        raise BadInput(option, "is empty; give numbers and ranges such as 0-63 or 0,2,4-7")
    items = text.split(",")
    if len(items) > MAX_SPEC_ITEMS:
        raise BadInput(option, f"has more than {MAX_SPEC_ITEMS} comma-separated items")
    out: set[int] = set()
    for item in items:
        lo, sep, hi = item.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise BadInput(
                option, f"{item.strip()!r} is not a number or a range such as 4-7"
            ) from None
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise BadInput(option, f"{item.strip()!r} is not a number or a range such as 4-7")
        if last < first:
            raise BadInput(option, f"{item.strip()!r}: a range runs from low to high")
        if last >= limit:
            raise BadInput(option, f"{item.strip()!r}: more than the {limit} a spec may name")
        if last - first >= limit:
            raise BadInput(option, f"{item.strip()!r}: a range of more than {limit}")
        out.update(range(first, last + 1))
        if len(out) > limit:
            raise BadInput(option, f"names more than {limit} numbers")
    return sorted(out)


# ---------------------------------------------------------------- the entry points


def diff_jobs(a, b, jobs: int, **opts) -> DiffResult:
    """diff_runs(a, b, **opts) computed in `jobs` processes: the same result."""
    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})", field="jobs")
    tasks = _plan(a, b, opts, jobs, None, None)
    if len(tasks) <= 1 and tasks and tasks[0].part is None:
        return diff_serial(a, b, **opts)
    return _fold(_combine(_run_shares(tasks, jobs)), whole=True)


class PartialDiff:
    """A partial diff: `result` is what its ranks (or steps) show, `payload` what a merge needs."""

    def __init__(self, payload: _Payload):
        self.payload = payload
        self.result = _fold(payload, whole=False)

    @property
    def covered(self) -> str:
        """What it read, in words: 'ranks 0..63' or 'steps 1..500'."""
        cov = self.payload.covers
        if cov.steps is None:
            return f"ranks {ranges(_unspan(cov.ranks))}"
        return f"steps {ranges(_unspan(cov.steps))}"

    @property
    def diverged(self) -> bool:
        return self.result.first_divergence is not None

    @property
    def exit_code(self) -> int:
        """1 when its share diverges (the runs differ, whatever the rest holds), else 4: no verdict."""
        return EXIT_DIVERGED if self.diverged else EXIT_PARTIAL

    def to_dict(self) -> dict:
        doc = self.result.to_dict()
        doc["equal"] = False if self.diverged else None
        return {"partial": self.payload.model_dump(), **doc}

    def to_json(self) -> str:
        from disttrace.jsondoc import dumps

        return dumps(self.to_dict())


def parse_share(text: str) -> tuple[int, int]:
    """'3/16' -> (3, 16): the 3rd (from 0) of 16 shares; anything else is BadInput naming --share."""
    k, sep, n = text.strip().partition("/")
    if not (sep and k.strip().isdigit() and n.strip().isdigit()):
        raise BadInput("--share", f"{text!r} is not K/N (this machine's index from 0, of N)")
    k_, n_ = int(k), int(n)
    if not 0 <= k_ < n_ or n_ > MAX_WORLD:
        raise BadInput("--share", f"{text!r}: K/N needs 0 <= K < N <= {MAX_WORLD}")
    return k_, n_


def diff_partial(
    a,
    b,
    *,
    ranks: list[int] | None = None,
    steps: list[int] | None = None,
    share: tuple[int, int] | None = None,
    jobs: int = 1,
    **opts,
) -> PartialDiff:
    """What `ranks` (same topology), `steps`, or the k-th of n `share`s of the comparison show, for a later
    merge_partials."""
    if jobs < 1:
        raise BadInput("--jobs", f"must be at least 1 (got {jobs})", field="jobs")
    if sum(x is not None for x in (ranks, steps, share)) > 1:
        raise BadInput("--ranks", "give one of --ranks, --steps and --share")
    tasks = _plan(a, b, opts, jobs, ranks, steps, share)
    return PartialDiff(_combine(_run_shares(tasks, jobs)))


def merge_partials(paths: list[Path | str]) -> DiffResult:
    """The whole result from partial documents that together cover every rank (or step) exactly once."""
    if not paths:
        raise BadInput("--merge", "needs the partial documents to combine", field="merge")
    if len(paths) > MAX_PARTIALS:
        raise BadInput("--merge", f"more than {MAX_PARTIALS} partial documents", field="merge")
    paths = [Path(p) for p in paths]
    payloads = [_read_partial(p) for p in paths]
    for p, where in zip(payloads[1:], paths[1:]):
        _belongs(payloads[0], p, where, paths[0])
    _check_covers(payloads, paths)
    return _fold(_combine(payloads), whole=True)
