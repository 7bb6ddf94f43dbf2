"""Follow a run store while it is being written: which step every rank has finished, the loss, seconds per
step, the events as they happen (checkpoint published, fault fired, rank failed), and a stall.

Read-only and incremental: each poll reads only what was appended since the last one (file offsets are
kept), so it works the same for a launcher watching its own job, for ranks on other nodes that share the
store, and for a user's own `torchrun` (`disttrace run --prepare-only`). What is shown is data
(`Progress`); `views/progress.py` renders it. No torch here.
"""

from __future__ import annotations

import fcntl
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from disttrace.errors import BadInput
from disttrace.store import collframes, safeio
from disttrace.store.documents import CollectiveLine
from disttrace.store.events import (
    CheckpointSaved,
    FaultEvent,
    JobFailed,
    LiveCheckFailed,
    RankFailed,
    Resumed,
    parse_event,
)
from disttrace.store.records import FAILURE_EVENTS, Event
from disttrace.store.rundir import COMPLETE, Run

MIN_STALL_S = 3.0  # a stall is never declared sooner: start-up jitter, a slow checkpoint write
STALL_STEPS = 10.0  # ... nor before this many median step times without a finished step
TAIL_READ = 16 << 20  # the most one poll of a followed file reads (the next poll reads on)
TAIL_BYTES = 64 * 1024  # how much of the end of a collective trace a stall report reads


@dataclass
class Notice:
    """One thing that happened in the job, in a line."""

    kind: str  # checkpoint | fault | resumed | rank_failed | live_check_failed | job_failed
    text: str
    step: int | None = None
    rank: int | None = None
    disk_full: bool = (
        False  # a rank that stopped on a full disk (the launcher's last line says it once)
    )


@dataclass
class RankState:
    """Where one rank is: its last finished step and the last collective its trace shows."""

    rank: int
    step: int
    op: str | None = None
    seq: int | None = None
    group: str | None = None
    issued_ago_s: float | None = None

    def describe(self) -> str:
        # whether it returned is not said: an async op (DDP's buckets) returns at once and blocks in wait(),
        # which the trace does not see
        text = f"rank {self.rank} (last step {self.step}"
        if self.op is None:
            return text + ", no collective in its trace)"
        ago = f", {self.issued_ago_s:.1f} s ago" if self.issued_ago_s is not None else ""
        return (
            text + f"; last collective issued: {self.op} #{self.seq} on group [{self.group}]{ago})"
        )


@dataclass
class Stall:
    idle_s: float  # since a rank last finished a step
    threshold_s: float
    behind: list[
        RankState
    ]  # the ranks the others wait for (empty: the trace does not tell them apart)
    others: list[RankState]

    def describe(self) -> str:
        head = f"stall: no rank finished a step for {self.idle_s:.1f} s (threshold {self.threshold_s:.1f} s)"
        if self.behind:
            text = head + "; behind: " + ", ".join(r.describe() for r in self.behind)
            if self.others:
                text += "; waiting: " + ", ".join(r.describe() for r in self.others)
            return text
        return (
            head + "; no rank is behind the others: " + ", ".join(r.describe() for r in self.others)
        )


@dataclass
class Progress:
    """One poll's view of the run."""

    total: int  # the manifest's training.steps
    start_step: int  # a recovered run starts after its checkpoint's step
    done: int  # the last step every rank (with a step index in this store) has finished
    ranks: dict[int, int]  # rank -> last finished step
    loss: float | None  # mean loss of step `done` over the ranks that compute one
    step_s: float | None  # median seconds per step so far
    complete: bool
    failed: bool  # a rank failed or the launcher logged job_failed
    notices: list[Notice] = field(default_factory=list)  # new since the last poll
    stall: Stall | None = None  # set once per stall (on the poll that detects it)

    @property
    def eta_s(self) -> float | None:
        if self.step_s is None:
            return None
        return max(0, self.total - self.done) * self.step_s


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


class _Tail:
    """The complete lines appended to one file since the last read (a line still being written waits)."""

    def __init__(self, path: Path, root: Path):
        self.path = path
        self.root = root
        self.offset = 0

    def read(self) -> list[dict]:
        try:  # a regular file inside the run (a FIFO there would block the follower), a bounded read
            with safeio.open_file(self.path, self.root) as f:
                f.seek(self.offset)
                data = f.read(TAIL_READ)
        except (OSError, BadInput):  # not there yet, or nothing a follower can read
            return []
        end = data.rfind(b"\n")
        if end < 0:
            if len(data) == TAIL_READ:  # a line longer than any of ours: passed over
                self.offset += len(data)
            return []
        self.offset += end + 1
        out = []
        for line in data[:end].split(b"\n"):
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue  # progress is best effort: the readers report bad lines, not the follower
            if isinstance(obj, dict):
                out.append(obj)
        return out


def _first_line(text) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def _notice(obj: dict) -> Notice | None:
    """What one line of events.jsonl tells a watcher; None for a kind it does not show, or a line its model
    refuses (progress is best effort: the readers report bad lines, not the follower)."""
    try:
        e = parse_event(obj, "events.jsonl", 0)
    except BadInput:
        return None
    if isinstance(e, CheckpointSaved):
        return Notice("checkpoint", f"checkpoint of step {e.step} published: {e.path}", step=e.step)
    if isinstance(e, FaultEvent):
        return Notice(
            "fault",
            f"fault {e.fault} fired at step {e.step} rank {e.rank} "
            f"(micro-batch {e.micro_batch}, {e.phase or e.point})",
            step=e.step,
            rank=e.rank,
        )
    if isinstance(e, Resumed):
        return Notice(Event.RESUMED, f"resumed from the checkpoint of step {e.step}", step=e.step)
    if isinstance(e, RankFailed):
        return Notice(
            Event.RANK_FAILED,
            f"rank {e.rank} failed: {_first_line(e.error)}",
            rank=e.rank,
            disk_full=bool(e.disk_full),
        )
    if isinstance(e, LiveCheckFailed):
        return Notice(
            Event.LIVE_CHECK_FAILED,
            f"live check failed at step {e.step}: {e.phase} copies over group {e.group} differ",
            step=e.step,
        )
    if isinstance(e, JobFailed):
        return Notice(Event.JOB_FAILED, f"job failed: {_first_line(e.reason)}")
    return None


@dataclass(frozen=True)
class Issued:
    """A collective a rank issued, as its trace's line says."""

    group: str
    seq: int
    op: str | None
    start: float | None


@dataclass
class Tail:
    """The end of one rank's collective trace: each group's last collective issued, and the last of all."""

    groups: dict[str, Issued] = field(
        default_factory=dict
    )  # group (its ranks, comma-joined) -> last
    last: Issued | None = None


def collective_tail(path: Path, now: float | None = None) -> Tail:
    """The end of one rank's collective trace (only its last TAIL_BYTES are read, or the last frame of the
    Flight Recorder's: its last copy of the ring): for each group, the last collective issued, and `last`,
    the last one issued on any group. Lines that are not collectives (an end, a torn or edited line) are
    passed over: progress is best effort."""
    try:
        if Path(path).name.endswith(collframes.SUFFIX):
            data, size = collframes.last_frame(path), 0
        else:
            with safeio.open_file(path, Path(path).parent.parent) as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - TAIL_BYTES))
                data = f.read()
    except (OSError, BadInput):
        return Tail()
    lines = data.split(b"\n")
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first line is cut
    tail = Tail()
    for n, line in enumerate(lines, 1):
        try:
            rec = CollectiveLine.parse_line(orjson.loads(line), path, n)
        except (orjson.JSONDecodeError, BadInput):
            continue
        if rec.seq is None or rec.op is None:
            continue  # an end line
        tail.last = Issued(str(rec.group), rec.seq, rec.op, rec.start)
        tail.groups[tail.last.group] = tail.last
    return tail


def _members(group: str) -> set[int]:
    return {int(x) for x in group.split(",") if x.strip().isdigit()}


def behind_ranks(steps: dict[int, int], tails: dict[int, Tail]) -> set[int]:
    """The ranks the others wait for: behind in finished steps, or (all at one step) having issued fewer
    collectives on a group than another member of it has."""
    if not steps:
        return set()
    hi = max(steps.values())
    behind = {r for r, s in steps.items() if s < hi}
    if behind:
        return behind
    for r, tail in tails.items():
        for g, last in tail.groups.items():
            for other in _members(g) - {r}:
                theirs = tails[other].groups.get(g) if other in tails else None
                if theirs is not None and theirs.seq > last.seq:
                    behind.add(r)
    return behind


def stall_threshold(step_times: list[float], collective_timeout_s: float | None) -> float:
    """max(STALL_STEPS x median step, MIN_STALL_S), and at most half the collective timeout so the stall is
    named before the timeout ends the job."""
    t = max(STALL_STEPS * statistics.median(step_times), MIN_STALL_S) if step_times else MIN_STALL_S
    if collective_timeout_s:
        t = min(t, 0.5 * float(collective_timeout_s))
    return t


def writer_alive(run_dir: Path | str) -> bool | None:
    """Does a launcher still hold this run directory? Each launcher holds an flock on
    `.launcher-node<K>.lock` while its job runs (run/job/launch.py). None when no launcher ever took one (the
    ranks were started by hand with torchrun): then only events and a timeout tell."""
    locks = sorted(Path(run_dir).glob(".launcher-node*.lock"))
    if not locks:
        return None
    for p in locks:
        try:  # a regular file inside the run (a FIFO in its place would block the follower's open)
            fd = safeio.open_fd(p, run_dir)
        except BadInput:
            continue
        try:
            # the launcher writes its pid once it holds the lock; an empty file is a launcher taking it
            # now, and probing then could make its non-blocking LOCK_EX fail
            if not os.read(fd, 32).strip():
                return True
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)  # free: this node's launcher is gone
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


class Follower:
    """Polls a run directory; every `poll()` returns a `Progress` with what is new. Raises BadInput (exit
    2) when the directory is not a run."""

    def __init__(self, run_dir: Path | str, clock=time.monotonic):
        self.run = Run(run_dir)
        self.path = self.run.path
        m = self.run.manifest
        self.total = m.training.steps or 0
        self.timeout_s = m.debug.collective_timeout_s
        self.clock = clock
        resume = self.run.run_info.resume
        self.start_step = resume.step if resume is not None else 0
        self._index: dict[int, _Tail] = {}
        self._events = _Tail(self.path / "events.jsonl", self.path)
        self.last: dict[int, int] = {}  # rank -> last finished step
        self._ranges: dict[
            int, dict[int, tuple[int, int]]
        ] = {}  # rank -> step -> (offset, length), not yet done
        self._step_s: dict[int, float] = {}  # step -> the slowest rank's seconds for it
        self._loss_ranks: set[int] | None = (
            None  # ranks whose steps hold a loss record (pp: the last stage)
        )
        self.done = self.start_step
        self.loss: float | None = None
        self.failed = False
        self.last_growth = clock()  # when a rank last finished a step (or the follower started)
        self._activity = (clock(), -1)  # (when, bytes of the trace files) for idle_s
        self._stall_reported = False

    # ------------------------------------------------------------ polling
    def poll(self) -> Progress:
        now = self.clock()
        # COMPLETE is written after every index line: seen before the indexes are read, it means they are
        # all there (seen after, steps written in between would be reported complete but never shown)
        complete = safeio.present(self.path / COMPLETE)
        notices = []
        for e in self._events.read():
            n = _notice(e)
            if n is None:
                continue
            notices.append(n)
            if n.kind in FAILURE_EVENTS:
                self.failed = True
            if n.kind == Event.RESUMED and n.step is not None and self.done < n.step:
                self.start_step = self.done = n.step
        grew = self._read_indexes()
        if grew:
            self.last_growth = now
            self._stall_reported = False
        done = min(self.last.values()) if self.last else self.start_step
        if done > self.done:
            self.done = done
            self.loss = self._loss(done)
            for ranges in self._ranges.values():
                for s in [s for s in ranges if s <= done]:
                    del ranges[s]
        times = list(self._step_s.values())
        progress = Progress(
            self.total,
            self.start_step,
            self.done,
            dict(self.last),
            self.loss,
            statistics.median(times) if times else None,
            complete,
            self.failed,
            notices,
        )
        if (
            not complete
            and not self.failed
            and times
            and not self._stall_reported
            and self.done < self.total
            and now - self.last_growth > stall_threshold(times, self.timeout_s)
        ):
            self._stall_reported = True
            progress.stall = self._stall(now, stall_threshold(times, self.timeout_s))
        return progress

    def _read_indexes(self) -> bool:
        d = self.path / "trajectory"
        try:
            names = os.listdir(d)
        except OSError:
            return False
        grew = False
        for name in names:
            m = re.fullmatch(r"rank-(\d{5})\.steps\.jsonl", name)
            if not m:
                continue
            rank = int(m.group(1))
            if rank not in self._index:
                self._index[rank] = _Tail(d / name, self.path)
                self.last.setdefault(rank, self.start_step)
            for e in self._index[rank].read():
                step = _int(e.get("step"))
                if step is None:
                    continue
                grew = True
                self.last[rank] = max(self.last[rank], step)
                off, length = _int(e.get("offset")), _int(e.get("length"))
                if off is not None and length is not None and step > self.done:
                    self._ranges.setdefault(rank, {})[step] = (off, length)
                t = e.get("time")
                if (
                    isinstance(t, dict)
                    and isinstance(t.get("start"), (int, float))
                    and isinstance(t.get("end"), (int, float))
                ):
                    self._step_s[step] = max(
                        self._step_s.get(step, 0.0), float(t["end"]) - float(t["start"])
                    )
        return grew

    def _loss(self, step: int) -> float | None:
        """The loss of one step, from that step's byte range only (the step index says where it is)."""
        values, have = [], set()
        for rank, ranges in self._ranges.items():
            if step not in ranges or (
                self._loss_ranks is not None and rank not in self._loss_ranks
            ):
                continue
            off, length = ranges[step]
            try:  # the step's bytes only, through the one reader of the trajectory format (Run's)
                recs = self.run.records_of_range(rank, off, length, step)
            except (OSError, BadInput):
                continue
            for rec in recs:
                if (
                    rec.get("phase") == "loss"
                    and rec.get("tensor") == "loss"
                    and isinstance(rec.get("sum"), (int, float))
                ):
                    values.append(float(rec["sum"]))
                    have.add(rank)
        if self._loss_ranks is None and values:
            self._loss_ranks = have
        return sum(values) / len(values) if values else self.loss

    def _stall(self, now: float, threshold: float) -> Stall:
        wall = time.time()
        tails = {r: collective_tail(self.run.collectives_path(r)) for r in self.last}
        behind = behind_ranks(self.last, tails)
        states = []
        for r in sorted(self.last):
            last = tails[r].last
            if last is None:
                states.append(RankState(r, self.last[r]))
                continue
            since = wall - last.start if last.start is not None else None
            states.append(RankState(r, self.last[r], last.op, last.seq, last.group, since))
        return Stall(
            now - self.last_growth,
            threshold,
            [s for s in states if s.rank in behind],
            [s for s in states if s.rank not in behind],
        )

    def idle_s(self) -> float:
        """Seconds since anything the job writes last grew (step index, events, collective traces)."""
        size = 0
        for kind in ("trajectory", "collectives"):
            try:
                with os.scandir(self.path / kind) as it:
                    size += sum(e.stat().st_size for e in it if e.is_file())
            except OSError:
                pass
        try:
            size += (self.path / "events.jsonl").stat().st_size
        except OSError:
            pass
        now = self.clock()
        if size != self._activity[1]:
            self._activity = (now, size)
        return now - self._activity[0]
