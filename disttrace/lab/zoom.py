"""`disttrace zoom A B` and `diff --zoom`: diff finds the first divergent step, both sides' step is recorded at
depth, and analysis/zoom.py names the first module (and op) inside it whose output differs (docs/zoom.md).

Where the depth records come from is one function, `deep_run`: today each side's frozen manifest is run
again from its start, with `record.depth` set and stopping after the step (harness runs are deterministic
from their manifest: tests/test_foundation.py holds two runs bit-identical, and tests/test_zoom.py a re-run
with depth recording against the stored run). A re-run is kept beside the run it re-runs (its own manifest
id: record.depth is part of the manifest) and reused by the next zoom of the same step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import orjson

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.zoom import DEPTHS, ZoomResult, refuse_op_across, zoom_result
from disttrace.errors import BadInput, JobFailed
from disttrace.store.depth import find_depth_run, origin
from disttrace.store.rundir import LOCK, Run, read_json, write_json_atomic

PRODUCED_BY = "rerun"


def _quiet(msg: str) -> None:
    pass


def _e(v) -> str:
    """Progress lines are rich markup; paths in them print as they are."""
    from disttrace.lab.method import _e as escape

    return escape(v)


def depth_frozen(run: Run, step: int, level: str):
    """`run`'s frozen manifest with record.depth = {step, level}, validated and given its own id."""
    from disttrace.config.manifest import Frozen, canonical_json, validate

    if run.attached:
        raise BadInput(
            run.path / LOCK,
            "zoom re-runs the harness's own runs; an attached script's run is replayed by its own "
            "command (disttrace replay RUN -- CMD)",
            field="source",
        )
    doc = orjson.loads(orjson.dumps(run.manifest_doc))
    record = doc.setdefault("record", {})
    if not isinstance(record, dict):
        raise BadInput(run.path / LOCK, "must be a table", field="manifest.record")
    record["depth"] = {"step": step, "level": level}
    m = validate(doc, run.path / LOCK)
    if step > m.training.steps:
        raise BadInput("--step", f"step {step} is past the run's last step ({m.training.steps})")
    canonical = orjson.loads(canonical_json(m.model_dump(mode="json")))
    lock = run.lock
    return Frozen(
        manifest=canonical,
        manifest_id=hashlib.sha256(canonical_json(canonical)).hexdigest(),
        source=str(lock.get("source") or run.path / LOCK),
        overrides=[
            *[str(o) for o in lock.get("overrides") or []],
            f"record.depth={{step = {step}, level = '{level}'}}",
        ],
        resolved=lock.get("resolved") or {},
    )


def deep_run(run_dir: Path, step: int, level: str, progress: Callable = _quiet) -> Path:
    """A complete run of `run_dir`'s computation whose `step` is recorded at depth `level`: re-run from the
    start with record.depth set, stopping after `step` (reused when one exists)."""
    from disttrace.gate.evaluate import verified_data
    from disttrace.run.launch import launch, prepare

    run = Run(run_dir)
    info = run.info
    if info.get("resume"):
        raise BadInput(
            run.path / "run.json",
            "a recovered run resumes from a checkpoint; re-running it from its start would not be the "
            "same computation (zoom into it with a replay from that checkpoint)",
            field="resume",
        )
    if not run.complete:
        progress(f"[yellow]{_e(run.path)} is incomplete: its re-run may stop where it did[/yellow]")
    frozen = depth_frozen(run, step, level)
    data_path, tok_path = verified_data(run)
    frozen.resolved = {"data_path": data_path, "tokenizer_path": tok_path}
    found = find_depth_run(run, step, level, frozen.manifest_id)
    if found is not None:
        progress(f"depth records of {_e(run.path.name)} step {step}: reusing {_e(found.path)}")
        return found.path
    kind = info.get("path") or "reference"
    root = run.path.parent.parent
    run_dir = prepare(
        frozen, root, kind, fault=info.get("fault"), origin=origin(run.path, step, level)
    )
    extra = {"stop_after": step}
    if info.get("perturb"):
        extra["perturb"] = info["perturb"]
    write_json_atomic(run_dir / "run.json", {**read_json(run_dir / "run.json"), **extra})
    progress(
        f"depth records of {_e(run.path.name)} step {step} ({level}): re-running into {_e(run_dir)}"
    )
    try:
        launch(run_dir)
    except JobFailed as e:
        raise JobFailed(f"the depth re-run of {run.path} failed: {e}", str(run_dir)) from None
    return run_dir


def zoom(
    run_a: Path,
    run_b: Path,
    *,
    depth: str = "module",
    step: int | None = None,
    mode: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    progress: Callable = _quiet,
    diff=None,
    **diff_options,
) -> ZoomResult:
    """diff A B (or the `diff` result given), then both sides' first divergent step (or `step`) at depth."""
    if depth not in DEPTHS:
        raise BadInput("--depth", f"'{depth}' is not module or op")
    if diff is None:
        diff = diff_runs(run_a, run_b, mode=mode, rtol=rtol, atol=atol, **diff_options)
    if step is None and diff.first_divergence is not None:
        step = diff.first_divergence.step
    if step is None:
        return zoom_result(diff, None, depth, None)
    refuse_op_across(diff, depth)
    deep_a = deep_run(Path(run_a), step, depth, progress)
    deep_b = deep_run(Path(run_b), step, depth, progress)
    return zoom_result(
        diff, step, depth, (Run(deep_a), Run(deep_b), PRODUCED_BY), rtol=rtol, atol=atol
    )


def stored_zoom(diff, run_a: Path, run_b: Path) -> ZoomResult | None:
    """The zoom of a divergent `diff` from depth runs a `zoom` already made (op depth first), launching
    nothing: what the HTML report shows. None when there are none."""
    f = diff.first_divergence
    if f is None:
        return None
    runs = (Run(run_a), Run(run_b))
    for level in ("op", "module") if diff.topology.same else ("module",):
        try:
            a, b = (
                find_depth_run(r, f.step, level, depth_frozen(r, f.step, level).manifest_id)
                for r in runs
            )
        except BadInput:  # an attached run, or a lock the harness would not run: no depth run of it
            return None
        if a is not None and b is not None:
            return zoom_result(diff, f.step, level, (a, b, PRODUCED_BY))
    return None
