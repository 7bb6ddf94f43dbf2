"""The user's own evaluation (docs/gate.md, "Your own evaluation"): the policy's `[eval] command`, run by
the gate in a fresh process on a run's final verified checkpoint, its metric read from the JSON object on
the last line it prints.

Whose command: the policy's, which is the reference's (its manifest, or `--policy FILE`), never the
candidate's: a candidate store that names its own evaluation is reported and ignored. The reference is the
run the user trusts to define "correct"; its command is the one program the gate runs on their behalf.

What runs: the command's argv with `{checkpoint}` (the checkpoint directory), `{data}` (the held-out data)
and `{run}` (the run store) filled in, `python` as the gate's own interpreter, in the policy's working
directory, with an empty environment apart from PATH and the names the policy passes through, in its own
session (a timeout kills the whole process group). The held-out data's sha256 is checked before it runs.

Every way the evaluation can go wrong (the data changed, the checkpoint does not verify, the command is not
found, crashes, hangs, prints no metric or a non-finite one) is an `EvalFailure` with one line saying why,
which the check reports as a failure: never a pass, never a traceback.

Scores are cached by content (gate/evalcache.py's directory): the command, its working directory, the
bytes of every file its arguments name, the environment passed through, the interpreter, the checkpoint's
INDEX (after every file verified against it) and the data's sha256. A script the command's files import
from elsewhere is not part of the key: `DISTTRACE_CACHE_DIR` pointed at an empty directory scores afresh.

No torch here: the gate's readers run on a laptop.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

from disttrace.errors import BadInput
from disttrace.store import checkpoints as checkpoint
from disttrace.store.documents import Check
from disttrace.store.rundir import Run

PLACEHOLDERS = ("{checkpoint}", "{data}", "{run}")
TAIL_BYTES = (
    1 << 20
)  # the metric line is the last one; a chatty script's earlier output is not read


class EvalFailure(Exception):
    """One line: why the evaluation gave no score."""


def data_sha256(path: Path | str) -> str:
    """A file's sha256, or a directory's: the sha256 over its files in sorted relative-path order, each as
    `path NUL sha256 NUL` (a saved `datasets` split or a folder of shards is one value). Symlinks are
    refused: the bytes hashed are the bytes read."""
    path = Path(path)
    if path.is_symlink():
        raise EvalFailure(f"held-out data {path} is a symlink (hash its target instead)")
    if path.is_file():
        return checkpoint.sha256_of(path)
    if not path.is_dir():
        raise EvalFailure(f"held-out data {path} not found")
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            raise EvalFailure(f"held-out data {path}: {p.relative_to(path)} is a symlink")
        if p.is_file():
            h.update(f"{p.relative_to(path).as_posix()}\0{checkpoint.sha256_of(p)}\0".encode())
    return h.hexdigest()


def argv_of(ev, ckpt: Path, run: Run) -> list[str]:
    """The command with its placeholders filled in; `python` is the gate's own interpreter (the one that
    has disttrace and torch), whatever PATH says."""
    fill = {"{checkpoint}": str(ckpt), "{data}": str(ev.data), "{run}": str(run.path)}
    argv = []
    for arg in ev.command:
        for k, v in fill.items():
            arg = arg.replace(k, v)
        argv.append(arg)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def environment(ev) -> dict[str, str]:
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    env.update({k: os.environ[k] for k in ev.env if k in os.environ})
    return env


def _key(ev, ckpt: Path, env: dict) -> str:
    cwd = Path(ev.cwd)
    files = {}
    for arg in ev.command:
        if any(p in arg for p in PLACEHOLDERS):
            continue
        p = cwd / arg
        if p.is_file():
            files[arg] = checkpoint.sha256_of(p)
    inputs = {
        "kind": "user-eval",
        "command": ev.command,
        "metric": ev.metric,
        "cwd": str(cwd.resolve()),
        "files": files,
        "env": env,
        "python": sys.executable,
        "index": checkpoint.sha256_of(ckpt / checkpoint.INDEX),
        "data_sha256": ev.data_sha256,
    }
    return hashlib.sha256(orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _tail(f) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - TAIL_BYTES))
    return f.read().decode("utf-8", "replace")


def _last_line(text: str) -> str | None:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1].strip() if lines else None


def _run(argv: list[str], cwd: str, env: dict, timeout_s: float) -> tuple[str, str]:
    """(stdout tail, stderr tail) of a finished, successful command; EvalFailure otherwise."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group: a timeout kills its children too
            )
        except OSError as e:
            raise EvalFailure(
                f"the evaluation command cannot start: {argv[0]}: {e.strerror}"
            ) from None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise EvalFailure(
                f"the evaluation command ran past its timeout ({timeout_s:g} s) and was killed"
            ) from None
        stdout, stderr = _tail(out), _tail(err)
    if rc != 0:
        why = _last_line(stderr) or _last_line(stdout) or "no output"
        what = f"killed by signal {-rc}" if rc < 0 else f"exited {rc}"
        raise EvalFailure(f"the evaluation command {what}: {_one_line(why)}")
    return stdout, stderr


def _kill(proc: subprocess.Popen) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_command(
    argv: list[str], cwd: str, env: dict, timeout_s: float, metric: str
) -> tuple[float, dict]:
    """(score, the JSON object) of one run of an evaluation command; EvalFailure with one line otherwise."""
    stdout, _ = _run(argv, cwd, env, timeout_s)
    return parse_metric(stdout, metric)


def parse_metric(stdout: str, metric: str) -> tuple[float, dict]:
    """The metric from the JSON object on the last non-empty stdout line."""
    line = _last_line(stdout)
    if line is None:
        raise EvalFailure("the evaluation command printed nothing (expected a JSON line last)")
    try:  # the standard parser: json.dumps writes a NaN score as NaN, which must say "not finite"
        doc = json.loads(line)
    except (ValueError, RecursionError):
        doc = None
    if not isinstance(doc, dict):
        raise EvalFailure(
            f"the evaluation command's last line is not a JSON object: {_one_line(line, 80)!r}"
        )
    if metric not in doc:
        keys = ", ".join(sorted(map(str, doc))) or "none"
        raise EvalFailure(f"the evaluation's JSON line has no {metric!r} (its keys: {keys})")
    value = doc[metric]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EvalFailure(f"{metric} is not a number: {_one_line(repr(value), 80)}")
    if not math.isfinite(value):
        raise EvalFailure(f"{metric} is not finite: {value}")
    return float(value), doc


def evaluate(run: Run, ev) -> dict:
    """Score the run's final verified checkpoint with the policy's command (or the cached score of the same
    inputs); EvalFailure with one line otherwise. Writes nothing into the run store."""
    from disttrace.gate import evalcache
    from disttrace.store.checkpoints import final_checkpoint

    try:
        ckpt = final_checkpoint(run)
        index = checkpoint.verify(ckpt, run.manifest_id)
    except BadInput as e:
        raise EvalFailure(str(e)) from None
    if not ckpt.resolve().is_relative_to(run.path.resolve()):  # the path handed to the command
        raise EvalFailure(f"{ckpt} resolves outside the run store (a symbolic link)")
    if ev.cwd is None or not Path(ev.cwd).is_dir():
        raise EvalFailure(f"the evaluation's working directory {ev.cwd} is not a directory")
    have = data_sha256(ev.data)
    if have != ev.data_sha256:
        raise EvalFailure(
            f"held-out data {ev.data} changed: sha256 {have[:12]}, the policy fixed "
            f"{ev.data_sha256[:12]}"
        )
    env = environment(ev)
    key = _key(ev, ckpt, env)
    record = {
        "command": list(ev.command),
        "cwd": str(ev.cwd),
        "metric": ev.metric,
        "data": str(ev.data),
        "data_sha256": ev.data_sha256,
        "checkpoint": ckpt.name,
        "checkpoint_step": index.get("step"),
        "index_sha256": checkpoint.sha256_of(ckpt / checkpoint.INDEX),
        "evaluation_key": key,
    }
    hit = evalcache.cached(key)
    if hit is not None and isinstance(hit.get("score"), float):
        return {**hit, **record, "cached": True}
    t0 = time.monotonic()
    score, doc = run_command(argv_of(ev, ckpt, run), str(ev.cwd), env, ev.timeout_s, ev.metric)
    result = {
        **record,
        "score": score,
        "output": doc,
        "seconds": round(time.monotonic() - t0, 3),
        "process": "the policy's command, a fresh process",
    }
    if checkpoint.sha256_of(ckpt / checkpoint.INDEX) == record["index_sha256"]:
        evalcache.remember(key, result)  # nothing it read changed while it ran
    return {**result, "cached": False}


def compare(score: float, ref: float, ev) -> tuple[bool, str]:
    """(passed, the rule as a line) for a candidate's score against the reference's."""
    rtol, atol = ev.tolerance
    allowed = atol + rtol * abs(ref)
    m = ev.metric
    if ev.better == "lower":
        ok, rule = score <= ref + allowed, f"{m} <= reference + {atol:g} + {rtol:g}*|reference|"
    elif ev.better == "higher":
        ok, rule = score >= ref - allowed, f"{m} >= reference - {atol:g} - {rtol:g}*|reference|"
    else:
        ok, rule = (
            abs(score - ref) <= allowed,
            f"|{m} - reference| <= {atol:g} + {rtol:g}*|reference|",
        )
    return (
        ok,
        f"{m} {score:.6g} vs reference {ref:.6g}: {'holds' if ok else 'fails'} {rule} ({ev.better} is better)",
    )


def eval_metric(run: Run, ref: Run | None, ev) -> tuple[list[Check], dict | None, dict | None]:
    """The eval_metric check by the policy's command; returns the check and both evaluations."""
    try:
        evaluation = evaluate(run, ev)
    except EvalFailure as e:
        return (
            [
                Check(
                    name="eval_metric", passed=False, reason=f"the candidate cannot be scored: {e}"
                )
            ],
            None,
            None,
        )
    if ref is None:
        return (
            [
                Check(
                    name="eval_metric",
                    passed=True,
                    reason=f"{ev.metric} {evaluation['score']:.6g} (finite; no reference to compare with)",
                )
            ],
            evaluation,
            None,
        )
    try:
        ref_eval = evaluate(ref, ev)
    except EvalFailure as e:
        return (
            [
                Check(
                    name="eval_metric", passed=False, reason=f"the reference cannot be scored: {e}"
                )
            ],
            evaluation,
            None,
        )
    ok, reason = compare(evaluation["score"], ref_eval["score"], ev)
    return [Check(name="eval_metric", passed=ok, reason=reason)], evaluation, ref_eval


def candidate_differences(policy, run: Run) -> dict:
    """What the candidate's own store names of an evaluation that differs from the policy in force: its
    manifest's `[eval]` keys and its lock's data path and working directory (reported, never run)."""
    ev = run.manifest_doc.get("eval")
    resolved = run.lock_info.resolved
    stated = {}
    if isinstance(ev, dict):
        from disttrace.gate.policy import USER_EVAL_KEYS

        stated.update({k: ev[k] for k in USER_EVAL_KEYS if k in ev})
    if isinstance(resolved, dict):
        for mine, theirs in (("data", "eval_data"), ("cwd", "eval_cwd")):
            if theirs in resolved:
                stated[mine] = resolved[theirs]
    out = {}
    for k, v in stated.items():
        if v != getattr(policy.eval, k, None):
            out[f"eval.{k}"] = v
    return out


def flag(differences: dict, source: str) -> str:
    """The verdict's one flag for a candidate store that names an evaluation of its own."""
    names = ", ".join(differences)
    command = differences.get("eval.command")
    what = f" (command {command!r})" if command is not None else ""
    return (
        f"the candidate's store names its own evaluation{what}: {names} differ from the policy's; "
        f"ignored, never run: the evaluation comes from the {source}"
    )
