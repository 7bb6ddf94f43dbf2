"""`gate --replay K`: spot-check a candidate by re-executing K of its steps (docs/trust.md), then judge it
with the outcome (`gate_with_replay`): the jobs are launched here, the verdict only reads what they found.

Every hash, INDEX and seal in a candidate's store can be recomputed by its writer, so a forged store can be
self-consistent; only computing a step again shows whether its records are what the code computes. K steps
are drawn at random (a seed the candidate cannot know in advance, recorded in the verdict) among the steps
that follow one of the candidate's own verified checkpoints, and re-executed from that checkpoint as a new
job of the gate's own code on the reference's hash-checked data: no fault, the candidate's manifest (which
must be the reference's experiment, its manifest id its own sha256). The replayed records must equal the
stored ones bit for bit, on every rank, and a checkpoint the candidate saved at a replayed step must be
byte for byte the one re-execution saves.

The job runs in its own directory, made here (never in the candidate's store): the source checkpoint is
copied into it and verified there, so the bytes loaded are the bytes checked. This module imports no torch;
the job runs in a subprocess (`python -m disttrace.lab.reexecute RUN_DIR` launches it).
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from disttrace.errors import BadInput
from disttrace.gate import binding
from disttrace.gate.verdict import ReplayOutcome, gate
from disttrace.store import checkpoints
from disttrace.store.documents import Verdict
from disttrace.store.rundir import Run, read_run_info
from disttrace.store.writers import write_run_info

REPLAY_TIMEOUT_S = 1800


def _refuse(why: str) -> tuple[bool | None, str, dict]:
    return False, why, {}


def replayable(run: Run) -> dict[int, int]:
    """{step: the latest of the candidate's own checkpoints before it that verifies and is the one its
    trajectory records} for every recorded step after such a checkpoint."""
    steps, _ = binding.recorded_steps(run)
    sources = []
    for ckpt in run.checkpoint_dirs():
        if ckpt.is_symlink():
            continue  # a checkpoint is a directory of the run, never a link out of it
        c = int(ckpt.name.split("-")[1])
        ok, _ = checkpoints.status(ckpt, run.manifest_id)
        if ok and binding.checkpoint_matches(ckpt, run, c) is None:
            sources.append(c)
    out = {}
    for s in steps:
        before = [c for c in sources if c < s]
        if before:
            out[s] = max(before)
    return out


def _experiment_differences(ref: Run, run: Run) -> list[str]:
    from disttrace.config.identity import EXPERIMENT_FIELDS, get_field

    return [
        f
        for f in EXPERIMENT_FIELDS
        if get_field(ref.manifest_doc, f) != get_field(run.manifest_doc, f)
    ]


def _copy_checkpoint(src: Path, dst: Path) -> None:
    """The checkpoint's regular files, copied without following a link; anything else is refused."""
    dst.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        st = os.lstat(p)
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(p, "not a regular file (a checkpoint holds files only)")
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f, open(dst / p.name, "xb") as out:
            shutil.copyfileobj(f, out, 1 << 20)


def _prepare(run: Run, ref: Run, source: int, until: int, root: Path) -> Path:
    """A replay run directory under `root` (the gate's own), resuming from a verified copy of the
    candidate's checkpoint `source` and stopping after step `until`."""
    from disttrace.config.freezing import Frozen, verified_data
    from disttrace.run.job.launch import prepare

    data_path, tok_path = verified_data(ref)
    frozen = Frozen(
        manifest=run.manifest_doc,
        manifest_id=run.manifest_id,
        source=str(run.path / "manifest.lock.json"),
        overrides=[],
        resolved={"data_path": data_path, "tokenizer_path": tok_path},
    )
    base = root / run.manifest_id[:12]
    copy = base / "source" / "checkpoints" / f"step-{source:06d}"
    _copy_checkpoint(run.path / "checkpoints" / copy.name, copy)
    checkpoints.verify(copy, run.manifest_id)
    unbound = binding.checkpoint_matches(copy, run, source)
    if unbound:
        raise BadInput(copy, unbound)
    run_dir = prepare(
        frozen,
        root,
        "recovered",
        resume={
            "checkpoint": f"source/checkpoints/{copy.name}",
            "step": source,
            "from_run": str(run.path),
        },
    )
    info = read_run_info(run_dir).updated(stop_after=until, replay_of=str(run.path))
    write_run_info(run_dir, info)
    return run_dir


def _first_difference(run: Run, replay: Run, step: int) -> str | None:
    """None when every rank's records of `step` are the same in both, field for field; else the first."""
    for r in sorted(set(run.ranks()) | set(replay.ranks())):
        stored = run.checked_step_records(r, step)
        again = replay.checked_step_records(r, step)
        if not again:
            return f"rank {r}: re-execution recorded nothing at step {step}"
        if len(stored) != len(again):
            return f"rank {r}: {len(stored)} records stored, {len(again)} re-executed"
        for a, b in zip(stored, again):
            if orjson.dumps(a, option=orjson.OPT_SORT_KEYS) != orjson.dumps(
                b, option=orjson.OPT_SORT_KEYS
            ):
                return (
                    f"rank {r} {a.get('phase')} {a.get('tensor')} (micro-batch {a.get('micro_batch')}): "
                    f"stored digest {str(a.get('digest'))[:12]}..., re-executed "
                    f"{str(b.get('digest'))[:12]}..."
                )
    return None


def gate_with_replay(
    run_dir: Path,
    reference: Path | None = None,
    policy_file: Path | None = None,
    require_all: bool = False,
    replay: int = 0,
    replay_seed: int | None = None,
) -> Verdict:
    """The gate's verdict on `run_dir`, with `replay` of its steps re-executed first when asked (a seed drawn
    here when none is given, unknown to the candidate's writer in advance)."""
    outcome = None
    if replay > 0:
        if replay_seed is None:
            import secrets

            replay_seed = secrets.randbelow(2**32)
        outcome = ReplayOutcome(
            *replay_check(Run(run_dir), Run(reference) if reference else None, replay, replay_seed)
        )
    return gate(
        run_dir, reference, policy_file=policy_file, require_all=require_all, replay=outcome
    )


def replay_check(
    run: Run, ref: Run | None, k: int, seed: int, keep: Path | None = None
) -> tuple[bool | None, str, dict]:
    """-> (passed, reason, the verdict's `replay` record). `keep`: leave the replay runs there (else a
    temporary directory, removed)."""
    record: dict = {"requested": k, "seed": seed}
    if run.attached:
        return (
            None,
            "an attached run (disttrace.api): the gate cannot re-execute the user's script",
            {},
        )
    source_of_data = ref or run
    if ref is not None:
        differ = _experiment_differences(ref, run)
        if differ:
            return _refuse(
                f"not replayed: the candidate's manifest is not the reference's experiment "
                f"({', '.join(differ)})"
            )
    lock_id = hashlib.sha256(
        orjson.dumps(run.manifest_doc, option=orjson.OPT_SORT_KEYS)
    ).hexdigest()
    if lock_id != run.manifest_id:
        return _refuse(
            f"not replayed: {run.path / 'manifest.lock.json'}'s manifest_id is not the sha256 of its "
            "manifest"
        )
    try:
        from disttrace.config.freezing import validate

        validate(run.manifest_doc, run.path / "manifest.lock.json")
        candidates = replayable(run)
    except BadInput as e:
        return _refuse(f"not replayed: {e}")
    record["replayable"] = len(candidates)
    if not candidates:
        return _refuse(
            "nothing to replay: no recorded step follows a checkpoint of the run that verifies and is "
            "the one its trajectory records"
        )
    chosen = sorted(random.Random(seed).sample(sorted(candidates), min(k, len(candidates))))
    record["steps"] = chosen
    groups: dict[int, list[int]] = {}
    for s in chosen:
        groups.setdefault(candidates[s], []).append(s)
    root = Path(tempfile.mkdtemp(prefix="disttrace-replay-")) if keep is None else Path(keep)
    jobs = []
    try:
        for source, steps in sorted(groups.items()):
            until = max(steps)
            job = {"from_checkpoint": f"step-{source:06d}", "steps": steps, "until": until}
            jobs.append(job)
            try:
                run_dir = _prepare(run, source_of_data, source, until, root)
            except BadInput as e:
                job["reproduced"] = False
                return False, f"not replayed from step-{source:06d}: {e}", {**record, "jobs": jobs}
            job["run_dir"] = str(run_dir) if keep is not None else None
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "disttrace.lab.reexecute", str(run_dir)],
                    capture_output=True,
                    text=True,
                    timeout=REPLAY_TIMEOUT_S,
                    env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                )
            except subprocess.TimeoutExpired:
                job["reproduced"] = False
                return (
                    False,
                    f"re-executing steps {source + 1}..{until} took over {REPLAY_TIMEOUT_S} s",
                    {**record, "jobs": jobs},
                )
            if proc.returncode != 0:
                job["reproduced"] = False
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                return (
                    False,
                    f"re-executing steps {source + 1}..{until} from step-{source:06d} failed: {last}",
                    {**record, "jobs": jobs},
                )
            again = Run(run_dir)
            job["compared_steps"] = [s for s in range(source + 1, until + 1) if s in candidates]
            for s in job["compared_steps"]:
                why = _first_difference(run, again, s)
                if why is None and (run.path / "checkpoints" / f"step-{s:06d}").is_dir():
                    why = _checkpoint_difference(run, again, s)
                if why is not None:
                    job["reproduced"] = False
                    return (
                        False,
                        f"step {s} re-executed from the run's checkpoint step-{source:06d} does not "
                        f"reproduce its stored records: {why}",
                        {**record, "jobs": jobs},
                    )
            job["reproduced"] = True
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)
    record["jobs"] = jobs
    return (
        True,
        f"step(s) {', '.join(map(str, chosen))} (seed {seed}, of {len(candidates)} replayable) "
        "re-executed from the run's own checkpoints: every record reproduced bit for bit",
        record,
    )


def _checkpoint_difference(run: Run, again: Run, step: int) -> str | None:
    """A checkpoint the candidate saved at a replayed step must be the bytes re-execution saved."""
    mine = run.path / "checkpoints" / f"step-{step:06d}"
    theirs = again.path / "checkpoints" / f"step-{step:06d}"
    if not theirs.is_dir():
        return None  # re-execution saved none there (not a checkpoint step of the manifest)
    why = binding.checkpoint_matches(mine, again, step)
    return None if why is None else f"its checkpoint is not the one re-execution saves: {why}"


def main(argv=None) -> int:
    """The replay job itself: launch the prepared run directory (torch is imported here only)."""
    from disttrace.errors import DisttraceError
    from disttrace.run.job.launch import launch

    argv = sys.argv[1:] if argv is None else argv
    try:
        launch(Path(argv[0]))
    except DisttraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
