"""`disttrace run -- CMD ARGS...` and `disttrace inject --fault NAME --step S --rank R -- CMD ARGS...`: run a
user's own training command (e.g. `torchrun --nproc-per-node 2 train.py`) with a prepared run directory.

The directory is handed to the command in DISTTRACE_RUN_DIR; `disttrace.api.attach` inside the script picks
it up (and, for inject, the fault in its run.json, checked there against the points the script offers), or,
in a script that never calls it, zero-code recording does the same from torch's own hooks (run/zerocode/recording.py).
The command's stdout goes to our stderr: our stdout carries only the run directory (or --json).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import orjson

from disttrace.errors import BadInput, JobFailed
from disttrace.store.documents import RunInfo
from disttrace.store.records import Event
from disttrace.store.rundir import COMPLETE, LOCK
from disttrace.store.writers import new_run_dir, write_run_info

RUN_DIR_ENV = "DISTTRACE_RUN_DIR"  # the same name disttrace.run.attach reads


def command_key(command: list[str]) -> str:
    """Runs of one command share a folder (<out>/<key12>/reference, fault, ...), as runs of one manifest do."""
    return hashlib.sha256(orjson.dumps(command)).hexdigest()


def prepare(out: Path, command: list[str], path_kind: str, fault: dict | None = None) -> Path:
    if not command:
        raise BadInput("--", "no command after '--' (e.g. -- torchrun --nproc-per-node 2 train.py)")
    run_dir = new_run_dir(out, command_key(command), path_kind).resolve()
    info = RunInfo(
        path=path_kind,
        fault=fault,
        resume=None,
        created=time.time(),
        pid=os.getpid(),
        command=command,
    )
    write_run_info(run_dir, info)
    return run_dir


def fault_spec(name: str, step: int, rank: int, params: dict) -> dict:
    """What can be checked before the script runs (the name, parameter names and types, step and rank
    bounds); the rest (the hook points, the world size, the tensor) is checked by attach, inside the job."""
    from disttrace.run import faults

    cls = faults.get(name)
    merged = cls.parameters(params)
    cls.coordinates(step, rank)
    return cls.record(step, rank, merged)


def execute(run_dir: Path, command: list[str]) -> None:
    """Run the command attached to `run_dir`: its own attach call, or else zero-code recording (every Python
    process it starts loads run/zerocode/site/sitecustomize.py first). Raises BadInput (exit 2) when the
    script refused the fault or trained nothing that could be recorded, JobFailed (exit 3) when the command
    failed."""
    from disttrace.run.zerocode.recording import SITE_DIR, ZERO_CODE_ENV

    python_path = os.pathsep.join(p for p in (SITE_DIR, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, RUN_DIR_ENV: str(run_dir), ZERO_CODE_ENV: "1", "PYTHONPATH": python_path}
    try:
        proc = subprocess.run(
            command, env=env, stdout=sys.stderr.fileno() if hasattr(sys.stderr, "fileno") else None
        )
    except FileNotFoundError:
        raise BadInput("--", f"command not found: {command[0]}") from None
    events = _events(run_dir)
    refused = [e for e in events if e.get("event") == Event.FAULT_REFUSED]
    if refused:
        e = refused[0]
        raise BadInput(
            e.get("where") or "--fault",
            e.get("reason", "refused by the script"),
            field=e.get("field"),
        )
    if not (run_dir / LOCK).exists():
        if proc.returncode != 0:
            raise JobFailed(
                f"the command exited with {proc.returncode} before attaching", str(run_dir)
            )
        raise BadInput(
            "--",
            "the command trained nothing disttrace could record: no training forward of a module whose "
            "parameters a torch optimizer holds, and no disttrace.api.attach call "
            f"(no {LOCK} in {run_dir})",
        )
    if proc.returncode != 0:
        raise JobFailed(f"the command exited with {proc.returncode}", str(run_dir))
    if not (run_dir / COMPLETE).exists():
        raise JobFailed(
            "the command exited 0 but never closed the attached run (run.close())", str(run_dir)
        )


def _events(run_dir: Path) -> list[dict]:
    from disttrace.store.jsonlines import read_jsonl

    p = run_dir / "events.jsonl"
    return read_jsonl(p).records if p.exists() else []
