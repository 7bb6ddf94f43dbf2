"""The independent evaluation gate. A result is accepted only if every check passes; loss or throughput
never pass it on their own. Reads the run store only; the evaluation itself runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import orjson

from disttrace.analysis.sync import check_sync, find_stragglers
from disttrace.errors import BadInput
from disttrace.gate import binding
from disttrace.store import checkpoints as checkpoint
from disttrace.store.documents import Check, Verdict
from disttrace.store.rundir import Run
from disttrace.store.writers import write_json_atomic

REQUIRED_CONTENTS = {"model", "optim", "progress"}


class ReplayOutcome(NamedTuple):
    """What re-executing a run's steps found: passed (None when it cannot apply), why, and the verdict's
    `replay` record (the seed, the steps drawn, each job)."""

    passed: bool | None
    reason: str
    record: dict


def check(name: str, passed: bool | None, reason: str) -> Check:
    """passed None: not applicable (e.g. no reference given); it neither passes nor fails the gate."""
    return Check(name=name, passed=passed, reason=reason)


def run_eval(run: Run, data_from: Run | None = None) -> dict:
    """Score the run's final checkpoint in a fresh single process, or reuse the gate's own earlier score of
    the same bytes from the user's cache (gate/evalcache.py); the store's eval.json is written, never read.
    The held-out data, its split and the batches scored are `data_from`'s (the reference's: a candidate
    never chooses what it is scored on), hash-checked against that manifest; the run's own without one."""
    from disttrace.gate import evalcache
    from disttrace.store.checkpoints import final_checkpoint

    data_from = data_from or run
    ckpt = final_checkpoint(run)
    out = run.path / "eval.json"
    key = evalcache.evaluation_key(run, ckpt, data_from)
    result = evalcache.cached(key)
    if result is None:
        out.unlink(
            missing_ok=True
        )  # a stale or forged eval.json must not stand in for a failed evaluation
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "disttrace.run.evaluation.evaluate",
                str(run.path),
                str(data_from.path),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        if proc.returncode != 0:
            raise BadInput(
                run.path, (proc.stderr.strip().splitlines() or ["evaluation failed"])[-1]
            )
        # the evaluator's own stdout, not the file it wrote into a store someone else may be writing to
        result = {**orjson.loads(proc.stdout.strip().splitlines()[-1]), "evaluation_key": key}
        if (
            evalcache.evaluation_key(run, ckpt, data_from) == key
        ):  # nothing it read changed meanwhile
            evalcache.remember(key, result)
    write_json_atomic(out, result)
    return result


def store_integrity(run: Run, ref: Run | None) -> Check:
    """`disttrace verify` of the run (and of the reference): damaged or unsealed fails, naming the first file."""
    from disttrace.store.verify import summary_line, verify_run

    for label, r in (("", run), ("reference: ", ref)):
        if r is None:
            continue
        v = verify_run(r.path)
        if not v.exit_ok:
            return check("store_integrity", False, label + summary_line(v))
    return check(
        "store_integrity",
        True,
        "sealed files, step chains and checkpoint pickles intact"
        + (" (run and reference)" if ref is not None else ""),
    )


def checkpoint_integrity(run: Run) -> Check:
    """Every checkpoint the run wrote verifies against its INDEX and holds model, optimizer and progress."""
    ckpts = run.checkpoint_dirs()
    bad = []
    for c in ckpts:
        ok, why = checkpoint.status(c, run.manifest_id)
        if ok:
            contents = set(checkpoint.read_index(c).get("contents", []))
            if not REQUIRED_CONTENTS <= contents:
                ok, why = (
                    False,
                    f"{c.name} lacks {sorted(REQUIRED_CONTENTS - contents)} (saved incompletely)",
                )
        if not ok:
            bad.append(why)
    partial = (
        sorted((run.path / "checkpoints").glob("*.partial"))
        if (run.path / "checkpoints").is_dir()
        else []
    )
    if partial:
        bad.append(f"{partial[0].name}: a checkpoint write never finished")
    return check(
        "checkpoint_integrity",
        bool(ckpts) and not bad,
        bad[0]
        if bad
        else (
            f"{len(ckpts)} checkpoints, every file's sha256 matches its INDEX"
            if ckpts
            else "the run wrote no checkpoint"
        ),
    )


def collective_sync(run: Run) -> Check:
    """Within every process group, every member issued the same sequence of collectives."""
    sync = check_sync(run)
    return check(
        "collective_sync",
        sync.ok,
        sync.first_mismatch.message
        if sync.first_mismatch is not None
        else f"{len(sync.groups)} process groups, every member issued the same sequence",
    )


def replica_consistency(run: Run) -> Check:
    """Copies that must agree inside the run do (`disttrace check`; no reference needed)."""
    from disttrace.analysis.consistency import check_run

    cons = check_run(run)
    if cons.consistent is None:
        return check("replica_consistency", None, str(cons.reason))
    f = cons.first
    if f is None:
        return check(
            "replica_consistency", True, f"{cons.steps_checked} steps, every replica group agrees"
        )
    return check(
        "replica_consistency",
        False,
        f"step {f.step} {f.phase} {f.tensor}: {f.message} (ranks {f.minority} vs {f.majority})",
    )


def gradient_equivalence(run: Run, ref: Run | None, required=None) -> Check:
    """The run's trajectory equals the reference's (bitwise, or within the derived bound across topologies);
    `required` (the policy's EquivalencePolicy) bounds how coarse a numeric equality may be."""
    from disttrace.analysis.diff import diff_runs

    if ref is None:
        return check("gradient_equivalence", None, "not checked: no --reference given")
    loosened = binding.loosened_bound(ref.manifest_doc, run.manifest_doc)
    if loosened:
        return check("gradient_equivalence", False, loosened)
    try:
        d = diff_runs(ref.path, run.path)
        missing, covered = binding.coverage(ref, run) if d.equal else (None, "")
    except (
        BadInput
    ) as e:  # e.g. no step in common (a job that died in its first step): not equivalent
        return check("gradient_equivalence", False, f"not comparable: {e}")
    # the reference's own measured noise, when it carries one (diff finds it beside the run)
    how = " (calibrated)" if d.tolerance.kind == "calibrated" else ""
    f = d.first_divergence
    if f is None:
        cs = d.compared_steps
        if missing:  # equal over what was compared, but not over every step of the reference
            return check(
                "gradient_equivalence",
                False,
                f"{d.mode} equal over steps {cs.first}..{cs.last} only: {missing}",
            )
        coarse = _too_coarse(d, required)
        if coarse:
            return check(
                "gradient_equivalence",
                False,
                f"{d.mode} equal over steps {cs.first}..{cs.last}{how}, but {coarse}",
            )
        within = _within(d)
        return check(
            "gradient_equivalence",
            True,
            f"{d.mode} equal over steps {cs.first}..{cs.last}{how}{within} ({covered})",
        )
    return check(
        "gradient_equivalence",
        False,
        f"first divergence at step {f.step} micro-batch "
        f"{f.micro_batch} {f.phase} rank {f.rank} tensor {f.tensor}{how}",
    )


def _within(d) -> str:
    """', equal to within X (where)' of a numeric diff that held some phase to a bound."""
    from disttrace.analysis.diff.sensitivity import worst

    w = worst(d.numeric.sensitivity) if d.numeric is not None else None
    if w is None:
        return ""
    phase, cls, v = w
    got = "an explicit atol" if v is None else f"{v:.1e}"
    return f", to within {got} ({phase}{' ' + cls if cls else ''})"


def _too_coarse(d, required) -> str | None:
    """Why an equal diff is coarser than the policy requires (None: it is not, or nothing is required): a
    phase (or tensor class) held to a larger bound than the policy's figure there (a class's numeric figures
    count, a class no bound covers does not: docs/gate.md)."""
    if required is None or d.numeric is None:
        return None  # bitwise: any bit would have been seen
    for phase, s in d.numeric.sensitivity.items():
        classes = s.classes or {}
        need = required.required(phase)
        figures = (
            [(None, s.max, need)]
            + [(c, v, need) for c, v in classes.items() if not isinstance(v, str)]
            if need is not None
            else []
        )
        for cls, c_need in required.max_sensitivity_by_class.items():
            # a tensor class not listed is held to the phase's figure; Adam's second moment is listed
            # wherever it has records
            v = classes.get(cls, None if cls == "exp_avg_sq" else s.max)
            if v is not None and not isinstance(v, str):
                figures.append((cls, v, c_need))
        for cls, v, need in figures:
            if v is None or v > need:
                what = f"{phase}{' ' + cls if cls else ''}"
                got = "an explicit atol's bound" if v is None else f"{v:.2e}"
                return (
                    f"only to within {got} at {what} (step {s.step}): the policy requires a "
                    f"sensitivity of {need:g} there"
                )
    return None


def eval_metric(
    run: Run, ref: Run | None, loss_rtol: float, policy_eval=None
) -> tuple[list[Check], dict | None, dict | None]:
    """The held-out eval loss, scored by a fresh process, within the policy's tolerance of the reference's.
    Returns the check(s) and both evaluations (for verdict.json). A policy that names an evaluation command
    (policy_eval.command) has it score any run instead (gate/usereval.py)."""
    if policy_eval is not None and policy_eval.command is not None:
        from disttrace.gate import usereval

        return usereval.eval_metric(run, ref, policy_eval)
    if run.attached:  # the user's own model: disttrace has no evaluation of it
        return (
            [
                check(
                    "eval_metric",
                    None,
                    "an attached run (disttrace.api): no held-out evaluation of the user's model",
                )
            ],
            None,
            None,
        )
    unbound = _unbound_checkpoint(run)
    if unbound:
        return [check("eval_metric", False, f"not evaluated: {unbound}")], None, None
    try:
        evaluation = run_eval(run, ref)
    except BadInput as e:
        return [check("eval_metric", False, str(e))], None, None
    loss = evaluation["eval_loss"]
    if ref is None:
        finite = loss == loss and loss < float("inf")
        return (
            [check("eval_metric", finite, f"eval loss {loss:.5f} (no reference to compare with)")],
            evaluation,
            None,
        )
    try:
        ref_eval = run_eval(ref)
    except BadInput as e:
        return (
            [check("eval_metric", False, f"the reference cannot be scored: {e}")],
            evaluation,
            None,
        )
    b = ref_eval["eval_loss"]
    rel = abs(loss - b) / max(abs(b), 1e-12)
    ok = rel <= loss_rtol and loss == loss  # NaN never passes
    return (
        [
            check(
                "eval_metric",
                ok,
                f"eval loss {loss:.5f} vs reference {b:.5f}: relative difference "
                f"{rel:.2e} {'<=' if ok else '>'} {loss_rtol}",
            )
        ],
        evaluation,
        ref_eval,
    )


def _unbound_checkpoint(run: Run) -> str | None:
    """Why the checkpoint the gate would evaluate is not the one the run's trajectory describes (None: it
    is, file by file): the evaluation must score the bytes whose computation the gate judged."""
    from disttrace.store.checkpoints import final_checkpoint

    try:
        ckpt = final_checkpoint(run)
        return binding.checkpoint_matches(ckpt, run, int(ckpt.name.split("-")[1]))
    except BadInput as e:
        return str(e)


def completeness(run: Run) -> Check:
    return check(
        "complete",
        run.complete,
        "COMPLETE present" if run.complete else "no COMPLETE marker: the run did not finish",
    )


def gate(
    run_dir: Path,
    reference: Path | None = None,
    policy_file: Path | None = None,
    require_all: bool = False,
    replay: ReplayOutcome | None = None,
) -> Verdict:
    """The independent gate: each check a small function above, composed in this order because the cheap
    integrity checks come first (a damaged store is named before anything is computed from it) and the
    evaluation, a fresh process, last. Loss or throughput never pass it on their own. `replay`: the outcome
    of re-executing some of the run's steps (lab/reexecute.py runs the jobs; the verdict only reads what
    they found), a check of its own when given."""
    from disttrace.gate import policy as gate_policy

    run = Run(run_dir)
    ref = Run(reference) if reference else None
    # the policy is the reference's (or a policy file's), never the candidate's own manifest's
    policy, source = gate_policy.resolve(
        ref.path if ref else None, ref.manifest_doc if ref else None, policy_file, require_all
    )
    from disttrace.gate import usereval

    ignored = gate_policy.candidate_differences(policy, run.manifest_doc)
    own_eval = usereval.candidate_differences(policy, run)  # never run, reported in one flag
    checks = [
        store_integrity(run, ref),
        checkpoint_integrity(run),
        collective_sync(run),
        replica_consistency(run),
        gradient_equivalence(run, ref, policy.equivalence),
    ]
    replayed = None
    if replay is not None:
        replayed = replay.record
        checks.append(check("replay", replay.passed, replay.reason))
    evals, evaluation, ref_eval = eval_metric(run, ref, policy.eval.loss_rtol, policy.eval)
    checks += evals + [completeness(run)]

    flags = [f"straggler: {s.text()}" for s in find_stragglers(run)]
    flags += [
        f"the candidate's manifest states {name} = {value}; ignored: the gate's policy comes from the "
        f"{source} ({_policy_value(policy, name)})"
        for name, value in ignored.items()
    ]
    flags += [usereval.flag(own_eval, source)] if own_eval else []
    apply_policy(checks, policy)
    passed = all(c.passed is not False for c in checks if c.required)
    verdict = Verdict(
        passed=passed,
        run=str(run.path),
        reference=str(ref.path) if ref else None,
        policy=gate_policy.as_record(policy, source, {**ignored, **own_eval}),
        checks=checks,
        flags=flags,
        eval=evaluation,
        reference_eval=ref_eval,
        time=time.time(),
        replay=replayed,
        trust=trust_record(ref is not None, replayed, evaluation is not None),
        attribution=replay_attribution(run, ref),
    )
    write_json_atomic(run.path / "verdict.json", verdict.line())
    return verdict


def replay_attribution(run: Run, ref: Run | None) -> dict | None:
    """The attribution of the run's latest complete replay (`disttrace replay`: a `replay-<S>` store beside
    it whose run.json names it), recomputed here from the run, the replay and the gate's reference; None
    when there is no replay or no reference."""
    from disttrace.analysis.attribution import attribute

    if ref is None:
        return None
    me = str(run.path.resolve())
    found = []
    for d in run.path.parent.glob("replay-*"):
        try:
            r = Run(d)
            replay = r.run_info.replay
            if replay is not None and replay.of == me and r.complete:
                found.append((float(r.run_info.created or 0), d))
        except BadInput:
            continue
    if not found:
        return None
    replay_dir = max(found)[1]
    try:
        res = attribute(run.path, replay_dir, ref.path)
    except BadInput as e:
        return {"replay": str(replay_dir), "attribution": None, "reason": str(e)}
    return {
        "replay": str(replay_dir),
        "step": res.step,
        "attribution": res.attribution,
        **({"slot": res.slot.index} if res.slot is not None else {}),
        "reproduces": res.reproduces,
        "matches_reference": res.matches_reference,
        "reason": res.reason,
    }


def trust_record(with_reference: bool, replayed: dict | None, evaluated: bool) -> dict:
    """What this verdict recomputed and what it took on the candidate writer's word (docs/trust.md)."""
    steps = (replayed or {}).get("steps") or []
    recomputed = [
        "every hash the integrity checks compare (sha256 / xxh3 of the bytes themselves)",
        "the final checkpoint's DCP files against the trajectory's `checkpoint` records of its step",
    ]
    if with_reference:
        recomputed.insert(
            1,
            "the comparison with the reference: equal steps by their bytes on both sides, others "
            "record by record; every step of the reference covered; the reference's tolerance",
        )
    if evaluated:
        recomputed.append(
            "the held-out evaluation, by a fresh process"
            + (" on the reference's hash-checked data and split" if with_reference else "")
        )
    if steps:
        recomputed.append(
            f"step(s) {', '.join(map(str, steps))} re-executed from the run's own checkpoints"
        )
    on_trust = [
        "that the stored records are what the candidate's job computed"
        + (
            f", for every step but {', '.join(map(str, steps))}"
            if steps
            else " (no step re-executed)"
        ),
        "the collective traces, memory ledger and step times (recorded, never recomputed)",
        "the DCP .metadata of the evaluated checkpoint (no trajectory record covers it)",
    ]
    return {"recomputed": recomputed, "on_trust": on_trust}


def apply_policy(checks: list[Check], policy) -> None:
    """Mark each check required or advisory; under require_all a check that could not apply fails."""
    for c in checks:
        c.required = policy.is_required(c.name)
        if policy.checks.require_all and c.passed is None:
            c.passed = False
            c.reason = f"n/a, and the policy requires every check: {c.reason}"


def _policy_value(policy, dotted: str):
    section, key = dotted.split(".", 1)
    return getattr(getattr(policy, section), key)
