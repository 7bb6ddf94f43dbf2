"""Prepare a run directory and start the world on torch's elastic launcher (the agent `torchrun` uses).

One agent per node starts `python -m disttrace.worker --run-dir DIR` once per local rank. We do not use the
agent's own restarts (unreliable on gloo, docs/design.md, "Facts"): recovery is a new job from a checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time
import uuid
from pathlib import Path

from disttrace.config.freezing import Frozen, parse_lock, validate
from disttrace.errors import JobFailed
from disttrace.run.job.worker import LOG_ENV, release_space, reserve_space
from disttrace.store.documents import RunInfo
from disttrace.store.events import Created, Launched, RankFailed
from disttrace.store.events import JobFailed as JobFailedEvent
from disttrace.store.jsonlines import read_json
from disttrace.store.rundir import COMPLETE, LOCK, RUN_INFO, read_run_info
from disttrace.store.writers import event, new_run_dir, write_json_atomic, write_run_info, writing


def prepare(
    frozen: Frozen,
    out: Path,
    path_kind: str,
    fault: dict | None = None,
    resume: dict | None = None,
    origin: dict | None = None,
    name: str | None = None,
    extra: dict | None = None,
    folder: str | None = None,
) -> Path:
    """Create runs/<id12>/<name or path>[-n]/ with the lock written first, then run.json (with `extra`'s
    keys beside the path's own). `folder`: another manifest id whose runs/<id12>/ holds it (a replay
    recording at depth lives beside the run it replays)."""
    run_dir = new_run_dir(out, folder or frozen.manifest_id, name or path_kind)
    try:
        write_json_atomic(run_dir / LOCK, frozen.model_dump())
        info = RunInfo(
            path=path_kind,
            fault=fault,
            resume=resume,
            origin=origin,
            created=time.time(),
            argv=sys.argv,
            **(extra or {}),
        )
        write_run_info(run_dir, info)
        event(run_dir, Created(path=path_kind), required=True)
    except BaseException:
        # a directory this command made and could not finish (a full disk): no rank ran in it, so it is
        # removed rather than left as a run without its run.json or events
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir


def prepare_shared(frozen: Frozen, out: Path, path_kind: str, run_id: str) -> Path:
    """Multi-node: every node's launcher names the same directory (<path>-<run_id>), so the per-rank files of
    all nodes land in one run dir on a shared filesystem (on separate disks, copy each node's rank files into
    one directory: they never collide, one file per global rank)."""
    run_dir = Path(out) / frozen.manifest_id[:12] / f"{path_kind}-{run_id}"
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / LOCK).exists():
        write_json_atomic(run_dir / LOCK, frozen.model_dump())
    elif Frozen.model_validate(read_json(run_dir / LOCK)).manifest_id != frozen.manifest_id:
        from disttrace.errors import BadInput

        raise BadInput(
            run_dir / LOCK, "this run id already holds another manifest", field="manifest_id"
        )
    if not (run_dir / RUN_INFO).exists():
        write_run_info(
            run_dir,
            RunInfo(
                path=path_kind,
                fault=None,
                resume=None,
                origin=None,
                created=time.time(),
                run_id=run_id,
            ),
        )
    event(run_dir, Created(path=path_kind, pid=os.getpid()))
    return run_dir


def _writer_lock(run_dir: Path, node_rank: int):
    """One launcher per node per run directory: a second would interleave its records with the first's."""
    import fcntl

    from disttrace.errors import BadInput

    path = run_dir / f".launcher-node{node_rank}.lock"
    with writing(path):
        f = open(path, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise BadInput(
            run_dir, f"another launcher (node {node_rank}) is writing this run directory"
        ) from None
    with writing(path):
        f.write(str(os.getpid()))
        f.flush()
    # space set aside for what the launcher writes when the job fails (the failure event), given back
    # before it writes it: on a disk the ranks filled, that line is still written
    reserve_space(f.fileno())
    return f


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    run_dir: Path,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    nproc_per_node: int | None = None,
    quiet: bool = True,
) -> None:
    """Run the job to the end. Raises JobFailed (exit 3) when a rank fails or the run is not complete."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    manifest = validate(
        parse_lock(run_dir / LOCK).manifest, run_dir / LOCK
    )  # as each rank will (worker.run)
    world = manifest.world_size
    if (run_dir / COMPLETE).exists():
        from disttrace.errors import BadInput

        raise BadInput(
            run_dir, "this run is already complete: a new job would mix its records into it"
        )
    info = read_run_info(run_dir) if (run_dir / RUN_INFO).exists() else RunInfo()
    if info.resume:  # exit 2 here, before any rank starts
        from disttrace.store.paths import resume_checkpoint

        resume_checkpoint(run_dir, info.resume)
    lock = _writer_lock(run_dir, node_rank)  # held until this process exits
    if nproc_per_node is None:
        if world % nnodes:
            raise JobFailed(
                f"world size {world} is not divisible by --nnodes {nnodes}", str(run_dir)
            )
        nproc_per_node = world // nnodes
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by every rank
    if quiet:
        # a failed job is reported in one line (ours); the agent's own error lines would repeat it, and
        # the ranks' tracebacks are in their logs
        # (torch gives each of its modules' loggers a level of its own: the parent's is not enough)
        for name in [*logging.root.manager.loggerDict, "torch.distributed.elastic"]:
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    endpoint = rdzv_endpoint or f"127.0.0.1:{free_port()}"
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        run_id=f"disttrace-{run_dir.parent.name}-{run_dir.name}"
        if nnodes > 1
        else uuid.uuid4().hex,
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        event(
            run_dir,
            Launched(
                nnodes=nnodes, node_rank=node_rank, nproc_per_node=nproc_per_node, endpoint=endpoint
            ),
            required=True,
        )
        # each rank writes its stdout and stderr to its log in the run (inherited by the ranks only: a
        # user's command this process runs later keeps its terminal)
        before, os.environ[LOG_ENV] = os.environ.get(LOG_ENV), "1"
        try:
            elastic_launch(config, sys.executable)(
                "-m", "disttrace.worker", "--run-dir", str(run_dir)
            )
        finally:
            if before is None:
                del os.environ[LOG_ENV]
            else:
                os.environ[LOG_ENV] = before
    except ChildFailedError as e:
        failures = {int(r): f.exitcode for r, f in e.failures.items()}
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp)
        notes = failure_notes(run_dir, failures)
        full = disk_full_note(notes, [r for r, _ in sorted(e.failures.items(), key=_when)])
        reason = full or describe_failure(run_dir, failures, first[0], notes.get(first[0]))
        tidy_after_failure(run_dir, lock)
        event(
            run_dir,
            JobFailedEvent(
                failures={str(k): v for k, v in failures.items()},
                first_failed_rank=int(first[0]),
                reason=reason,
            ),
        )
        bad = refused_input(run_dir, failures)
        if (
            bad is not None
        ):  # a rank refused its input (exit 2): the same one line, the same exit code
            raise bad from None
        raise JobFailed(reason, str(run_dir)) from None
    except Exception as e:  # a signal to the launcher, rendezvous errors and the like
        reason = stopped_reason(e)
        tidy_after_failure(run_dir, lock)
        event(run_dir, JobFailedEvent(reason=reason))
        raise JobFailed(reason, str(run_dir)) from None
    for _ in range(
        50
    ):  # on a multi-node job, global rank 0 may live on another node: give it a moment
        if (run_dir / COMPLETE).exists() or nnodes == 1:
            break
        time.sleep(0.1)
    if not (run_dir / COMPLETE).exists():
        tidy_after_failure(run_dir, lock)
        event(run_dir, JobFailedEvent(reason="every rank exited 0 but COMPLETE was not written"))
        raise JobFailed("every rank exited 0 but the run was not marked complete", str(run_dir))
    release_space(lock.fileno())
    lock.close()


def _when(kv) -> float:
    return kv[1].timestamp


def stopped_reason(e: Exception) -> str:
    """One line for a launch that ended other than by a rank's failure: a signal to the launcher (torch's
    agent stops its ranks, then raises SignalException), or the launch itself failing. A full disk while the
    launcher writes its own files is named as the ranks' is."""
    import signal

    from disttrace.store.writers import disk_full

    sigval = getattr(e, "sigval", None)
    if sigval is not None:
        try:
            name = signal.Signals(sigval).name
        except ValueError:
            name = f"signal {int(sigval)}"
        return f"stopped by {name}: the launcher stopped its ranks; the run is incomplete"
    full = disk_full(e)
    if full is not None:
        return f"{(full.strerror or 'no space left on device').lower()}: writing {full.filename}"
    return f"launch failed: {type(e).__name__}: {e}"


def failure_notes(run_dir: Path, failures: dict[int, int]) -> dict[int, dict]:
    """Each failed rank's own last word (worker.FAILURE_NOTE, the last such line of its log), by launch
    slot; a rank killed before it could say anything, or whose log is on another node's disk, has none."""
    import json

    from disttrace.run.job.worker import FAILURE_NOTE, log_path

    notes = {}
    for slot in failures:
        path = log_path(run_dir, slot)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            continue
        for line in reversed(tail.splitlines()):
            if line.startswith(FAILURE_NOTE):
                try:
                    note = json.loads(line[len(FAILURE_NOTE) :])
                except ValueError:
                    break
                if isinstance(note, dict):
                    notes[slot] = {**note, "log": str(path)}
                break
    return notes


def disk_full_note(notes: dict[int, dict], order: list) -> str | None:
    """The line for a job that failed because its disk was full: the first rank (in the order they failed)
    that found it so, the file it was writing, and where its traceback is."""
    for slot in order:
        note = notes.get(int(slot))
        if note and note.get("disk_full"):
            what = str(note["disk_full"]).lower()
            return (
                f"{what}: rank {int(slot)} was writing {note.get('path')}; the run is incomplete "
                f"(traceback: {note['log']})"
            )
    return None


def tidy_after_failure(run_dir: Path, lock) -> None:
    """After a failed job, before its failure is logged: give back the space the launcher set aside, remove
    what its writers left half done (a checkpoint never published, `.NAME.tmp-*` files of atomic writes cut
    short: a rank killed mid-write leaves them) and cut a torn last line off events.jsonl (a line appended
    after it would be glued to it). Published files, and every other run, are left as they are."""
    import shutil

    from disttrace.run.job.worker import release_space
    from disttrace.store.writers import trim_torn_tail

    release_space(lock.fileno())
    for log in (run_dir / "logs").glob(
        "stderr-*.log"
    ):  # a rank killed keeps its reserve: give it back
        try:
            fd = os.open(log, os.O_WRONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            release_space(fd)
        finally:
            os.close(fd)
    for partial in (run_dir / "checkpoints").glob("step-*.partial"):
        if partial.is_dir() and not partial.is_symlink():
            shutil.rmtree(partial, ignore_errors=True)
    for tmp in run_dir.rglob(".*.tmp-*"):
        if tmp.is_file() or tmp.is_symlink():
            tmp.unlink(missing_ok=True)
    trim_torn_tail(run_dir / "events.jsonl")


def refused_input(run_dir: Path, failures: dict[int, int]):
    """The BadInput a rank that exited with code 2 recorded (its rank_failed event's `bad_input`), or None."""
    from disttrace.errors import EXIT_BAD_INPUT, BadInput

    bad_ranks = {r for r, c in failures.items() if c == EXIT_BAD_INPUT}
    if not bad_ranks:
        return None
    try:
        events = job_events(run_dir)
    except BadInput:
        return None
    for e in events:
        if isinstance(e, RankFailed) and e.rank in bad_ranks and e.bad_input is not None:
            bad = e.bad_input
            return BadInput(str(bad.where), str(bad.reason), bad.field)
    return None


def job_events(run_dir: Path) -> list:
    """events.jsonl of the job this launcher ran, each line its kind's model."""
    from disttrace.store.events import parse_event
    from disttrace.store.jsonlines import read_jsonl

    p = run_dir / "events.jsonl"
    return [parse_event(e, p, n) for n, e in enumerate(read_jsonl(p, run_dir).records, 1)]


def describe_failure(
    run_dir: Path, failures: dict[int, int], first: int, note: dict | None = None
) -> str:
    """One line: which rank failed first and how, plus the first collective desync if the trace shows one."""
    from disttrace.analysis.sync import check_sync
    from disttrace.store.rundir import Run

    killed = {r: c for r, c in failures.items() if c is not None and c < 0}
    what = (
        f"rank {first} was killed by signal {-failures[first]}"
        if first in killed
        else f"rank {first} exited with code {failures[first]}"
    )
    parts = [f"the job failed: {what} (failed ranks: {sorted(failures)})"]
    try:  # the first error a rank recorded about itself, in one line
        errors = [e for e in job_events(run_dir) if isinstance(e, RankFailed)]
        own = [e for e in errors if e.rank == first] or errors
        if own:
            raw = str(own[0].error or "")
            # an engine's error may carry a whole remote traceback: its last exception line says what happened
            causes = [
                ln.strip()
                for ln in raw.splitlines()
                if re.match(r"^[\w.]+(Error|Exception|Exit)\b.*:", ln.strip())
            ]
            text = " ".join((causes[-1] if causes else raw).split())
            parts.append(f"rank {own[0].rank}: {text[:300]}")
    except Exception:  # evidence for the message, not a requirement
        pass
    try:
        mismatch = check_sync(Run(run_dir)).first_mismatch
        if mismatch:
            parts.append(mismatch.message)
    except Exception:  # the trace is evidence, not a requirement for reporting the failure
        pass
    if note and note.get("log"):
        parts.append(f"traceback: {note['log']}")
    return "; ".join(parts)
