"""Shared fixtures. Multi-process runs are slow to start (torch import per rank), so each distinct run is
made once per session and shared; tests only read the run store."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# the gate's evaluation cache (disttrace/gate/evalcache.py): one per test session, not the user's
os.environ.setdefault("DISTTRACE_CACHE_DIR", tempfile.mkdtemp(prefix="disttrace-test-cache-"))
DEFAULT = ROOT / "manifests" / "default.toml"
# four steps, checkpoints at 2 and 4: enough for a fault at 3 and a recovery from 2
SHORT = ["--set", "training.steps=4", "--set", "checkpoint.interval=2"]


def cli(*args, timeout=180, env=None, check=None) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "disttrace", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)
    if check is not None and proc.returncode != check:
        raise AssertionError(f"exit {proc.returncode} != {check}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def last_line(proc) -> Path:
    return Path(proc.stdout.strip().splitlines()[-1])


class Runs:
    """Session cache: one run per distinct command line."""

    def __init__(self, root: Path):
        self.root = root
        self._cache: dict[tuple, Path] = {}

    def get(self, *args, expect=0) -> Path:
        key = tuple(map(str, args))
        if key not in self._cache:
            proc = cli(*args, "--out", self.root, check=expect)
            self._cache[key] = last_line(proc)
        return self._cache[key]

    def reference(self, *sets) -> Path:
        return self.get("run", DEFAULT, *SHORT, *sets)

    def fault(self, name, step, rank, *extra, expect=0) -> Path:
        return self.get("inject", DEFAULT, *SHORT, "--fault", name, "--step", step, "--rank", rank, *extra,
                        expect=expect)


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("runs"))
