"""The `--json` documents are a contract: the typed results print exactly the bytes the commands printed
when results were plain dicts. tests/golden/ holds those documents, written by the dict-returning code (the
numeric diff, verify and gate documents were written again, and reviewed field by field, when the
magnitude-scaled bound and the gate's binding legitimately changed their contents; DISTTRACE_WRITE_GOLDEN=1
rewrites them) on runs made by the same command lines as the session's (`runs.reference()`, `runs.fault("bitflip-grad", 3,
1)`, ZeRO-1); runs of one manifest are bit-identical, so only the run directories differ, and those are
replaced by a name on both sides.

Bit-identical on one machine: another processor's kernels (its vector width, its BLAS code path) round
differently, and every digest, sum and count of differing records follows. So the goldens carry the
fingerprint of the machine's float results they were written with (NUMERICS.json: the reference run's
digest of its last step), and a document that depends on the trained values is compared only where the
fingerprint matches; elsewhere the test skips, saying so (DISTTRACE_WRITE_GOLDEN=1 rewrites them there, to
be reviewed as values only). The plan documents, theory alone, are compared everywhere."""

from __future__ import annotations

import os
import re
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, cli

from disttrace.analysis.diff import diff_runs
from disttrace.jsondoc import dumps

GOLDEN = Path(__file__).parent / "golden"
ZERO1 = ("--set", "parallelism.zero_stage=1")


NUMERICS = GOLDEN / "NUMERICS.json"


def _fingerprint(run: Path) -> str:
    """The machine's float results as one value: the reference run's digest of its last step (rank 0)."""
    lines = (run / "trajectory" / "rank-00000.steps.jsonl").read_bytes().splitlines()
    return orjson.loads(lines[-1])["digest"]


@pytest.fixture(scope="module")
def named(runs) -> dict[str, Path]:
    return {
        "<REF>": runs.reference(),
        "<FAULT>": runs.fault("bitflip-grad", 3, 1),
        "<ZERO1>": runs.reference(*ZERO1),
    }


@pytest.fixture(scope="module")
def same_numerics(named) -> None:
    """Skip a trained-value document where this machine's float results are not the goldens'."""
    here = _fingerprint(named["<REF>"])
    if os.environ.get("DISTTRACE_WRITE_GOLDEN"):
        NUMERICS.write_bytes(orjson.dumps({"reference_last_step_digest": here}) + b"\n")
        return
    written = orjson.loads(NUMERICS.read_bytes())["reference_last_step_digest"]
    if here != written:
        pytest.skip(
            f"the goldens were written on a machine whose float results differ (reference digest "
            f"{written}, here {here}): DISTTRACE_WRITE_GOLDEN=1 rewrites them here; review that only "
            "values changed"
        )


def _named(text: str, named: dict[str, Path]) -> str:
    for name, path in sorted(named.items(), key=lambda kv: -len(str(kv[1]))):
        text = text.replace(str(path), name)
    return text.replace(str(ROOT), "<ROOT>")


def _golden(name: str) -> str:
    return (GOLDEN / f"{name}.json").read_text()


# (document, A, B, diff_runs keywords); the `diff-*` ones are also what `disttrace diff --json` printed
DIFFS = [
    ("diff-bitwise-equal", "<REF>", "<REF>", {}),
    ("diff-bitwise-fault", "<REF>", "<FAULT>", {}),
    ("diff-numeric-fault", "<REF>", "<FAULT>", {"mode": "numeric"}),
    ("diff-numeric-zero1", "<REF>", "<ZERO1>", {}),
    ("diff-user-zero1", "<REF>", "<ZERO1>", {"rtol": 1e-3}),
    ("diff-user-atol-fault", "<REF>", "<FAULT>", {"rtol": 1e-3, "atol": 1e-9}),
    ("api-diff-no-propagate-fault", "<REF>", "<FAULT>", {"propagate": False}),
    ("api-diff-no-index-fault", "<REF>", "<FAULT>", {"use_index": False}),
    (
        "api-diff-numeric-no-propagate-fault",
        "<REF>",
        "<FAULT>",
        {"mode": "numeric", "propagate": False},
    ),
    ("api-diff-fault-reversed", "<FAULT>", "<REF>", {}),
    ("api-diff-zero1-reversed", "<ZERO1>", "<REF>", {}),
]


@pytest.mark.parametrize("name,a,b,kw", DIFFS, ids=[d[0] for d in DIFFS])
def test_diff_result_prints_the_stored_document(named, same_numerics, name, a, b, kw):
    result = diff_runs(named[a], named[b], **kw)
    if os.environ.get(
        "DISTTRACE_WRITE_GOLDEN"
    ):  # a deliberate change of the contract: rewrite, then review
        (GOLDEN / f"{name}.json").write_text(_named(result.to_json(), named))
    assert _named(result.to_json(), named) == _golden(name)


def test_the_cli_prints_to_json(named, same_numerics):
    """`disttrace diff --json` is the result's to_json(), nothing added."""
    proc = cli("diff", named["<REF>"], named["<FAULT>"], "--mode", "numeric", "--json")
    assert proc.returncode == 1
    assert _named(proc.stdout, named) == _golden("diff-numeric-fault")


# (document, command line with run names); the gate's time and evaluation key (a hash of checkpoint bytes,
# which hold the run's own path) differ run to run and are masked on both sides
COMMANDS = [
    ("check-ref", ["check", "<REF>"]),
    ("check-fault", ["check", "<FAULT>"]),
    ("check-zero1", ["check", "<ZERO1>"]),
    ("verify-ref", ["verify", "<REF>"]),
    ("plan-default", ["plan", "<ROOT>/manifests/default.toml"]),
    (
        "plan-params",
        ["plan", "--params", "7B", "--dp", "8", "--tp", "2", "--pp", "2", "--zero-stage", "3"]
        + ["--seq", "2048", "--hidden", "4096", "--heads", "32", "--layers", "32"]
        + ["--micro-batches", "8"],
    ),
    ("gate-ref", ["gate", "<REF>", "--reference", "<REF>"]),
    ("gate-fault", ["gate", "<FAULT>", "--reference", "<REF>"]),
]
VOLATILE = re.compile(r'("(?:time|evaluation_key)": )[^,\n]+')


@pytest.mark.parametrize("name,args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_command_prints_the_stored_document(named, name, args, request):
    if not name.startswith("plan-"):
        request.getfixturevalue("same_numerics")
    where = {**{k: str(v) for k, v in named.items()}, "<ROOT>": str(ROOT)}
    argv = [where.get(a, a.replace("<ROOT>", str(ROOT))) for a in args]
    proc = cli(*argv, "--json", timeout=600)
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    got = VOLATILE.sub(r'\1"<VOLATILE>"', _named(proc.stdout, named))
    if os.environ.get(
        "DISTTRACE_WRITE_GOLDEN"
    ):  # a deliberate change of the contract: rewrite, then review
        (GOLDEN / f"{name}.json").write_text(got)
    want = _golden(name)
    if name.startswith("gate-"):
        got, want = _gate_comparable(got), _gate_comparable(want)
    assert got == want


def _gate_comparable(text: str) -> str:
    """The evaluations' keys come in the evaluator's order when it ran, sorted when the gate's cache
    answered (gate/evalcache.py): the same document either way, so both are compared sorted. A straggler
    flag is wall-clock timing (analysis/sync.py): a loaded machine raises one on any run, so it is left out
    of the comparison (tests/test_scale_readers.py and tests/test_gate_lab.py hold the straggler rule)."""
    doc = orjson.loads(text)
    if isinstance(doc.get("flags"), list):
        doc["flags"] = [f for f in doc["flags"] if not str(f).startswith("straggler: ")]
    for k in ("eval", "reference_eval"):
        if isinstance(doc.get(k), dict):
            doc[k] = orjson.loads(orjson.dumps(doc[k], option=orjson.OPT_SORT_KEYS))
    return dumps(doc)
