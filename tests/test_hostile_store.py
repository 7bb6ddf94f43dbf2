"""Reading a run store its writer crafted to hang, exhaust or mislead the reader (docs/design.md, "Trust").

Each store is a copy of a real reference run with one thing done to it as an attacker would: a FIFO in place
of a file (a reader that opens it blocks forever), a link to /dev/zero or /dev/urandom or to a file outside
the store, an 8 GB sparse file, a trajectory of LZ4 bombs (each buffer within LZ4's own expansion, so only a
cap on a step's total catches it), a seal entry naming a path of the machine. Every command that reads the
file must answer exit 1 (`verify`: damage) or 2 (bad input) with the file named; and every command, whatever
it reads, must end (each store's commands run under an alarm), stay within a memory bound (the peak resident
set, measured by getrusage in the process that ran them, against the same commands on the pristine copy),
leave the files outside the store unread (their access time, set in the past, unchanged) and print no raw
control character.

The oracle for "refused" is not our code: it is the exit code, the stderr line, the clock and the kernel's
accounting of memory and access times.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from conftest import ROOT, raw_records, rewrite_trajectory

from disttrace.fmt import _INVISIBLE

SECRET = "OUTSIDE-SECRET-7f3a"
GiB = 1 << 30
# what the commands on a crafted store may hold beyond what they hold on the pristine copy: an 8 GB file
# read, /dev/zero read to its limit, or one LZ4 bomb's step decoded would each be far more
MEMORY_SLACK_MIB = 160
ALARM_S = 60  # one store's commands; a FIFO opened blocking would wait forever

# the commands of one store: what each must answer, per case below (None: any exit but 3 and a crash)
COMMANDS = {
    "show": ["show", "{S}"],
    "events": ["show", "{S}", "events"],
    "verify": ["verify", "{S}"],
    "check": ["check", "{S}"],
    "diff": ["diff", "{R}", "{S}"],
    "checkpoints": ["show", "{S}", "checkpoints"],
}

# The driver: imports disttrace once, then forks one child per store, which runs that store's commands
# in-process (typer's CliRunner) under an alarm and reports its own peak resident set.
DRIVER = r"""
import json, os, resource, signal, sys
from typer.testing import CliRunner
from disttrace.cli.shared import app

cases = json.loads(open(sys.argv[1]).read())
runner = CliRunner()
for case in cases:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        signal.alarm(case["alarm"])
        out = []
        for name, args in case["commands"]:
            res = runner.invoke(app, args, env={"NO_COLOR": "1", "COLUMNS": "200"})
            exc = res.exception
            crash = None if exc is None or isinstance(exc, SystemExit) else repr(exc)
            out.append({"command": name, "rc": res.exit_code, "stdout": res.stdout,
                        "stderr": res.stderr, "crash": crash})
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with os.fdopen(w, "wb") as f:
            f.write(json.dumps({"results": out, "peak_kib": peak}).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    doc = json.loads(data) if data else {}
    print(json.dumps({"name": case["name"], "status": status, **doc}), flush=True)
"""


def _copy(ref: Path, root: Path, name: str) -> Path:
    dst = root / name / ref.parent.name / ref.name
    shutil.copytree(ref, dst, symlinks=True)
    return dst


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _link(p: Path, target: Path | str) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    else:
        p.unlink()
    p.symlink_to(target)


def _sparse(p: Path, size: int = 8 * GiB) -> None:
    with open(p, "r+b") as f:
        f.truncate(size)


def _bomb(run: Path) -> None:
    """The trajectory of rank 0 as four steps of one data record each, whose sample ids are 8M zeros: 64 MB a
    step once decoded, from ~256 KB of LZ4 (every buffer within LZ4's ~255-fold bound); with a step index
    (offsets and lengths right, no hashes: a writer that leaves them out is read the same way)."""
    from disttrace.store.trajectory_write import TrajectoryWriter

    rec = next(r for r in raw_records(run, 0) if r["phase"] == "data")
    (run / TRAJ).unlink()
    w = TrajectoryWriter(run / TRAJ)
    index = b""
    for step in (1, 2, 3, 4):
        offset = w.offset
        n = len(w.write_step([{**rec, "step": step, "samples": [0] * (8 << 20)}]))
        index += orjson.dumps({"step": step, "offset": offset, "length": n, "records": 1}) + b"\n"
    w.close()
    (run / INDEX).write_bytes(index)


def _seal_names(run: Path, outside: Path) -> None:
    done = orjson.loads((run / "COMPLETE").read_bytes())
    entry = {"sha256": "0" * 64, "bytes": 5}
    done["seal"]["files"][str(outside)] = entry  # an absolute path
    done["seal"]["files"][f"../../../{outside.name}"] = entry  # a climb out
    (run / "COMPLETE").write_bytes(orjson.dumps(done))


TRAJ = "trajectory/rank-00000.arrows"
INDEX = "trajectory/rank-00000.steps.jsonl"
CKPT = "checkpoints/step-000002"

# name -> (what is done to the copy, {command: exit codes it may answer}, the file the refusal names)
REFUSE = {1, 2}
ALL_REFUSE = dict.fromkeys(COMMANDS, REFUSE)
CASES = {
    "fifo-lock": (lambda r, o: _fifo(r / "manifest.lock.json"), ALL_REFUSE, "manifest.lock.json"),
    "fifo-trajectory": (
        lambda r, o: _fifo(r / TRAJ),
        {"show": REFUSE, "verify": {1}, "check": REFUSE, "diff": REFUSE},
        "rank-00000.arrows",
    ),
    "fifo-step-index": (
        lambda r, o: _fifo(r / INDEX),
        {"show": REFUSE, "verify": {1}, "check": REFUSE, "diff": REFUSE},
        "rank-00000.steps.jsonl",
    ),
    "fifo-complete": (
        lambda r, o: _fifo(r / "COMPLETE"),
        {"show": REFUSE, "verify": {1}, "diff": REFUSE},
        "COMPLETE",
    ),
    "fifo-checkpoint-index": (
        lambda r, o: _fifo(r / CKPT / "INDEX.json"),
        {"verify": {1}, "checkpoints": {1}},
        "INDEX.json",
    ),
    "fifo-events": (
        lambda r, o: _fifo(r / "events.jsonl"),
        {"events": REFUSE, "verify": {1}},
        "events.jsonl",
    ),
    "devzero-lock": (
        lambda r, o: _link(r / "manifest.lock.json", "/dev/zero"),
        ALL_REFUSE,
        "manifest.lock.json",
    ),
    "urandom-trajectory": (
        lambda r, o: _link(r / TRAJ, "/dev/urandom"),
        {"show": REFUSE, "verify": {1}, "check": REFUSE, "diff": REFUSE},
        "rank-00000.arrows",
    ),
    "sparse-lock": (
        lambda r, o: _sparse(r / "manifest.lock.json"),
        ALL_REFUSE,
        "manifest.lock.json",
    ),
    "sparse-step-index": (
        lambda r, o: _sparse(r / INDEX),
        {"show": REFUSE, "verify": {1}, "check": REFUSE, "diff": REFUSE},
        "rank-00000.steps.jsonl",
    ),
    "sparse-trajectory": (lambda r, o: _sparse(r / TRAJ), {"verify": {1}}, "rank-00000.arrows"),
    "sparse-events": (lambda r, o: _sparse(r / "events.jsonl"), {"events": REFUSE}, "events.jsonl"),
    "lz4-bomb": (
        lambda r, o: _bomb(r),
        {"show": REFUSE, "verify": {1}, "check": REFUSE, "diff": REFUSE},
        "rank-00000",
    ),
    "outside-events": (
        lambda r, o: _link(r / "events.jsonl", o / "events.jsonl"),
        {"events": REFUSE, "verify": {1}},
        "events.jsonl",
    ),
    "outside-checkpoint": (
        lambda r, o: _link(r / CKPT, o / "step-000002"),
        {"verify": {1}, "checkpoints": {1}},
        "step-000002",
    ),
    "outside-seal-entry": (
        lambda r, o: _seal_names(r, o / "events.jsonl"),
        {"verify": {1}},
        "COMPLETE",
    ),
}


# the default tier's cases: one store per class (FIFO, device link, sparse file, bomb, outside link, seal
# entry); the slow tier runs every case above with every command
DEFAULT_CASES = (
    "fifo-lock",
    "fifo-trajectory",
    "devzero-lock",
    "sparse-lock",
    "sparse-step-index",
    "lz4-bomb",
    "outside-events",
    "outside-checkpoint",
    "outside-seal-entry",
)


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


def _outside(root: Path, ref: Path) -> Path:
    """Files outside every crafted store that links point at: their access time is set in the past, so any
    read of them shows."""
    out = root / "outside"
    out.mkdir()
    (out / "events.jsonl").write_text(json.dumps({"event": SECRET, "time": 1.0}) + "\n")
    shutil.copytree(ref / CKPT, out / "step-000002")
    return out


def _backdate(paths: list[Path]) -> None:
    now = time.time()
    for p in paths:
        os.utime(p, (now - 10 * 86400, now), follow_symlinks=False)


def _atime_counts(probe: Path) -> bool:
    """Whether this filesystem records reads (relatime updates an access time older than the change)."""
    probe.write_text("x")
    _backdate([probe])
    before = probe.stat().st_atime
    probe.read_text()
    return probe.stat().st_atime != before


def _drive(cases: list[dict], tmp: Path) -> dict[str, dict]:
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(spec)],
        capture_output=True,
        text=True,
        timeout=ALARM_S * len(cases) + 60,
        cwd=ROOT,
        # wide enough that a table cell never crops a long temporary path the tests look for
        env={**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "400"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {d["name"]: d for d in map(json.loads, proc.stdout.splitlines())}


RAW = {chr(c) for c in _INVISIBLE} - {"\n"}


@pytest.mark.parametrize(
    "every_command", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["reading", "all"]
)
def test_crafted_stores_are_refused_bounded_and_confined(ref, tmp_path, every_command):
    """The default tier runs one store of each class, with the commands that read the crafted file; the slow
    tier every store with every command (those that do not read it must still end, bounded, and print nothing
    raw)."""
    outside = _outside(tmp_path, ref)
    names = list(CASES) if every_command else list(DEFAULT_CASES)
    stores = {name: _copy(ref, tmp_path / "stores", name) for name in ["pristine", *names]}
    for name in names:
        CASES[name][0](stores[name], outside)
    watched = [outside / "events.jsonl", *(outside / "step-000002").iterdir()]
    _backdate(watched)
    atimes = {p: p.stat().st_atime for p in watched}
    cases = [
        {
            "name": name,
            "alarm": ALARM_S,
            "commands": [
                (c, [a.format(S=store, R=ref) for a in COMMANDS[c]])
                for c in COMMANDS
                if every_command or name == "pristine" or c in CASES[name][1]
            ],
        }
        for name, store in stores.items()
    ]
    got = _drive(cases, tmp_path)

    pristine = got["pristine"]
    assert pristine["status"] == 0
    assert all(r["rc"] == 0 for r in pristine["results"]), pristine["results"]
    baseline_mib = pristine["peak_kib"] / 1024
    for name in names:
        _, expect, named = CASES[name]
        case = got.get(name)
        assert case is not None and case["status"] == 0, (
            f"{name}: the commands did not end within {ALARM_S} s (status {case and case['status']})"
        )
        peak_mib = case["peak_kib"] / 1024
        assert peak_mib < baseline_mib + MEMORY_SLACK_MIB, (
            f"{name}: peak {peak_mib:.0f} MiB, pristine {baseline_mib:.0f} MiB"
        )
        for r in case["results"]:
            what = f"{name}: {r['command']} -> exit {r['rc']}\n{r['stderr'][-1500:]}"
            assert r["crash"] is None and r["rc"] != 3, what
            if r["command"] in expect:
                assert r["rc"] in expect[r["command"]], what
                assert named in r["stderr"], what
                if r["rc"] == 2:
                    assert len(r["stderr"].strip("\n").split("\n")) == 1, what
            text = r["stdout"] + r["stderr"]
            assert SECRET not in text, what
            assert not RAW & set(text), what
    if _atime_counts(tmp_path / "probe"):
        read = [str(p) for p in watched if p.stat().st_atime != atimes[p]]
        assert not read, f"files outside the stores were read: {read}"
    for store in stores.values():  # nothing of ours was left in a store by reading it
        assert not list(store.glob("**/*.tmp-*"))


# what a crafted name carries: an OSC 52 clipboard write, a screen clear and a cursor-home repaint, NUL, a C1
# CSI, and the right-to-left override
EVIL = "w\x1b]52;c;cGF5bG9hZA==\x07\x1b[2J\x1b[HPASS\x00\x9b31m\u202eSSAP"


def _strings(doc) -> set[str]:
    if isinstance(doc, str):
        return {doc}
    items = doc.values() if isinstance(doc, dict) else doc if isinstance(doc, list) else ()
    return set().union(*(_strings(x) for x in items)) if items else set()


def _evil_store(ref: Path, root: Path) -> Path:
    run = _copy(ref, root, "escapes")
    topo = orjson.loads((run / "topology.json").read_bytes())
    for r in topo["ranks"]:
        r["host"] = EVIL
    (run / "topology.json").write_bytes(orjson.dumps(topo))
    with open(run / "events.jsonl", "ab") as f:
        f.write(
            orjson.dumps({"event": "fault_fired", "time": 9.0, "fault": EVIL, "step": 2, "rank": 0})
            + b"\n"
        )
    # every tensor renamed, and one backward gradient of step 3 changed: diff names it as the first divergence
    for rank in (0, 1):
        recs = [{**r, "tensor": EVIL + r["tensor"]} for r in raw_records(run, rank)]
        if rank == 0:
            hit = next(r for r in recs if r["step"] == 3 and r["phase"] == "backward")
            hit["digest"] = hit["digest"][:-1] + ("0" if hit["digest"][-1] != "0" else "1")
        rewrite_trajectory(run, rank, recs)
    index = orjson.loads((run / CKPT / "INDEX.json").read_bytes())
    index["files"][EVIL] = {"sha256": "0" * 64, "bytes": 1}
    (run / CKPT / "INDEX.json").write_bytes(orjson.dumps(index))
    return run


def test_names_from_a_store_reach_the_terminal_escaped_and_json_exact(ref, tmp_path):
    run = _evil_store(ref, tmp_path)
    commands = {
        **COMMANDS,
        "md": ["diff", "{R}", "{S}", "--md"],
        "topology": ["show", "{S}", "topology"],
        "json": ["show", "{S}", "--json"],
        "events-json": ["show", "{S}", "events", "--json"],
    }
    case = {
        "name": "escapes",
        "alarm": ALARM_S,
        "commands": [(c, [a.format(S=run, R=ref) for a in args]) for c, args in commands.items()],
    }
    got = _drive([case], tmp_path)["escapes"]
    assert got["status"] == 0
    by = {r["command"]: r for r in got["results"]}
    for name, r in by.items():
        assert r["crash"] is None and r["rc"] != 3, (name, r["stderr"][-2000:])
        text = r["stdout"] + r["stderr"]
        if name.endswith("json"):
            continue
        assert not RAW & set(text), (name, [c for c in text if c in RAW][:5])
    # each command that prints a crafted name printed it, made visible (so the test saw it at all)
    shown = "w\\x1b]52;c;cGF5bG9hZA=="  # rich drops the BEL itself; a table cell may cut the rest
    for name in ("diff", "md", "topology", "events", "checkpoints"):
        assert shown in by[name]["stdout"] + by[name]["stderr"], (name, by[name]["stderr"][-1500:])
    assert by["diff"]["rc"] == 1 and by["md"]["rc"] == 1
    # --json stays exact: the very string, decoded
    assert EVIL in _strings(orjson.loads(by["events-json"]["stdout"]))


def _protocol0_store(ref: Path, root: Path, marker: Path) -> tuple[Path, str]:
    """A copy whose checkpoint of step 2 holds, in place of its `progress.step` item (a bytes item: DCP loads
    it with torch.load), a protocol-0 pickle of os.system (it starts with 'c', not b'\\x80' or 'PK'), padded
    to the item's length; the INDEX and the seal rewritten to agree (their writer controls them)."""
    import hashlib

    from disttrace.store.pickles import storage_items

    run = _copy(ref, root, "protocol0")
    ckpt = run / CKPT
    items = storage_items((ckpt / ".metadata").read_bytes())
    rel, off, length, _ = next(i for i in items if i[3] == "progress.step")
    payload = f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode()
    assert len(payload) <= length
    data = bytearray((ckpt / rel).read_bytes())
    data[off : off + length] = payload + b" " * (length - len(payload))
    (ckpt / rel).write_bytes(bytes(data))

    def sha(p: Path) -> dict:
        b = p.read_bytes()
        return {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)}

    index = orjson.loads((ckpt / "INDEX.json").read_bytes())
    index["files"][rel] = sha(ckpt / rel)
    (ckpt / "INDEX.json").write_bytes(orjson.dumps(index))
    done = orjson.loads((run / "COMPLETE").read_bytes())
    done["seal"]["files"][f"{CKPT}/INDEX.json"] = sha(ckpt / "INDEX.json")
    (run / "COMPLETE").write_bytes(orjson.dumps(done))
    return run, rel


def test_a_protocol_0_pickle_item_is_scanned_and_refused(ref, tmp_path):
    import pickle
    import pickletools

    marker = tmp_path / "MARKER"
    run, rel = _protocol0_store(ref, tmp_path, marker)
    item = pickle.dumps(
        0, protocol=0
    )  # the oracle that protocol 0 is what the payload is: not b"\x80"
    assert item[:1] != b"\x80" and next(pickletools.genops(item))[0].proto == 0
    case = {
        "name": "protocol0",
        "alarm": ALARM_S,
        "commands": [
            ("verify", ["verify", str(run)]),
            ("checkpoints", ["show", str(run), "checkpoints"]),
            ("recover", ["recover", str(run), "--from-step", "2", "--out", str(tmp_path / "out")]),
        ],
    }
    by = {r["command"]: r for r in _drive([case], tmp_path)["protocol0"]["results"]}
    assert by["verify"]["rc"] == 1 and by["checkpoints"]["rc"] == 1, by
    assert by["recover"]["rc"] == 2, by["recover"]
    for r in by.values():
        assert rel in r["stderr"] and "posix.system" in r["stderr"], r["stderr"][-1500:]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_a_refusal_inside_a_rank_reaches_the_cli_as_bad_input(tmp_path):
    """A rank that refuses its input records it (the worker's rank_failed event carries `bad_input`); the
    launcher turns a rank's exit 2 with it into the same BadInput, exit 2, not 'the job failed'."""
    from disttrace.errors import BadInput
    from disttrace.run.job.launch import refused_input

    line = {
        "event": "rank_failed",
        "rank": 1,
        "error": "BadInput: ...",
        "bad_input": {
            "where": str(tmp_path / "checkpoints/step-000002/__1_0.distcp"),
            "field": None,
            "reason": "item progress.step is not plain data (global posix.system); refused unread",
        },
    }
    (tmp_path / "events.jsonl").write_bytes(orjson.dumps(line) + b"\n")
    bad = refused_input(tmp_path, {0: -15, 1: 2})
    assert isinstance(bad, BadInput) and bad.exit_code == 2
    assert "__1_0.distcp" in str(bad) and "posix.system" in str(bad)
    assert refused_input(tmp_path, {0: -15, 1: 1}) is None  # exit 1: a failure, not refused input


@pytest.mark.slow
def test_a_refusal_inside_a_job_is_exit_2_naming_the_file_and_global(ref, tmp_path):
    """The same protocol-0 item, met by a recovered job itself (its run directory prepared without the CLI's
    checkpoint choice, as another tool could): the rank refuses it, and `launch` raises the rank's BadInput
    (exit 2 at the CLI) naming the .distcp file and the global, not 'the job failed' (exit 3)."""
    from conftest import run_snippet

    marker = tmp_path / "MARKER"
    run, rel = _protocol0_store(ref, tmp_path, marker)
    code = f"""
from pathlib import Path
from disttrace.config.freezing import Frozen
from disttrace.errors import BadInput
from disttrace.run.job.launch import launch, prepare
from disttrace.run.job.recovery import resume_spec
from disttrace.store.rundir import Run
run = Path({str(run)!r})
frozen = Frozen.model_validate(Run(run).lock)
root = run.parent.parent
ckpt = run / {CKPT!r}
run_dir = prepare(frozen, root, "recovered", resume=resume_spec(frozen, root, ckpt, run))
try:
    launch(run_dir, quiet=True)
except BadInput as e:
    print("BadInput", e.exit_code, e)
"""
    proc = run_snippet(code, timeout=300)
    assert "BadInput 2" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert rel in proc.stdout and "posix.system" in proc.stdout, proc.stdout
    assert not marker.exists()


def _edit_topology(topo: dict) -> list[tuple[str, dict]]:
    """Edits of a real topology.json that each keep the document valid on its own (its sizes' product is
    the number of ranks it lists, every coordinate inside them): only the rest of the store can tell."""
    one_rank = [{**topo["ranks"][0], "coords": {"pp": 0, "dp": 0, "tp": 0}}]
    return [
        ("mesh_shape", {**topo, "mesh_shape": {}, "mesh_dims": [], "groups": {}, "ranks": []}),
        ("ranks", {**topo, "ranks": [*topo["ranks"][:1], {**topo["ranks"][0], "rank": 0}]}),
        ("world_size", {**topo, "world_size": 4}),
        (  # one rank listed, a mesh of one: the store's second rank has no place
            "mesh_shape",
            {
                **topo,
                "mesh_shape": {"pp": 1, "dp": 1, "tp": 1},
                "groups": {"dp": [[0]], "pp": [[0]], "tp": [[0]]},
                "ranks": one_rank,
                "world_size": None,
            },
        ),
    ]


def test_an_edited_topology_is_bad_input_naming_the_field(ref, tmp_path):
    """The mesh is held to the lock's world size and the ranks whose trajectories are stored; the honest
    store's is shown as it was written."""
    honest = _copy(ref, tmp_path, "honest")
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace", "show", honest, "topology"],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "dp groups: [[0, 1]]" in proc.stderr, proc.stderr
    assert "r0@n0" in proc.stderr and "r1@n0" in proc.stderr
    topo = orjson.loads((ref / "topology.json").read_bytes())
    for n, (name, edited) in enumerate(_edit_topology(topo)):
        run = _copy(ref, tmp_path, f"edit-{n}")
        (run / "topology.json").write_bytes(orjson.dumps(edited))
        for view in ([], ["topology"]):
            proc = subprocess.run(
                [sys.executable, "-m", "disttrace", "show", run, *view],
                capture_output=True,
                text=True,
                env={**os.environ, "NO_COLOR": "1", "COLUMNS": "200"},
                cwd=ROOT,
            )
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == 2 and len(lines) == 1, (name, view, proc.stderr)
            assert f"topology.json: {name}:" in lines[0], (name, lines)
