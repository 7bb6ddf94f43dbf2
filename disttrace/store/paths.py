"""Paths read from a run store stay inside the store they came from (no torch here).

run.json's resume checkpoint, a checkpoint directory, a rank file: all are names a run store's writer chose.
Each must resolve (symbolic links followed) inside the runs root it came from, or it is BadInput (exit 2):
a crafted run must not make `recover` or a worker load a checkpoint from anywhere on the machine.
"""

from __future__ import annotations

import re
from pathlib import Path

from disttrace.errors import BadInput
from disttrace.store.documents import ResumeSpec

CHECKPOINT_NAME = re.compile(r"step-\d{6}")


def inside(path: Path | str, root: Path | str) -> bool:
    try:
        Path(path).resolve().relative_to(Path(root).resolve())
        return True
    except (ValueError, OSError, RuntimeError):  # outside, or a symlink loop
        return False


def contained(
    path: Path | str, root: Path | str, where: Path | str, field: str | None = None
) -> Path:
    """`path` resolved, if it lies inside `root`; else BadInput naming `where` (the file that named it)."""
    if not inside(path, root):
        raise BadInput(
            where,
            f"'{path}' resolves outside {Path(root)} (a run store's paths stay inside it)",
            field=field,
        )
    return Path(path).resolve()


def runs_root(run_dir: Path | str) -> Path:
    """runs/<id12>/<path>: the runs root is two levels up."""
    return Path(run_dir).resolve().parent.parent


def resume_checkpoint(run_dir: Path | str, spec: ResumeSpec | dict) -> Path:
    """run.json's `resume.checkpoint` (relative to runs/<id12>/), checked: a step-NNNNNN checkpoint directory of
    a run inside this run's runs root."""
    run_dir = Path(run_dir)
    where = run_dir / "run.json"
    if isinstance(spec, ResumeSpec):
        spec = spec.doc()
    raw = spec.get("checkpoint") if isinstance(spec, dict) else None
    if not isinstance(raw, str) or not raw or "\0" in raw:
        raise BadInput(
            where,
            "must be a path relative to the runs/<id12>/ directory",
            field="resume.checkpoint",
        )
    path = Path(raw)
    if path.is_absolute():
        raise BadInput(
            where,
            f"'{raw}' is absolute; a resume checkpoint is relative to the runs/<id12>/ "
            "directory, inside the runs root",
            field="resume.checkpoint",
        )
    resolved = contained(
        run_dir.parent / path, runs_root(run_dir), where, field="resume.checkpoint"
    )
    if not CHECKPOINT_NAME.fullmatch(resolved.name) or resolved.parent.name != "checkpoints":
        raise BadInput(
            where,
            f"'{raw}' is not a run's checkpoints/step-NNNNNN directory",
            field="resume.checkpoint",
        )
    return resolved
