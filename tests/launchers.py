"""Launching DeepSpeed's training scripts from the tests (tests/test_deepspeed_engine.py,
tests/test_deepspeed_cross.py): torchrun or DeepSpeed's own launcher, 2 CPU ranks, the run directory the
script prints last.

DeepSpeed builds its shared-memory op (deepspeed_shm_comm) with torch's cpp_extension the first time a rank
initialises, under a lock file in torch's extension folder, with whichever `ninja` comes first on PATH. The
virtual environment holds pip's ninja (1.13, a DeepSpeed dependency), the system another (1.11): each reads
the other's build log as one it cannot use, starts over and compiles the op again (minutes on 2 cores), so
every job here puts the environment's bin first on PATH (`job_env`). A build that is killed (a timeout, ^C)
leaves the lock behind, and every later DeepSpeed job on the machine waits on it forever, under any
launcher: `need_deepspeed` says so instead of starting one.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

BIN = Path(sys.executable).parent
TORCHRUN = shutil.which("torchrun", path=str(BIN)) or "torchrun"
DEEPSPEED = shutil.which("deepspeed", path=str(BIN)) or "deepspeed"
# a lock older than this with nothing building under it is taken for a killed build's (a first build of
# the op takes about 5 minutes on a shared 2-core machine)
STALE_S = 30 * 60


def need_deepspeed(what: str) -> None:
    pytest.importorskip(
        "deepspeed",
        reason="deepspeed could not be installed here (make test installs disttrace[deepspeed]); "
        f"{what} is untested on this machine",
    )
    lock = stale_build_lock()
    if lock is not None:
        pytest.fail(
            f"{lock} is older than {STALE_S // 60} minutes: a killed build of DeepSpeed's op left it, and every "
            "DeepSpeed job on this machine waits on it forever; remove it (no build is running)"
        )


def extensions_dir() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory("deepspeed_shm_comm", verbose=False))


def stale_build_lock() -> Path | None:
    lock = extensions_dir() / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    return lock if age > STALE_S else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(script: str, nproc: int = 2) -> list[str]:
    return [TORCHRUN, "--nproc-per-node", str(nproc), script]


def deepspeed_cmd(script: str, nproc: int = 2) -> list[str]:
    """DeepSpeed's launcher on this host alone (no hostfile: it starts `deepspeed.launcher.launch`, which
    sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT and passes --local_rank=N to the script)."""
    return [DEEPSPEED, "--num_gpus", str(nproc), "--master_port", str(free_port()), script]


def job_env() -> dict[str, str]:
    """The environment of a DeepSpeed job: one thread a rank, and this environment's tools (its ninja) first."""
    path = os.environ.get("PATH", "")
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{BIN}{os.pathsep}{path}" if path else str(BIN),
    }


def launch(cmd: list[str], *args, timeout: int = 900) -> Path:
    """Run a launcher command line to its end; the run directory is the last line the script printed."""
    proc = subprocess.run(
        [*cmd, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=job_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Path(proc.stdout.strip().splitlines()[-1])
