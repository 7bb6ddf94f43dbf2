"""The one way a reader opens a file of a run store (docs/design.md, "Trust"). No torch.

A run store may come from someone else, whose writer controls every byte and every name in it. So a reader
never calls `open` or `Path.read_bytes` on a store's path itself; it asks this module, which:

- follows a link only while it stays inside the store (`root`): `events.jsonl` linked to `/etc/passwd`, a
  checkpoint directory linked to another run, a lock linked to `/dev/zero` are refused, named;
- opens non-blocking and takes only a regular file (a FIFO in place of the lock would otherwise block the
  reader forever; a device, a socket or a directory is refused the same way);
- caps the size per kind of file before reading anything (`LIMITS`): a JSON document, a JSON line, one step
  of the trajectory, a pickle; a file larger than its kind allows (an 8 GB sparse lock) is refused, never
  read into memory. Large files (the trajectory, a checkpoint's data) are mapped or streamed, not read.

A refusal is BadInput (exit 2), naming the file; `disttrace verify` reports it as damage (exit 1).
Names a store's own files give (a seal's entry, an INDEX key) are checked by `store_name`: a relative name
inside the store, never a path of the machine.
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from disttrace.errors import BadInput

MiB = 1 << 20
# the most bytes a reader takes from one file of each kind: far above what a job of ours writes (a lock is
# a few KiB, an index line ~300 bytes, a step ~70 bytes a record), and bounded, so a crafted size is refused
# before it is allocated
LIMITS = {
    "json": 64 * MiB,  # lock, run.json, env, topology, replicas, COMPLETE, INDEX, eval, verdict
    "line": 4 * MiB,  # one line of a JSON-lines file
    "jsonl": 1024
    * MiB,  # a JSON-lines file read whole into a list (the step index: ~300 bytes a step)
    "events": 256 * MiB,  # events.jsonl (a few lines per checkpoint, fault and failure)
    "step": 256 * MiB,  # one step's bytes of a trajectory (its byte range in the step index)
    "metadata": 256 * MiB,  # a DCP .metadata pickle
    "item": 4096 * MiB,  # one item of a checkpoint's .distcp file, scanned as a pickle
}


def _is_inside(real: str, root_real: str) -> bool:
    return real == root_real or real.startswith(root_real.rstrip(os.sep) + os.sep)


def _real(path: str) -> str:
    try:
        return os.path.realpath(path, strict=False)
    except (OSError, RuntimeError, ValueError):  # a link loop
        return ""


def confined(path: Path | str, root: Path | str | None) -> str:
    """`path` with its links resolved, if that stays inside `root` (None: a path the user gave, not a store's:
    links followed as they are). BadInput naming `path` otherwise."""
    path = os.fspath(path)
    if "\0" in path:
        raise BadInput(path, "a name with a NUL byte")
    real = _real(path)
    if not real:
        raise BadInput(path, "a link loop")
    if root is not None and not _is_inside(real, _real(os.fspath(root))):
        raise BadInput(path, f"links outside the run store {root} (a store's files stay inside it)")
    return real


def open_fd(path: Path | str, root: Path | str | None, limit: int | None = None) -> int:
    """A read-only descriptor of the regular file `path` (confined to `root`), at most `limit` bytes long."""
    real = confined(path, root)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(real, flags)
    except FileNotFoundError:
        raise BadInput(path, "file not found") from None
    except OSError as e:  # a link swapped in after the check (ELOOP), a directory, no permission
        raise BadInput(path, f"cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(path, f"not a regular file (a {_kind(st.st_mode)}); refused unread")
        if limit is not None and st.st_size > limit:
            raise BadInput(
                path,
                f"{st.st_size} bytes, more than the {limit} bytes a file of its kind may hold; "
                "refused unread",
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return name
    return "special file"


def open_file(path: Path | str, root: Path | str | None, limit: int | None = None):
    """A binary file object for reading, as `open_fd` checks it."""
    return os.fdopen(open_fd(path, root, limit), "rb")


def read_bytes(path: Path | str, root: Path | str | None, kind: str = "json") -> bytes:
    """The whole file, if it is no larger than its kind allows (checked again while reading: a file that
    grows while it is read is still cut at the limit)."""
    limit = LIMITS[kind]
    with open_file(path, root, limit) as f:
        # as many bytes as the file holds, not the limit: read(n) allocates n bytes first (64 MiB for every
        # small JSON document, which tracemalloc then counts as the reader's peak); what it grew by since is
        # read too, up to the limit
        size = min(os.fstat(f.fileno()).st_size, limit)
        data = f.read(size + 1)
        if len(data) > size:
            data += f.read(limit + 1 - len(data))
    if len(data) > limit:
        raise BadInput(path, f"more than the {limit} bytes a file of its kind may hold")
    return data


def read_range(path: Path | str, root: Path | str | None, offset: int, length: int) -> bytes:
    """`length` bytes from `offset` (one step of a trajectory), at most LIMITS['step']."""
    if length > LIMITS["step"]:
        raise BadInput(
            path, f"a step of {length} bytes, more than the {LIMITS['step']} a step may hold"
        )
    with open_file(path, root) as f:
        f.seek(offset)
        return f.read(length)


def lines(path: Path | str, root: Path | str | None) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of a JSON-lines file, streamed; a line longer than LIMITS['line'] is refused."""
    limit = LIMITS["line"]
    with open_file(path, root) as f:
        n = 0
        while True:
            raw = f.readline(limit + 1)
            if not raw:
                return
            n += 1
            if len(raw) > limit:
                raise BadInput(path, f"line {n} is longer than the {limit} bytes a line may hold")
            yield n, raw


def mapped(path: Path | str, root: Path | str | None):
    """The file mapped read-only (bytes-like, sliceable; pages come from the file and are dropped under memory
    pressure, so a large trajectory is not read into memory). b'' for an empty file."""
    fd = open_fd(path, root)
    try:
        if os.fstat(fd).st_size == 0:
            return b""
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)


def size(path: Path | str, root: Path | str | None) -> int:
    fd = open_fd(path, root)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def is_regular(path: Path | str, root: Path | str | None) -> bool:
    """Whether `path` is a regular file inside `root` (links resolved), without opening it."""
    try:
        real = confined(path, root)
        return stat.S_ISREG(os.stat(real).st_mode)
    except (BadInput, OSError):
        return False


def present(path: Path | str) -> bool:
    """Whether something (a file, a link, a FIFO) is there: a reader then opens it through this module,
    which says what is wrong with it, instead of passing it over as absent."""
    return os.path.lexists(path)


def store_name(name: object) -> bool:
    """A name a store gives for one of its files (a seal's entry, `dir/rank-00000.jsonl`): relative, every
    part a plain name (no '', '.', '..', NUL or backslash), so it names a place inside the store."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\0" in name:
        return False
    return all(p not in ("", ".", "..") and "\\" not in p for p in name.split("/"))
