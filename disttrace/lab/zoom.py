"""`disttrace zoom A B` and `diff --zoom`: diff finds the first divergent step, both sides' step is recorded at
depth, and analysis/zoom.py names the first module (and op) inside it whose output differs (docs/zoom.md).

Where the depth records come from is one function, `deep_run`: a harness run's frozen manifest is run
again from its start, with `record.depth` set and stopping after the step (harness runs are deterministic
from their manifest: tests/test_foundation.py holds two runs bit-identical, and tests/test_zoom.py a re-run
with depth recording against the stored run). A re-run is kept beside the run it re-runs (its own manifest
id: record.depth is part of the manifest) and reused by the next zoom of the same step.

An attached script's run is never re-run from its store (a store's command is never run): its depth records
come from a replay of it with its own command (`disttrace replay RUN --step S --depth LEVEL -- CMD`, or the
command given to `zoom A B -- CMD`), which must reproduce the run's stored steps bit for bit through S, or
its records would describe another computation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import orjson

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.zoom import (
    DEPTHS,
    ZoomResult,
    refuse_attached_split,
    refuse_op_across,
    zoom_result,
)
from disttrace.errors import BadInput, JobFailed
from disttrace.store.depth import find_depth_run, origin
from disttrace.store.rundir import LOCK, Run, read_run_info
from disttrace.store.writers import write_run_info
from disttrace.views.lab import markup_safe

PRODUCED_BY = "rerun"
REPLAYED = "replay"  # an attached script's side: a replay of it with its own command


def _quiet(msg: str) -> None:
    pass


def depth_frozen(run: Run, step: int, level: str):
    """`run`'s frozen manifest with record.depth = {step, level}, validated and given its own id."""
    from disttrace.config.freezing import Frozen, canonical_json, validate

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


def attached_deep_run(
    run: Run, step: int, level: str, command: list[str] | None, progress: Callable = _quiet
) -> Path:
    """An attached run's step at depth: the newest replay of it at that step and level that reproduces its
    stored steps (reused), else a new one with `command` (the script's own), else BadInput saying how."""
    from disttrace.store.depth import depth_replays

    for r in depth_replays(run, step, level):
        why = not_reproduced(run, r, step)
        if why is None:
            progress(
                f"depth records of {markup_safe(run.path.name)} step {step}: reusing {markup_safe(r.path)}"
            )
            return r.path
        progress(f"[yellow]{markup_safe(r.path)} is not used: {markup_safe(why)}[/yellow]")
    if not command:
        raise BadInput(
            run.path,
            f"an attached script's run: record its step {step} at depth with its own command "
            f"(disttrace replay {run.path} --step {step} --depth {level} -- CMD), or give the command "
            "after '--' (disttrace zoom A B -- CMD, for one attached side)",
        )
    from disttrace.lab.replay import prepare_attached_replay
    from disttrace.run.job import usercmd

    replay_dir = prepare_attached_replay(run.path, step, command, depth=level)
    progress(
        f"depth records of {markup_safe(run.path.name)} step {step} ({level}): running "
        f"{markup_safe(' '.join(command))} into {markup_safe(replay_dir)}"
    )
    try:
        usercmd.execute(replay_dir, command)
    except JobFailed as e:
        raise JobFailed(f"the depth replay of {run.path} failed: {e}", str(replay_dir)) from None
    why = not_reproduced(run, Run(replay_dir), step)
    if why is not None:
        raise JobFailed(f"the depth replay of {run.path} is not usable: {why}", str(replay_dir))
    return replay_dir


def not_reproduced(run: Run, replay: Run, step: int) -> str | None:
    """Why `replay`'s depth records do not describe `run`'s step: a replayed step through `step` that does
    not reproduce the stored one (analysis/attribution.py's record-for-record check), or no depth records of
    the step; None when they do."""
    from disttrace.analysis.attribution import first_difference
    from disttrace.store.depth import read_depth

    start = replay.run_info.resume.step if replay.run_info.resume else 0
    if start >= step:
        return f"it resumed from step {start}, not before step {step}"
    for s in range(start + 1, step + 1):
        d = first_difference(run, replay, s)
        if d is not None:
            return f"replayed step {s} does not reproduce the stored one, first at {d.line()}"
    if not any(r.step == step for recs in read_depth(replay).by_rank.values() for r in recs):
        return f"it holds no depth records of step {step} (did the script attach to it?)"
    return None


def deep_run(
    run_dir: Path,
    step: int,
    level: str,
    progress: Callable = _quiet,
    command: list[str] | None = None,
) -> Path:
    """A complete run of `run_dir`'s computation whose `step` is recorded at depth `level`: re-run from the
    start with record.depth set, stopping after `step` (reused when one exists); an attached script's run,
    replayed with its own `command` (attached_deep_run)."""
    from disttrace.config.freezing import verified_data
    from disttrace.run.job.launch import launch, prepare

    run = Run(run_dir)
    if run.attached:
        return attached_deep_run(run, step, level, command, progress)
    info = run.run_info
    if info.resume:
        raise BadInput(
            run.path / "run.json",
            "a recovered run resumes from a checkpoint; re-running it from its start would not be the "
            "same computation (zoom into it with a replay from that checkpoint)",
            field="resume",
        )
    if not run.complete:
        progress(
            f"[yellow]{markup_safe(run.path)} is incomplete: its re-run may stop where it did[/yellow]"
        )
    frozen = depth_frozen(run, step, level)
    data_path, tok_path = verified_data(run)
    frozen.resolved = {"data_path": data_path, "tokenizer_path": tok_path}
    found = find_depth_run(run, step, level, frozen.manifest_id)
    if found is not None:
        progress(
            f"depth records of {markup_safe(run.path.name)} step {step}: reusing {markup_safe(found.path)}"
        )
        return found.path
    kind = info.path or "reference"
    root = run.path.parent.parent
    fault = info.fault.doc() if info.fault else None
    run_dir = prepare(frozen, root, kind, fault=fault, origin=origin(run.path, step, level))
    extra = {"stop_after": step}
    if info.perturb:
        extra["perturb"] = info.perturb.doc()
    write_run_info(run_dir, read_run_info(run_dir).updated(**extra))
    progress(
        f"depth records of {markup_safe(run.path.name)} step {step} ({level}): re-running into {markup_safe(run_dir)}"
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
    command: list[str] | None = None,
    **diff_options,
) -> ZoomResult:
    """diff A B (or the `diff` result given), then both sides' first divergent step (or `step`) at depth.
    `command`: the script of the one attached side that has no depth replay of the step yet."""
    if depth not in DEPTHS:
        raise BadInput("--depth", f"'{depth}' is not module or op")
    if diff is None:
        diff = diff_runs(run_a, run_b, mode=mode, rtol=rtol, atol=atol, **diff_options)
    if step is None and diff.first_divergence is not None:
        step = diff.first_divergence.step
    if step is None:
        return zoom_result(diff, None, depth, None)
    refuse_op_across(diff, depth)
    if not diff.topology.same:  # before any replay runs
        refuse_attached_split(Run(run_a), Run(run_b))
    commands = _commands(Run(run_a), Run(run_b), step, depth, command)
    deep_a = deep_run(Path(run_a), step, depth, progress, commands[0])
    deep_b = deep_run(Path(run_b), step, depth, progress, commands[1])
    return zoom_result(
        diff,
        step,
        depth,
        (Run(deep_a), Run(deep_b), _produced_by(run_a, run_b)),
        rtol=rtol,
        atol=atol,
    )


def _produced_by(*runs) -> str:
    """How the depth records were produced: `rerun`, `replay`, or A's/B's when they differ."""
    kinds = [REPLAYED if Run(r).attached else PRODUCED_BY for r in runs]
    return kinds[0] if kinds[0] == kinds[1] else "/".join(kinds)


def _commands(a: Run, b: Run, step: int, depth: str, command: list[str] | None) -> list:
    """Which side the command after '--' replays: the one attached side without a depth replay of `step`."""
    if command is None:
        return [None, None]
    from disttrace.store.depth import depth_replays

    if not (a.attached or b.attached):
        raise BadInput("--", "neither run is an attached script's: zoom re-runs the harness's runs")
    needs = [r.attached and not depth_replays(r, step, depth) for r in (a, b)]
    if all(needs):
        raise BadInput(
            "--",
            "both runs are attached scripts' without depth replays of step "
            f"{step}: one command cannot replay both; replay one first "
            f"(disttrace replay {a.path} --step {step} --depth {depth} -- CMD)",
        )
    return [command if n else None for n in needs]


def stored_zoom(diff, run_a: Path, run_b: Path) -> ZoomResult | None:
    """The zoom of a divergent `diff` from depth runs a `zoom` already made (op depth first), launching
    nothing: what the HTML report shows. None when there are none."""
    f = diff.first_divergence
    if f is None:
        return None
    runs = (Run(run_a), Run(run_b))
    for level in ("op", "module") if diff.topology.same else ("module",):
        try:
            a, b = (_stored_deep(r, f.step, level) for r in runs)
        except BadInput:  # a lock the harness would not run: no depth run of it
            return None
        if a is not None and b is not None:
            return zoom_result(diff, f.step, level, (a, b, _produced_by(run_a, run_b)))
    return None


def _stored_deep(run: Run, step: int, level: str) -> Run | None:
    if run.attached:
        from disttrace.store.depth import depth_replays

        return next(
            (r for r in depth_replays(run, step, level) if not not_reproduced(run, r, step)), None
        )
    return find_depth_run(run, step, level, depth_frozen(run, step, level).manifest_id)
