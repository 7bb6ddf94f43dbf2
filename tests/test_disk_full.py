"""A full disk at the writers, on a real (tiny) tmpfs: the error names the file being written, nothing
half-written is left under the final name or as a temporary, and the CLI says it in one line (exit 3).
The end-to-end run on a full disk is in test_machine_faults.py (slow)."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
from conftest import DEFAULT, cli

from disttrace.store.writers import (
    JsonlWriter,
    append_line,
    disk_full,
    trim_torn_tail,
    write_atomic,
)

FULL = os.strerror(errno.ENOSPC)


@pytest.fixture
def tiny(tmp_path):
    """A 64 KiB tmpfs, filled but for `room` bytes by the test (`fill`)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(mnt: Path) -> None:
    fd = os.open(mnt / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    assert os.statvfs(mnt).f_bavail == 0


def test_an_atomic_write_on_a_full_disk_names_the_file_and_keeps_the_old_one(tiny):
    target = tiny / "run.json"
    target.write_bytes(b'{"old": true}\n')
    with pytest.raises(OSError) as e:
        write_atomic(target, b"x" * (128 << 10))  # twice the disk
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)
    assert target.read_bytes() == b'{"old": true}\n'
    assert sorted(p.name for p in tiny.iterdir()) == ["run.json"]  # no temporary left


def test_an_appended_line_and_a_stream_on_a_full_disk_name_their_file(tiny):
    events = tiny / "events.jsonl"
    append_line(events, {"event": "created"})
    stream = JsonlWriter(tiny / "steps" / "rank-00000.jsonl")
    fill(tiny)
    with pytest.raises(OSError) as e:
        append_line(events, {"event": "x" * 8192})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(events)
    with pytest.raises(OSError) as e:
        stream.write({"step": 1, "pad": "y" * 65536})
        stream.close()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(stream.path)
    # a line cut by the full disk is trimmed back to the last whole one before anything else is appended
    (tiny / "filler").unlink()
    with open(events, "ab") as f:
        f.write(b'{"event": "to')
    assert trim_torn_tail(events)
    assert events.read_bytes() == b'{"event":"created"}\n'
    assert not trim_torn_tail(events)


def test_a_full_disk_is_found_inside_a_checkpoint_exception():
    class CheckpointException(Exception):  # torch's shape: rank -> (exception, traceback)
        def __init__(self, failures):
            super().__init__("CheckpointException")
            self.failures = failures

    inner = OSError(errno.ENOSPC, FULL)
    assert disk_full(CheckpointException({1: (inner, None)})) is inner
    assert disk_full(CheckpointException({1: (ValueError("x"), None)})) is None
    try:  # the first failure that names its file wins over one raised while it unwinds
        try:
            raise OSError(errno.ENOSPC, FULL, "/run/checkpoints/step-000002.partial")
        except OSError:
            raise OSError(errno.ENOSPC, FULL) from None
    except OSError as late:
        assert disk_full(late).filename == "/run/checkpoints/step-000002.partial"


def test_the_cli_says_a_full_disk_in_one_line_exit_3(tiny):
    fill(tiny)
    lock = tiny / "lock.json"
    proc = cli("freeze", DEFAULT, "-o", lock)
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len([ln for ln in lines if FULL in ln]) == 1 and "Traceback" not in proc.stderr
    assert str(lock) in lines[-1] and FULL in lines[-1]
    assert sorted(p.name for p in tiny.iterdir()) == [
        "filler"
    ]  # nothing half-written, no temporary


def test_a_rank_stopped_by_a_full_disk_is_said_once_by_the_launcher_not_per_rank():
    """The event line says the disk was full as a field (not by matching the error's words): live progress
    leaves each such rank's line out when the launcher will say it once, and shows any other failure."""
    import io

    from rich.console import Console

    from disttrace.store.events import RankFailed
    from disttrace.store.follow import Progress, _notice
    from disttrace.views.progress import Display

    full = _notice(RankFailed(rank=1, error="OSError: quota", disk_full=True).line())
    other = _notice(RankFailed(rank=0, error="RuntimeError: No space left on device?").line())
    assert full.disk_full and not other.disk_full  # the field decides, not the words
    out = io.StringIO()
    display = Display(Console(file=out, width=200), plain=True, show_job_failed=False)
    display.update(Progress(2, 0, 0, {}, None, None, False, True, notices=[full, other]))
    assert "rank 0 failed" in out.getvalue() and "rank 1 failed" not in out.getvalue()
