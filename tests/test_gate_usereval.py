"""The user's own evaluation in the gate (gate/usereval.py), the parts that need no run: the command's
runner on programs that hang, crash or print no metric (the oracle: what each planted program does), the
comparison rule against its formula, the policy's [eval] validation and the held-out data's hash. The
end-to-end cases (an attached DDP script, an HF Trainer run) are in test_gate_usereval_runs.py."""

from __future__ import annotations

import hashlib
import os
import sys
import time
from types import SimpleNamespace

import pytest

from disttrace.errors import BadInput
from disttrace.gate import usereval
from disttrace.gate.policy import EvalPolicy, GatePolicy, from_manifest, read_policy

ENV = {"PATH": os.environ.get("PATH", os.defpath)}


def score(code: str, timeout_s: float = 30, metric: str = "eval_loss"):
    return usereval.run_command([sys.executable, "-c", code], ".", ENV, timeout_s, metric)


def failure(code: str, **kw) -> str:
    with pytest.raises(usereval.EvalFailure) as e:
        score(code, **kw)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


def test_the_metric_is_read_from_the_last_line():
    s, doc = score('print("loading..."); print(\'{"eval_loss": 1.25, "n": 3}\'); print()')
    assert s == 1.25 and doc == {"eval_loss": 1.25, "n": 3}


def test_a_command_that_hangs_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "pid"
    code = (
        "import subprocess, sys, time;"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)"
    )
    t0 = time.monotonic()
    msg = failure(code, timeout_s=2)
    assert time.monotonic() - t0 < 20
    assert msg == "the evaluation command ran past its timeout (2 s) and was killed"
    pid = int(pidfile.read_text())
    for _ in range(50):  # the kill is delivered; the process table catches up
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {pid} started by the hung command is still alive")


def test_a_command_that_crashes_fails_with_its_last_error_line():
    msg = failure("import sys; raise SystemExit('boom: the checkpoint is missing a key')")
    assert msg == "the evaluation command exited 1: boom: the checkpoint is missing a key"
    msg = failure("raise ValueError('bad shape')")
    assert msg == "the evaluation command exited 1: ValueError: bad shape"
    msg = failure("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert msg == "the evaluation command killed by signal 9: no output"


def test_a_command_that_prints_no_metric_fails():
    assert failure("pass") == "the evaluation command printed nothing (expected a JSON line last)"
    assert "is not a JSON object: 'loss is 1.0'" in failure("print('loss is 1.0')")
    assert "is not a JSON object" in failure("print('[1.0]')")
    assert failure("print('{\"loss\": 1.0}')") == (
        "the evaluation's JSON line has no 'eval_loss' (its keys: loss)"
    )
    # the metric line printed before other output is not the last line
    assert "is not a JSON object" in failure('print(\'{"eval_loss": 1.0}\'); print("done")')


def test_a_metric_that_is_not_a_finite_number_fails():
    assert failure("print('{\"eval_loss\": NaN}')") == "eval_loss is not finite: nan"
    assert failure("import json; print(json.dumps({'eval_loss': float('-inf')}))") == (
        "eval_loss is not finite: -inf"
    )
    assert failure("print('{\"eval_loss\": null}')") == "eval_loss is not a number: None"
    assert failure("print('{\"eval_loss\": true}')") == "eval_loss is not a number: True"
    assert failure('print(\'{"eval_loss": "1.0"}\')') == "eval_loss is not a number: '1.0'"
    assert failure("print('{\"eval_loss\": 1e999}')") == "eval_loss is not finite: inf"


def test_a_command_that_cannot_start_fails():
    with pytest.raises(usereval.EvalFailure, match="cannot start: /nonexistent/python"):
        usereval.run_command(["/nonexistent/python"], ".", ENV, 5, "eval_loss")


def test_the_environment_is_empty_apart_from_path_and_the_names_passed(monkeypatch):
    monkeypatch.setenv("DT_SECRET", "x")
    monkeypatch.setenv("DT_PASSED", "y")
    ev = SimpleNamespace(env=["DT_PASSED", "DT_ABSENT"])
    env = usereval.environment(ev)
    assert env == {"PATH": os.environ["PATH"], "DT_PASSED": "y"}
    _, doc = usereval.run_command(
        [
            sys.executable,
            "-c",
            "import json, os; print(json.dumps({'m': 1, 'env': dict(os.environ)}))",
        ],
        ".",
        env,
        30,
        "m",
    )
    assert "DT_SECRET" not in doc["env"] and doc["env"]["DT_PASSED"] == "y"


def ev(**kw) -> EvalPolicy:
    base = {"command": ["python", "e.py"], "data": "d", "data_sha256": "0" * 64}
    return EvalPolicy.model_validate({**base, **kw})


@pytest.mark.parametrize(
    "better,rtol,atol,cand,ref,expected",
    [
        ("lower", 0.01, 0.0, 2.0199, 2.0, True),  # 2.0199 <= 2.0 + 0.02
        ("lower", 0.01, 0.0, 2.0201, 2.0, False),
        ("lower", 0.01, 0.0, 1.0, 2.0, True),  # better than the reference: lower is better
        ("lower", 0.0, 0.5, 2.4, 2.0, True),
        ("higher", 0.01, 0.0, 0.891, 0.9, True),  # 0.891 >= 0.9 - 0.009
        ("higher", 0.01, 0.0, 0.8909, 0.9, False),
        ("higher", 0.01, 0.0, 0.2, 0.9, False),
        ("either", 0.01, 0.0, 1.0, 2.0, False),  # much lower is not "the same" under either
        ("either", 0.01, 0.0, 2.0199, 2.0, True),
        ("either", 0.01, 0.0, 1.9801, 2.0, True),
    ],
)
def test_the_rule_is_the_formula(better, rtol, atol, cand, ref, expected):
    e = ev(better=better, rtol=rtol, atol=atol)
    ok, reason = usereval.compare(cand, ref, e)
    allowed = atol + rtol * abs(ref)
    formula = {
        "lower": cand <= ref + allowed,
        "higher": cand >= ref - allowed,
        "either": abs(cand - ref) <= allowed,
    }[better]
    assert ok is expected is formula
    assert f"{cand:.6g}" in reason and f"{ref:.6g}" in reason and f"{better} is better" in reason


def test_rtol_falls_back_to_loss_rtol():
    assert ev().tolerance == (0.02, 0.0)
    assert ev(loss_rtol=0.1).tolerance == (0.1, 0.0)
    assert ev(loss_rtol=0.1, rtol=0.001, atol=1).tolerance == (0.001, 1.0)


def test_a_policy_file_names_the_file_and_field(tmp_path):
    p = tmp_path / "policy.toml"
    p.write_text('[eval]\ncommand = ["python", "eval.py"]\n')
    with pytest.raises(BadInput, match=r"policy.toml.*eval.*data_sha256"):
        read_policy(p)
    p.write_text('[eval]\ncommand = []\ndata = "d"\ndata_sha256 = "' + "0" * 64 + '"\n')
    with pytest.raises(BadInput, match=r"eval\.command.*names no program"):
        read_policy(p)
    p.write_text('[eval]\ncommand = ["x"]\ndata = "d"\ndata_sha256 = "abc"\n')
    with pytest.raises(BadInput, match=r"eval\.data_sha256.*not a sha256"):
        read_policy(p)
    p.write_text(
        '[eval]\ncommand = ["x"]\ndata = "d"\ndata_sha256 = "' + "0" * 64 + '"\nenv = ["A B"]\n'
    )
    with pytest.raises(BadInput, match=r"eval\.env"):
        read_policy(p)
    p.write_text(
        '[eval]\ncommand = ["x"]\ndata = "d"\ndata_sha256 = "' + "0" * 64 + '"\nbetter = "up"\n'
    )
    with pytest.raises(BadInput, match=r"eval\.better"):
        read_policy(p)


def test_a_manifest_names_the_evaluation_with_the_locks_paths():
    manifest = {"eval": {"command": ["python", "e.py"], "data_sha256": "a" * 64, "rtol": 0.5}}
    pol = from_manifest(manifest, "lock", {"eval_data": "/d", "eval_cwd": "/w"})
    assert (pol.eval.command, pol.eval.data, pol.eval.cwd, pol.eval.rtol) == (
        ["python", "e.py"],
        "/d",
        "/w",
        0.5,
    )
    assert from_manifest({"eval": {"loss_rtol": 0.1}}, "lock").eval.command is None
    with pytest.raises(BadInput, match="manifest.eval"):
        from_manifest({"eval": {"command": ["x"], "data_sha256": "a" * 64}}, "lock", {})


def test_the_data_hash_of_a_file_and_of_a_directory(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_bytes(b"[1, 2]\n")
    assert usereval.data_sha256(f) == hashlib.sha256(b"[1, 2]\n").hexdigest()
    d = tmp_path / "split"
    (d / "sub").mkdir(parents=True)
    (d / "b.arrow").write_bytes(b"BB")
    (d / "sub" / "c").write_bytes(b"C")
    want = hashlib.sha256()
    for rel, data in (("b.arrow", b"BB"), ("sub/c", b"C")):
        want.update(f"{rel}\0{hashlib.sha256(data).hexdigest()}\0".encode())
    assert usereval.data_sha256(d) == want.hexdigest()
    (d / "sub" / "c").write_bytes(b"D")  # one byte of one file changes the directory's value
    assert usereval.data_sha256(d) != want.hexdigest()
    (tmp_path / "link").symlink_to(f)
    with pytest.raises(usereval.EvalFailure, match="symlink"):
        usereval.data_sha256(tmp_path / "link")


def test_a_candidate_naming_its_own_evaluation_is_reported():
    policy = GatePolicy(eval=ev(cwd="/w", data="/d"))
    own = {"command": ["python", "-c", "print(0)"], "data_sha256": "b" * 64}
    run = SimpleNamespace(
        manifest_doc={"eval": own},
        lock_info=SimpleNamespace(resolved={"eval_data": "/other", "eval_cwd": "/w"}),
    )
    diff = usereval.candidate_differences(policy, run)
    assert diff == {
        "eval.command": own["command"],
        "eval.data_sha256": "b" * 64,
        "eval.data": "/other",
    }
    flag = usereval.flag(diff, "reference manifest X")
    assert "ignored, never run" in flag and "print(0)" in flag
    same = SimpleNamespace(
        manifest_doc={"eval": {"command": ["python", "e.py"], "data_sha256": "0" * 64}},
        lock_info=SimpleNamespace(resolved={"eval_data": "/d", "eval_cwd": "/w"}),
    )
    assert usereval.candidate_differences(policy, same) == {}


def test_attach_fixes_the_evaluation_and_refuses_a_bad_one(tmp_path, monkeypatch):
    from disttrace.run.attach import evaluation_section

    monkeypatch.chdir(tmp_path)
    (tmp_path / "heldout.jsonl").write_bytes(b"[3]\n")
    sha = hashlib.sha256(b"[3]\n").hexdigest()
    section, resolved = evaluation_section(
        {"command": ("python", "eval.py", "{checkpoint}"), "data": "heldout.jsonl", "timeout_s": 5}
    )
    assert section == {
        "command": ["python", "eval.py", "{checkpoint}"],
        "timeout_s": 5,
        "env": [],
        "data_sha256": sha,
    }
    assert resolved == {"eval_data": str(tmp_path / "heldout.jsonl"), "eval_cwd": str(tmp_path)}
    for spec, field in (
        ({"command": ["python"]}, "data"),
        ({"command": ["python"], "data": "missing.jsonl"}, "data"),
        ({"command": ["python"], "data": "heldout.jsonl", "data_sha256": "0" * 64}, "data_sha256"),
        ({"command": ["python"], "data": "heldout.jsonl", "metrc": "x"}, "metrc"),
        ({"command": ["python"], "data": "heldout.jsonl", "better": "up"}, "better"),
        ({"data": "heldout.jsonl"}, "command"),
    ):
        with pytest.raises(BadInput) as e:
            evaluation_section(spec)
        assert e.value.field == field and "attach(evaluation=)" in str(e.value), (spec, e.value)
