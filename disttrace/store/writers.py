"""Writing a run store: files replaced atomically, lines appended whole (a full disk named as such), the
run's events, its run.json, a new run directory and the COMPLETE marker written last."""

from __future__ import annotations

import errno
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from disttrace.errors import BadInput
from disttrace.store.documents import RunInfo
from disttrace.store.events import EventLine
from disttrace.store.rundir import COMPLETE, RUN_INFO

_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException | None) -> OSError | None:
    """The out-of-space error (ENOSPC, or a quota's EDQUOT) behind `exc`, if one is: `exc` itself, what it was
    raised from or during, or one rank's error inside torch.distributed.checkpoint's CheckpointException (its
    `failures`, rank -> exception: one rank's full disk surfaces on the coordinating rank inside it). Of
    several, the first that happened and names its file: a writer that fails while the first failure
    unwinds (a trace flushed on the way out) is not what stopped the rank."""
    seen: set[int] = set()
    found: list[OSError] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FULL:
            found.append(e)
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f for f in failures.values() if isinstance(f, BaseException)]
            # a WRAPPED_EXCEPTION is (exception, traceback)
            todo += [f[0] for f in failures.values() if isinstance(f, tuple) and f]
    named = [e for e in found if e.filename]
    return (named or found)[-1] if found else None


@contextmanager
def writing(path: Path | str):
    """Name `path` on an out-of-space error raised inside: a write() or fsync() that fails says errno 28 but
    not which file, and the one line a full disk ends with names the file that was being written."""
    try:
        yield
    except BaseException as e:
        full = disk_full(e)
        if full is None or (full is e and e.filename):
            raise
        raise OSError(full.errno, full.strerror or os.strerror(full.errno), str(path)) from e


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """Write JSON so a reader sees the old file or the new one, never half of one (write_atomic)."""
    data = orjson.dumps(
        obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY
    )
    write_atomic(path, data + b"\n")


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_TMP_TRIES = 16


def write_atomic(path: Path | str, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file or the new one, never half of one, and so that
    nothing a directory's other writer planted is followed: the temporary is created by name inside the
    opened parent directory with O_CREAT|O_EXCL|O_NOFOLLOW (a planted link or file of that name is never
    opened; another random name is tried), and it replaces `path` only when `path` is absent or a regular
    file (a link, device, FIFO or directory there is refused, BadInput, and left as it is). The temporary is
    removed whatever fails (on a full disk too: nothing half-written is left under either name)."""
    path = Path(path)
    with writing(path):
        _write_atomic(path, data)


def _write_atomic(path: Path, data: bytes) -> None:
    import secrets
    import stat

    path.parent.mkdir(parents=True, exist_ok=True)
    dfd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _refuse_unless_regular(path, dfd)
        for _ in range(_TMP_TRIES):
            tmp = f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}"
            try:
                fd = os.open(
                    tmp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                    0o644,
                    dir_fd=dfd,
                )
                break
            except FileExistsError:
                continue
        else:
            raise BadInput(
                path.parent, "cannot create a temporary file there (every name is taken)"
            )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _refuse_unless_regular(path, dfd)  # as late as possible before the rename
            if not stat.S_ISREG(os.stat(tmp, dir_fd=dfd, follow_symlinks=False).st_mode):
                raise BadInput(path.parent / tmp, "the temporary was replaced while it was written")
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise
    finally:
        os.close(dfd)


def _refuse_unless_regular(path: Path, dfd: int) -> None:
    import stat

    try:
        st = os.stat(path.name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "a directory"
            if stat.S_ISDIR(st.st_mode)
            else "a device, FIFO or socket"
        )
        raise BadInput(path, f"is {kind}, not a regular file: refusing to replace it")


def append_line(path: Path | str, obj: Any) -> None:
    """Append one JSON line with a single O_APPEND write (atomic for short lines on a local disk),
    so several ranks may log events to one file without interleaving."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"
    with writing(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # a disk that fills in the middle of the line takes part of it and returns the count: that
            # is a full disk too (the torn line is trimmed by the launcher, trim_torn_tail)
            if os.write(fd, line) < len(line):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        finally:
            os.close(fd)


def trim_torn_tail(path: Path | str) -> bool:
    """Cut a JSON-lines file back to its last whole line (a writer stopped mid-line by a full disk or a
    kill), so a line appended after it is not glued onto the torn one. Only for a file no one else is
    writing (the launcher's, once its ranks are gone). True when something was cut."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | _NOFOLLOW)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        end = size
        while end > 0:
            start = max(0, end - 65536)
            block = os.pread(fd, end - start, start)
            if end == size and block.endswith(b"\n"):
                return False
            cut = block.rfind(b"\n")
            if cut >= 0:
                os.ftruncate(fd, start + cut + 1)
                return True
            end = start
        os.ftruncate(fd, 0)
        return True
    finally:
        os.close(fd)


class JsonlWriter:
    """Appends records to one rank's JSONL file; flushed per step so a crash loses at most a step."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")

    @property
    def offset(self) -> int:
        return self._f.tell()

    @staticmethod
    def encode(obj: Any) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n"

    def write(self, obj: Any) -> int:
        data = self.encode(obj)
        with writing(self.path):
            self._f.write(data)
        return len(data)

    def flush(self) -> None:
        with writing(self.path):
            self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            with writing(self.path):
                try:
                    self._f.flush()
                    os.fsync(self._f.fileno())
                finally:
                    self._f.close()


def event(run_dir: Path | str, line: EventLine, required: bool = False) -> bool:
    """Log one event, built with its kind's model (store/events.py), stamped with the time now. Best
    effort: a full disk must not turn a reported failure into a crash. `required`: the OSError is raised
    instead (a run that cannot log its creation is not started)."""
    line.time = time.time()
    try:
        append_line(Path(run_dir) / "events.jsonl", line.line())
        return True
    except OSError as e:
        if required:
            raise
        import sys

        print(
            f"disttrace: could not log event '{line.event}' in {run_dir}: {e.strerror}",
            file=sys.stderr,
        )
        return False


def write_run_info(run_dir: Path | str, info: RunInfo) -> None:
    """run.json, as the model states it (`RunInfo.doc()`)."""
    write_json_atomic(Path(run_dir) / RUN_INFO, info.doc())


def new_run_dir(root: Path | str, manifest_id: str, path_kind: str) -> Path:
    """runs/<id12>/<path>[-n]: the first run of a path gets the bare name, later ones -2, -3, ..."""
    base = Path(root) / manifest_id[:12]
    base.mkdir(parents=True, exist_ok=True)
    if base.is_symlink():  # run directories are made where the runs root says, never through a link
        raise BadInput(base, "is a symbolic link: a run directory is never created through one")
    n = 1
    while True:
        name = path_kind if n == 1 else f"{path_kind}-{n}"
        try:
            (base / name).mkdir()  # mkdir is the lock: two launchers never share a directory
            return base / name
        except FileExistsError:
            n += 1


def mark_complete(run_dir: Path | str, summary: dict) -> None:
    write_json_atomic(Path(run_dir) / COMPLETE, {"completed": time.time(), **summary})
