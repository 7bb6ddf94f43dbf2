"""`disttrace verify`, the step hash chain and the COMPLETE seal, and diff's hash check of the
steps it skips. One real reference run (shared through the session cache); every test edits its own copy.

The oracle for "intact" is an independent recomputation, here, of the documented format (sha256 of each
step's raw bytes; each line's chain = sha256(previous chain + "\\n" + the line's sorted-key JSON without
`chain`)), not the tool's own output."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import orjson
import pytest
from conftest import cli


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


def _copy(ref: Path, tmp: Path) -> Path:
    dst = tmp / "runs" / ref.parent.name / ref.name
    shutil.copytree(ref, dst, symlinks=True)
    return dst


def _index(run: Path, rank: int) -> list[dict]:
    return [
        orjson.loads(x)
        for x in (run / f"trajectory/rank-{rank:05d}.steps.jsonl").read_bytes().splitlines()
        if x
    ]


def _chain(prev: str, entry: dict) -> str:
    body = {k: v for k, v in entry.items() if k != "chain"}
    return hashlib.sha256(
        prev.encode() + b"\n" + orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    ).hexdigest()


def _genesis(rank: int) -> str:
    return hashlib.sha256(f"disttrace-steps-v1:rank-{rank:05d}".encode()).hexdigest()


def _verify(run: Path, expect: int) -> tuple[str, dict]:
    proc = cli("verify", run, check=expect)
    doc = orjson.loads(cli("verify", run, "--json", check=expect).stdout)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0], doc


def test_an_intact_run_verifies_and_its_hashes_are_what_the_format_says(ref):
    line, doc = _verify(ref, 0)
    assert line.startswith("intact") and doc["status"] == "intact" and doc["damage"] == []
    complete = orjson.loads((ref / "COMPLETE").read_bytes())
    for rank in (0, 1):
        data = (ref / f"trajectory/rank-{rank:05d}.arrows").read_bytes()
        prev, end = _genesis(rank), 0
        entries = _index(ref, rank)
        assert [e["step"] for e in entries] == [1, 2, 3, 4]
        for e in entries:
            assert e["offset"] == end  # contiguous: nothing between steps
            assert (
                hashlib.sha256(data[e["offset"] : e["offset"] + e["length"]]).hexdigest()
                == e["sha256"]
            )
            assert _chain(prev, e) == e["chain"]
            prev, end = e["chain"], e["offset"] + e["length"]
        assert (
            data[end:] == b"\xff\xff\xff\xff\x00\x00\x00\x00"
        )  # the stream's end marker, nothing else
        assert complete["seal"]["chains"][f"{rank:05d}"] == {"chain": prev, "steps": 4}
    for name in (
        "manifest.lock.json",
        "run.json",
        "topology.json",
        "replicas.json",
        "checkpoints/step-000002/INDEX.json",
        "trajectory/rank-00001.steps.jsonl",
    ):
        want = complete["seal"]["files"][name]
        assert hashlib.sha256((ref / name).read_bytes()).hexdigest() == want["sha256"], name


def _step_range(run: Path, rank: int, step: int) -> tuple[int, int]:
    e = next(e for e in _index(run, rank) if e["step"] == step)
    return e["offset"], e["length"]


def _edit_a_byte_of_step(run: Path, rank: int, step: int) -> None:
    """Flip one bit in the middle of that step's bytes (the file keeps its length)."""
    path = run / f"trajectory/rank-{rank:05d}.arrows"
    data = bytearray(path.read_bytes())
    off, length = _step_range(run, rank, step)
    data[off + length // 2] ^= 0x10
    path.write_bytes(bytes(data))


def test_an_edited_trajectory_byte_is_damage_and_never_diffs_equal(ref, tmp_path):
    run = _copy(ref, tmp_path)
    _edit_a_byte_of_step(run, 1, 3)
    line, doc = _verify(run, 1)
    assert (
        line.startswith("damaged") and "trajectory/rank-00001.arrows" in line and "step 3" in line
    ), line
    assert (
        doc["first_damage"]["file"] == "trajectory/rank-00001.arrows"
        and doc["first_damage"]["step"] == 3
    )
    # diff skips step 3 by the index (its digests are unchanged): it must check the bytes, not call it equal
    proc = cli("diff", ref, run)
    assert (
        proc.returncode == 2 and "rank-00001.arrows" in proc.stderr and "step 3" in proc.stderr
    ), proc.stderr
    proc = cli("diff", ref, run, "--json")
    assert proc.returncode == 2 and '"equal": true' not in proc.stdout


def test_a_removed_step_line_breaks_the_chain(ref, tmp_path):
    run = _copy(ref, tmp_path)
    idx = run / "trajectory/rank-00000.steps.jsonl"
    lines = idx.read_bytes().splitlines(keepends=True)
    idx.write_bytes(b"".join(ln for ln in lines if orjson.loads(ln)["step"] != 2))
    line, doc = _verify(run, 1)
    assert "trajectory/rank-00000.steps.jsonl" in line and "step 3" in line, line
    assert cli("diff", ref, run).returncode == 2  # refused as damaged input, never compared


def test_a_removed_last_step_is_caught_by_the_seal(ref, tmp_path):
    run = _copy(ref, tmp_path)
    idx, traj = run / "trajectory/rank-00000.steps.jsonl", run / "trajectory/rank-00000.arrows"
    lines = idx.read_bytes().splitlines(keepends=True)
    off, _ = _step_range(run, 0, 4)
    idx.write_bytes(
        b"".join(lines[:-1])
    )  # the chain of steps 1-3 is intact; only the seal knows of step 4
    traj.write_bytes(traj.read_bytes()[:off])
    line, doc = _verify(run, 1)
    assert "trajectory/rank-00000.steps.jsonl" in line and "step 3" in line and "seal" in line, line


def test_reordered_steps_break_the_chain(ref, tmp_path):
    run = _copy(ref, tmp_path)
    idx = run / "trajectory/rank-00001.steps.jsonl"
    lines = idx.read_bytes().splitlines(keepends=True)
    lines[1], lines[2] = lines[2], lines[1]
    idx.write_bytes(b"".join(lines))
    line, doc = _verify(run, 1)
    assert "trajectory/rank-00001.steps.jsonl" in line and "step 3" in line, line


def test_an_edited_run_json_is_damage(ref, tmp_path):
    run = _copy(ref, tmp_path)
    info = orjson.loads((run / "run.json").read_bytes())
    info["path"] = "fault"
    (run / "run.json").write_bytes(orjson.dumps(info))
    line, doc = _verify(run, 1)
    assert line.startswith("damaged: run.json:"), line


def _rechain(run: Path, rank: int) -> None:
    """What a writer who rewrites every hash of the index (but not the seal) would do."""
    idx = run / f"trajectory/rank-{rank:05d}.steps.jsonl"
    data = (run / f"trajectory/rank-{rank:05d}.arrows").read_bytes()
    prev, out = _genesis(rank), []
    for e in _index(run, rank):
        e["sha256"] = hashlib.sha256(data[e["offset"] : e["offset"] + e["length"]]).hexdigest()
        e.pop("chain", None)
        e["chain"] = prev = _chain(prev, e)
        out.append(orjson.dumps(e) + b"\n")
    idx.write_bytes(b"".join(out))


def test_a_rewritten_chain_is_still_caught_by_the_seal(ref, tmp_path):
    run = _copy(ref, tmp_path)
    _edit_a_byte_of_step(run, 1, 2)
    _rechain(run, 1)
    line, doc = _verify(run, 1)
    assert "trajectory/rank-00001" in line and "seal" in line, line
    files = {d["file"] for d in doc["damage"]}
    assert "trajectory/rank-00001.arrows" in files


def test_an_edited_index_digest_breaks_the_chain_for_diff_too(ref, tmp_path):
    run = _copy(ref, tmp_path)
    idx = run / "trajectory/rank-00000.steps.jsonl"
    lines = [orjson.loads(x) for x in idx.read_bytes().splitlines()]
    lines[1]["digest"] = "0" * 32
    idx.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
    proc = cli("diff", ref, run)
    assert (
        proc.returncode == 2 and "rank-00000.steps.jsonl" in proc.stderr and "chain" in proc.stderr
    ), proc.stderr


def test_unsealed_and_not_a_run(ref, tmp_path):
    run = _copy(ref, tmp_path)
    done = orjson.loads((run / "COMPLETE").read_bytes())
    del done["seal"]
    (run / "COMPLETE").write_bytes(orjson.dumps(done))
    line, doc = _verify(run, 1)
    assert line.startswith("unsealed") and doc["status"] == "unsealed"
    proc = cli("verify", tmp_path, check=2)
    assert "manifest.lock.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_file_added_to_a_rank_directory_is_damage(ref, tmp_path):
    run = _copy(ref, tmp_path)
    shutil.copy(run / "trajectory/rank-00001.arrows", run / "trajectory/rank-00002.arrows")
    line, _ = _verify(run, 1)
    assert "rank-00002" in line, line
