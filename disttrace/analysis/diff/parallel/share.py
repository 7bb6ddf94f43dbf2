"""One process's share of a comparison: the shares planned (`_plan`), each compared into a payload
(`_Task.payload`), in this process and a pool (`_run_shares`)."""

from __future__ import annotations

import hashlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from disttrace import __version__
from disttrace.analysis import readahead
from disttrace.analysis.diff.parallel.doc import (
    _NOTE,
    _Binding,
    _Covers,
    _Options,
    _Payload,
    _Run,
    _SideBinding,
    _SideFacts,
    _Sides,
    _Tolerance,
)
from disttrace.analysis.diff.parallel.steps import FORMAT, _spans, _Step
from disttrace.analysis.diff.prepare import Setup
from disttrace.analysis.diff.side import Side
from disttrace.errors import BadInput, DisttraceError
from disttrace.fmt import ranges
from disttrace.store import safeio
from disttrace.store.rundir import COMPLETE


class WorkerFailed(DisttraceError):
    """A process of `--jobs` refused its share (bad input, an edited step): its one line, its exit code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def _seal(side: Side) -> str | None:
    """sha256 of the side's COMPLETE (it seals the lock, run.json and every rank's files); None if incomplete."""
    if not side.complete:
        return None
    return hashlib.sha256(safeio.read_bytes(side.path / COMPLETE, side.path, "json")).hexdigest()


def _setup(a, b, opts: dict, only=None, compare: bool = True) -> Setup:
    return Setup(
        a,
        b,
        opts.get("mode"),
        opts.get("rtol"),
        opts.get("atol"),
        bool(opts.get("allow_edition_mismatch")),
        bool(opts.get("use_index", True)),
        opts.get("calibration"),
        bool(opts.get("find_calibration", True)),
        only=only,
        compare=compare,
    )


def _payload(st: Setup, outcomes, ranks: list[int], steps: list[int] | None, opts) -> _Payload:
    a, b = st.side_a, st.side_b
    return _Payload(
        format=FORMAT,
        note=_NOTE,
        covers=_Covers(
            ranks=_spans(ranks),
            steps=_spans(steps) if steps is not None else None,
            of_ranks=_spans(sorted(set(a.all_ranks) | set(b.all_ranks))),
        ),
        binding=_Binding(
            a=_SideBinding(manifest_id=a.run.manifest_id, seal=_seal(a)),
            b=_SideBinding(manifest_id=b.run.manifest_id, seal=_seal(b)),
            options=_Options.of(opts),
            version=__version__,
        ),
        run=_Run(
            mode=st.mode,
            topology_differs=[k for k, _, _ in st.topo],
            logical=st.logical,
            user=bool(st.tol.user),
            use_index=st.use_index,
            grid_ranks=_spans(st.grid_ranks),
            tolerance=_Tolerance.of(st.tolerance),
            pre=st.warnings[: st.n_pre],
            post=st.warnings[st.n_loaded : st.n_setup],
        ),
        sides=_Sides(a=_SideFacts.of(a), b=_SideFacts.of(b)),
        steps=[_Step.of(o) for o in outcomes],
    )


@dataclass(frozen=True)
class _Task:
    """One process's share: the runs, the options, and which ranks or steps it compares."""

    a: str
    b: str
    opts: dict
    ranks: list[int] | None  # these ranks (same topology); None: every rank
    steps: list[int] | None  # these steps (--steps); None: every compared step
    share: tuple[int, int] | None = None  # the k-th of n machines' share of the steps
    part: tuple[int, int] | None = None  # the k-th of n processes' share of the steps

    def payload(self) -> _Payload:
        only = set(self.ranks) if self.ranks is not None else None
        st = _setup(self.a, self.b, self.opts, only=only)
        steps = st.steps
        if self.steps is not None:
            want = set(self.steps)
            steps = [s for s in steps if s in want]
        for k, n in (x for x in (self.share, self.part) if x is not None):
            steps = steps[k * len(steps) // n : (k + 1) * len(steps) // n]  # contiguous blocks
        ranks = sorted(only & set(st.ranks)) if only is not None else st.ranks
        split = self.steps is not None or self.part is not None or bool(self.share)
        return _payload(st, st.outcomes(steps), ranks, steps if split else None, self.opts)


def _work(task: _Task):
    """The process pool's entry: ("ok", payload) or ("error", one line, exit code), never a traceback."""
    try:
        return ("ok", task.payload())
    except DisttraceError as e:
        return ("error", str(e), e.exit_code)


def _context():
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["disttrace.analysis.diff.parallel"])
        return ctx
    return multiprocessing.get_context("spawn")


def _run_shares(tasks: list[_Task], jobs: int) -> list[_Payload]:
    """Every task's payload, in order: this process computes the first share while the pool (started
    meanwhile) computes the others."""
    if len(tasks) == 1:
        results = [_work(tasks[0])]
    else:
        workers = max(1, min(jobs - 1, len(tasks) - 1))
        # the shares' processes use the cores a read-ahead thread would
        pool = ProcessPoolExecutor(
            max_workers=workers, mp_context=_context(), initializer=readahead.disable
        )
        with pool as ex, readahead.disabled():
            pending = [ex.submit(_work, t) for t in tasks[1:]]
            results = [_work(tasks[0])] + [f.result() for f in pending]
    for r in results:
        if r[0] == "error":
            raise WorkerFailed(r[1], r[2])
    return [r[1] for r in results]


def _plan(
    a,
    b,
    opts: dict,
    jobs: int,
    ranks: list[int] | None,
    steps: list[int] | None,
    share: tuple[int, int] | None = None,
) -> list[_Task]:
    """The processes' shares: ranks split where the topologies are the same (each process reads only its
    ranks), steps across topologies (a step's ranks are read together). `share` (k, n): the k-th of n equal
    shares of the ranks (or, across topologies, of the steps), for the k-th of n machines."""
    st = _setup(a, b, opts, only=set(), compare=False)
    everyone = sorted(set(st.side_a.all_ranks) | set(st.side_b.all_ranks))
    step_share = None
    if share is not None:
        k, n = share
        if st.logical:
            step_share = share
        else:
            ranks = everyone[k * len(everyone) // n : (k + 1) * len(everyone) // n]
            if not ranks:
                raise BadInput(
                    "--share",
                    f"share {k}/{n} holds no rank: the runs have {len(everyone)} rank(s); "
                    "give at most that many shares",
                )
    if ranks is not None:
        if st.logical:
            raise BadInput(
                "--ranks",
                "a diff across topologies reads every rank of a step together (a logical tensor is "
                "combined from several ranks' shards, replicas are checked against each other); "
                "split it by steps with --steps",
            )
        chosen = [r for r in ranks if r in set(everyone)]
        if not chosen:
            raise BadInput(
                "--ranks",
                f"names none of the runs' ranks ({ranges(everyone) or 'none'})",
            )
    else:
        chosen = everyone
    if not st.logical and steps is None:
        n = max(1, min(jobs, len(chosen)))
        parts = [chosen[k * len(chosen) // n : (k + 1) * len(chosen) // n] for k in range(n)]
        return [_Task(str(a), str(b), opts, p, None) for p in parts]
    n = max(1, jobs)
    return [_Task(str(a), str(b), opts, None, steps, step_share, (k, n)) for k in range(n)]
