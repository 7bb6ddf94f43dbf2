"""The independent evaluation gate. A result is accepted only if every check passes; loss or throughput
never pass it on their own. Reads the run store only; the evaluation itself runs in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from disttrace.store import checkpoints as checkpoint
from disttrace.errors import BadInput
from disttrace.store.records import Check, Verdict
from disttrace.store.rundir import Run, read_json, write_json_atomic
from disttrace.analysis.sync import check_sync, find_stragglers

REQUIRED_CONTENTS = {"model", "optim", "progress"}


def check(name: str, passed: bool | None, reason: str) -> dict:
    """passed None: not applicable (e.g. no reference given); it neither passes nor fails the gate."""
    return Check(name=name, passed=passed, reason=reason).line()


def run_eval(run: Run) -> dict:
    """Score the run's final checkpoint in a fresh single process; reuse eval.json if it scored the same
    checkpoint bytes (the INDEX's hashes) already."""
    from disttrace.store.checkpoints import final_checkpoint

    ckpt = final_checkpoint(run)
    out = run.path / "eval.json"
    if out.exists():
        prev = read_json(out)
        if prev.get("checkpoint") == ckpt.name and prev.get("index_mtime") == (ckpt / "INDEX.json").stat().st_mtime:
            return prev
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "disttrace.gate.evaluate", str(run.path)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise BadInput(run.path, (proc.stderr.strip().splitlines() or ["evaluation failed"])[-1])
    result = read_json(out)
    result["index_mtime"] = (ckpt / "INDEX.json").stat().st_mtime
    write_json_atomic(out, result)
    return result


def store_integrity(run: Run, ref: Run | None) -> dict:
    """`disttrace verify` of the run (and of the reference): damaged or unsealed fails, naming the first file."""
    from disttrace.store.verify import summary_line, verify_run

    for label, r in (("", run), ("reference: ", ref)):
        if r is None:
            continue
        v = verify_run(r.path)
        if not v.exit_ok:
            return check("store_integrity", False, label + summary_line(v))
    return check("store_integrity", True, "sealed files, step chains and checkpoint pickles intact"
                 + (" (run and reference)" if ref is not None else ""))


def gate(run_dir: Path, reference: Path | None = None, policy_file: Path | None = None,
         require_all: bool = False) -> dict:
    from disttrace.gate import policy as gate_policy

    run = Run(run_dir)
    ref = Run(reference) if reference else None
    # the policy is the reference's (or a policy file's), never the candidate's own manifest's
    policy, source = gate_policy.resolve(ref.path if ref else None, ref.manifest if ref else None, policy_file,
                                         require_all)
    ignored = gate_policy.candidate_differences(policy, run.manifest)
    checks, flags = [], []

    # 0. the run store is what its job wrote (`disttrace verify`: the seal, the step chains, every pickle)
    checks.append(store_integrity(run, ref))

    # 1. checkpoint integrity of every checkpoint the run wrote
    ckpts = run.checkpoint_dirs()
    bad = []
    for c in ckpts:
        ok, why = checkpoint.status(c, run.manifest_id)
        if ok:
            contents = set(checkpoint.read_index(c).get("contents", []))
            if not REQUIRED_CONTENTS <= contents:
                ok, why = False, f"{c.name} lacks {sorted(REQUIRED_CONTENTS - contents)} (saved incompletely)"
        if not ok:
            bad.append(why)
    partial = sorted((run.path / "checkpoints").glob("*.partial")) if (run.path / "checkpoints").is_dir() else []
    if partial:
        bad.append(f"{partial[0].name}: a checkpoint write never finished")
    checks.append(check("checkpoint_integrity", bool(ckpts) and not bad,
                        bad[0] if bad else (f"{len(ckpts)} checkpoints, every file's sha256 matches its INDEX"
                                            if ckpts else "the run wrote no checkpoint")))

    # 2. collective sync
    sync = check_sync(run)
    checks.append(check("collective_sync", sync["ok"], sync["first_mismatch"]["message"] if not sync["ok"] else
                        f"{len(sync['groups'])} process groups, every member issued the same sequence"))

    # 2b. replicas that must agree inside the run do (no reference needed: disttrace check)
    from disttrace.analysis.consistency import check_run

    cons = check_run(run)
    if cons["consistent"] is None:
        checks.append(check("replica_consistency", None, cons["reason"]))
    elif cons["consistent"]:
        checks.append(check("replica_consistency", True, f"{cons['steps_checked']} steps, every replica group agrees"))
    else:
        f = cons["first"]
        checks.append(check("replica_consistency", False, f"step {f['step']} {f['phase']} {f['tensor']}: {f['message']}"
                            f" (ranks {f['minority']} vs {f['majority']})"))

    # 3. gradient equivalence against the reference
    from disttrace.analysis.diff import diff_runs

    if ref is not None:
        try:
            d = diff_runs(ref.path, run.path)
        except BadInput as e:  # e.g. no step in common (a job that died in its first step): not equivalent
            d = {"equal": False, "first_divergence": None, "error": str(e)}
        if "error" in d:
            reason = f"not comparable: {d['error']}"
        elif d["equal"]:
            cs = d["compared_steps"]
            reason = f"{d['mode']} equal over steps {cs.get('first')}..{cs.get('last')}"
        else:
            f = d["first_divergence"]
            reason = (f"first divergence at step {f['step']} micro-batch {f['micro_batch']} {f['phase']} rank "
                      f"{f['rank']} tensor {f['tensor']}")
        checks.append(check("gradient_equivalence", d["equal"], reason))
    else:
        checks.append(check("gradient_equivalence", None, "not checked: no --reference given"))

    # 4. the eval metric, independently computed, within the manifest's tolerance of the reference's
    evaluation, ref_eval = None, None
    if run.lock.get("source") == "disttrace.api":  # the user's own model: disttrace has no evaluation of it
        checks.append(check("eval_metric", None, "an attached run (disttrace.api): no held-out evaluation of the "
                                                 "user's model"))
    else:
        try:
            evaluation = run_eval(run)
        except BadInput as e:
            checks.append(check("eval_metric", False, str(e)))
    if evaluation is not None:
        if ref is not None:
            try:
                ref_eval = run_eval(ref)
            except BadInput as e:
                ref_eval = None
                checks.append(check("eval_metric", False, f"the reference cannot be scored: {e}"))
        if ref is not None and ref_eval is not None:
            tol = policy.eval.loss_rtol
            a, b = evaluation["eval_loss"], ref_eval["eval_loss"]
            rel = abs(a - b) / max(abs(b), 1e-12)
            ok = rel <= tol and a == a  # NaN never passes
            checks.append(check("eval_metric", ok, f"eval loss {a:.5f} vs reference {b:.5f}: relative difference "
                                                   f"{rel:.2e} {'<=' if ok else '>'} {tol}"))
        elif ref is None:
            finite = evaluation["eval_loss"] == evaluation["eval_loss"] and evaluation["eval_loss"] < float("inf")
            checks.append(check("eval_metric", True if finite else False,
                                f"eval loss {evaluation['eval_loss']:.5f} (no reference to compare with)"))

    # 5. the run is complete
    checks.append(check("complete", run.complete, "COMPLETE present" if run.complete else
                        "no COMPLETE marker: the run did not finish"))

    for s in find_stragglers(run):
        flags.append(f"straggler: rank {s['rank']} at step {s['step']} took {s['seconds']}s to reach its "
                     f"collective (others {s['others_median']}s)")
    for name, value in ignored.items():
        flags.append(f"the candidate's manifest states {name} = {value}; ignored: the gate's policy comes from the "
                     f"{source} ({_policy_value(policy, name)})")
    apply_policy(checks, policy)
    passed = all(c["passed"] is not False for c in checks if c["required"])
    verdict = Verdict(passed=passed, run=str(run.path), reference=str(ref.path) if ref else None,
                      policy=gate_policy.as_record(policy, source, ignored), checks=checks, flags=flags,
                      eval=evaluation, reference_eval=ref_eval, time=time.time()).line()
    write_json_atomic(run.path / "verdict.json", verdict)
    return verdict


def apply_policy(checks: list[dict], policy) -> None:
    """Mark each check required or advisory; under require_all a check that could not apply fails."""
    for c in checks:
        c["required"] = policy.is_required(c["name"])
        if policy.checks.require_all and c["passed"] is None:
            c["passed"] = False
            c["reason"] = f"n/a, and the policy requires every check: {c['reason']}"


def _policy_value(policy, dotted: str):
    section, key = dotted.split(".", 1)
    return getattr(getattr(policy, section), key)


def render(verdict: dict, console) -> None:
    """Text objects throughout: reasons quote tensor names, paths and messages from the run store, which
    must print as they are, never as rich markup."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"gate: {'PASS' if verdict['pass'] else 'FAIL'}  {verdict['run']}"))
    t.add_column("check")
    t.add_column("result")
    t.add_column("reason")
    for c in verdict["checks"]:
        res = {True: Text("pass", style="green"), False: Text("FAIL", style="red"),
               None: Text("n/a", style="dim")}[c["passed"]]
        if not c.get("required", True):
            res.append(" (advisory)", style="dim")
        t.add_row(Text(c["name"]), res, Text(c["reason"]))
    console.print(t)
    pol = verdict.get("policy")
    if pol:
        req = pol["checks"]["required"]
        console.print(Text(f"policy: eval.loss_rtol {pol['eval']['loss_rtol']}, required "
                           f"{'every check' if req is None else ', '.join(req) or 'none'}"
                           f"{', n/a fails' if pol['checks']['require_all'] else ''} (from the {pol['source']})",
                           style="dim"))
    for f in verdict["flags"]:
        console.print(Text("flag", style="yellow") + Text(f": {f}"))
