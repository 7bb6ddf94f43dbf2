"""What ties the gate's verdict to bytes it can recompute (docs/trust.md). No torch here.

A candidate's store is written by someone who controls every byte of it, its hashes and seal included
(anything in it can be recomputed with disttrace's own code). So the gate believes a stored claim only
where it can check it against something it computes itself or against the reference:

* coverage: every step the reference recorded was compared, on every rank of both runs, or (a recovered
  run) lies before a resume checkpoint whose bytes are the reference's at that step;
* the checkpoint it evaluates is the one the trajectory it judged describes: every DCP file's xxh3 equals
  the `checkpoint`-phase record of that file at that step;
* the tolerance it judges by is the reference's: a candidate's stated precision or layout may not loosen it.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import xxhash

from disttrace.errors import BadInput
from disttrace.fmt import ranges
from disttrace.store.documents import ResumeSpec
from disttrace.store.rundir import Run

FILE_RECORD = "file:"
DCP_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")


def recorded_steps(run: Run) -> tuple[list[int], list[int]]:
    """-> (the steps every rank's step index holds, the ranks that have one)."""
    steps: set[int] | None = None
    ranks = run.ranks()
    for r in ranks:
        s = {e.step for e in run.step_index(r).records}
        steps = s if steps is None else steps & s
    return sorted(steps or ()), ranks


def expected_steps(run: Run) -> list[int]:
    """The steps a run of this manifest records: every `record.every`-th of `training.steps`."""
    m = run.manifest
    n = m.training.steps or 0
    every = max(1, m.record.every or 1)
    return [s for s in range(1, n + 1) if s % every == 0]


def file_digests(run: Run, step: int) -> dict[str, str]:
    """{DCP file name: xxh3} as the trajectory's `checkpoint` records of `step` state them, over every rank."""
    out: dict[str, str] = {}
    for r in run.ranks():
        for rec in run.checked_step_records(r, step):
            name = rec.get("tensor") or ""
            if rec.get("phase") == "checkpoint" and name.startswith(FILE_RECORD):
                out[name[len(FILE_RECORD) :]] = str(rec.get("digest"))
    return out


def _xxh3_of(path: Path) -> str:
    """A checkpoint file's xxh3-128, read without following a link (a regular file inside the directory)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadInput(path, "not a regular file")
        h = xxhash.xxh3_128()
        while block := os.read(fd, 1 << 20):
            h.update(block)
        return h.hexdigest()
    finally:
        os.close(fd)


def checkpoint_matches(ckpt: Path, records_of: Run, step: int) -> str | None:
    """None when every DCP file of `ckpt` is, byte for byte (xxh3), what `records_of`'s trajectory says the
    checkpoint of `step` holds, and no file is missing or extra; else the first difference, in words."""
    want = file_digests(records_of, step)
    if not want:
        return (
            f"the trajectory of {records_of.path} has no `checkpoint` records at step {step} "
            "(not recorded there): its bytes are bound to nothing the gate judged"
        )
    try:
        have = {p.name: p for p in Path(ckpt).iterdir() if DCP_FILE.fullmatch(p.name)}
    except OSError as e:
        return f"{ckpt}: cannot list ({e.strerror})"
    for name in sorted(set(want) | set(have)):
        if name not in have:
            return f"{ckpt.name}/{name} is missing (the trajectory records it at step {step})"
        if name not in want:
            return (
                f"{ckpt.name}/{name} is not in the trajectory's checkpoint records of step {step}"
            )
        try:
            got = _xxh3_of(have[name])
        except OSError as e:
            return f"{ckpt.name}/{name}: cannot read ({e.strerror})"
        except BadInput as e:
            return str(e)
        if got != want[name]:
            return (
                f"{ckpt.name}/{name}: its bytes (xxh3 {got[:12]}...) are not the ones the trajectory "
                f"of {records_of.path} records at step {step} ({want[name][:12]}...)"
            )
    return None


def coverage(ref: Run, run: Run) -> tuple[str | None, str]:
    """-> (None, how) when every step the reference's manifest records was compared on every rank of both
    runs (or, for a recovered run, lies at or before its resume step and the checkpoint it resumed from is
    byte for byte the reference's at that step); else (which steps or ranks were not, in words, "")."""
    ref_steps, ref_ranks = recorded_steps(ref)
    run_steps, run_ranks = recorded_steps(run)
    for who, r, ranks in (("reference", ref, ref_ranks), ("candidate", run, run_ranks)):
        missing_ranks = sorted(set(range(r.world_size)) - set(ranks))
        if missing_ranks:
            return f"the {who} has no trajectory for rank(s) {ranges(missing_ranks)}", ""
    # the steps its manifest says it records; a manifest that states no step count (an attached run's may
    # not): the steps the reference recorded
    expected = expected_steps(ref) or ref_steps
    lacking = sorted(set(expected) - set(ref_steps))
    if lacking:
        return f"the reference itself lacks step(s) {ranges(lacking)} of {len(expected)}", ""
    missing = sorted(set(expected) - set(run_steps))
    how = f"all {len(expected)} recorded steps of the reference compared"
    resume = run.run_info.resume
    if missing and resume:
        r = resume.step
        before = [s for s in missing if s <= r]
        if before:
            why = _resume_bound(ref, run, resume)
            if why is not None:
                return (
                    f"step(s) {ranges(before)} were not compared: the run resumed at step {r} from a "
                    f"checkpoint the gate cannot bind to the reference ({why})"
                ), ""
            missing = [s for s in missing if s > r]
            how = (
                f"steps after {r} compared; steps 1..{r} stand on the checkpoint it resumed from, "
                f"byte for byte the reference's at step {r}"
            )
    if missing:
        return (
            f"step(s) {ranges(missing)} of the reference's {len(expected)} were not compared "
            "(the candidate has no records of them)"
        ), ""
    return None, how


def _resume_bound(ref: Run, run: Run, resume: ResumeSpec) -> str | None:
    from disttrace.store import checkpoints
    from disttrace.store.paths import resume_checkpoint

    try:
        ckpt = resume_checkpoint(run.path, resume)
        checkpoints.verify(ckpt, run.manifest_id)
    except BadInput as e:
        return str(e)
    return checkpoint_matches(ckpt, ref, resume.step)


# the manifest keys that enter the derived bound (analysis/tolerance.py) besides the experiment's own fields
TOLERANCE_INPUTS = (
    "training.dtype",
    "training.compute_dtype",
    "training.param_dtype",
    "training.reduce_dtype",
    "training.micro_batch_size",
    "training.grad_accum_steps",
    "parallelism.dp",
    "parallelism.tp",
    "parallelism.pp",
    "parallelism.zero_stage",
)


def loosened_bound(ref_manifest: dict, cand_manifest: dict) -> str | None:
    """None when the candidate's own statements leave the bound diff derives no looser than the reference's
    manifest alone derives; else what loosens it. A candidate's stated precision or layout is its writer's
    word: a lock claiming bfloat16 where the reference computed float32 must not widen what it is judged by."""
    from disttrace.analysis import tolerance
    from disttrace.config.identity import get_field
    from disttrace.store.records import PHASES

    looser = [
        p
        for p in PHASES
        if tolerance.step_bound(ref_manifest, cand_manifest, p)
        > tolerance.step_bound(ref_manifest, ref_manifest, p)
    ]
    u_ref, u_cand = tolerance.unit_roundoff(ref_manifest), tolerance.unit_roundoff(cand_manifest)
    if not looser and u_cand <= u_ref:
        return None
    stated = [
        f"{k} = {get_field(cand_manifest, k)!r} (reference: {get_field(ref_manifest, k)!r})"
        for k in TOLERANCE_INPUTS
        if get_field(cand_manifest, k) != get_field(ref_manifest, k)
    ]
    return (
        f"the candidate's manifest states {'; '.join(stated) or 'other tolerance inputs'}, which would "
        f"loosen the bound it is judged by (unit roundoff {u_cand:.1e} against the reference's "
        f"{u_ref:.1e}{', phases ' + ', '.join(looser) if looser else ''}); the tolerance comes from the "
        "reference: a candidate's precision and layout are compared, not trusted"
    )
