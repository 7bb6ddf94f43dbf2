"""A run store from elsewhere executes nothing of its writer's: its writer controls every byte.

The crafted stores here are built from a real reference run the way an attacker would: a checkpoint's DCP
`.metadata` replaced by a pickle whose `__reduce__` runs `touch MARKER`, every hash that could betray it
(the INDEX's sha256, the COMPLETE seal's hash of the INDEX) rewritten. The oracle that the payload is live
is torch's own loader, which does run it (in a subprocess); then every command of ours is run on the same
bytes and the marker must never appear."""

from __future__ import annotations

import ast
import hashlib
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import DEFAULT, ROOT, SHORT, cli, raw_records, rewrite_trajectory

ZERO1 = ["--set", "parallelism.zero_stage=1"]


class _Payload:
    """Pickles as `os.system("touch MARKER")`: what a crafted run store would carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def ref(runs) -> Path:
    return runs.reference()


def _copy(run: Path, root: Path) -> Path:
    dst = root / run.parent.name / run.name
    shutil.copytree(run, dst, symlinks=True)
    return dst


def _sha(path: Path) -> dict:
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _rewrite_hashes(run: Path, ckpt: Path) -> None:
    """Make the INDEX and the seal agree with whatever the checkpoint now holds (the writer controls them)."""
    index = orjson.loads((ckpt / "INDEX.json").read_bytes())
    index["files"] = {
        p.name: _sha(p) for p in sorted(ckpt.iterdir()) if p.is_file() and p.name != "INDEX.json"
    }
    (ckpt / "INDEX.json").write_bytes(orjson.dumps(index))
    done = orjson.loads((run / "COMPLETE").read_bytes())
    done["seal"]["files"][f"checkpoints/{ckpt.name}/INDEX.json"] = _sha(ckpt / "INDEX.json")
    (run / "COMPLETE").write_bytes(orjson.dumps(done))


def _crafted_metadata_store(ref: Path, root: Path, marker: Path) -> Path:
    run = _copy(ref, root)
    for ckpt in sorted((run / "checkpoints").iterdir()):
        (ckpt / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
        _rewrite_hashes(run, ckpt)
    return run


def _one_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert lines, proc
    return lines[-1]


def test_torch_own_loader_runs_the_payload(ref, tmp_path):
    """The oracle: the crafted .metadata is live (torch's FileSystemReader unpickles it and runs it)."""
    marker = tmp_path / "MARKER-torch"
    run = _crafted_metadata_store(ref, tmp_path / "runs", marker)
    code = (
        "import torch.distributed.checkpoint as dcp, sys\n"
        "try:\n    dcp.load({}, checkpoint_id=sys.argv[1], no_dist=True)\nexcept BaseException:\n    pass\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(run / "checkpoints" / "step-000002")],
        capture_output=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert marker.exists()


def test_a_crafted_metadata_is_refused_by_every_command(ref, tmp_path):
    marker = tmp_path / "MARKER"
    root = tmp_path / "runs"
    run = _crafted_metadata_store(ref, root, marker)
    meta = re.compile(r"step-00000\d/\.metadata")

    proc = cli("show", run, "checkpoints", "--json")
    assert proc.returncode == 1
    rows = orjson.loads(proc.stdout)["checkpoints"]
    assert rows and all(
        not r["verified"] and meta.search(r["detail"]) and "posix.system" in r["detail"]
        for r in rows
    )

    proc = cli("verify", run)
    assert (
        proc.returncode == 1 and meta.search(_one_line(proc)) and "posix.system" in _one_line(proc)
    ), proc.stderr

    proc = cli("gate", run, "--json")
    assert proc.returncode == 1, proc.stderr
    checks = {c["name"]: c for c in orjson.loads(proc.stdout)["checks"]}
    assert checks["store_integrity"]["passed"] is False and meta.search(
        checks["store_integrity"]["reason"]
    )
    assert checks["checkpoint_integrity"]["passed"] is False and meta.search(
        checks["checkpoint_integrity"]["reason"]
    )
    assert checks["eval_metric"]["passed"] is False  # nothing was evaluated

    before = sorted(p.name for p in run.parent.iterdir())
    proc = cli("recover", run)
    assert (
        proc.returncode == 2
        and meta.search(_one_line(proc))
        and len(proc.stderr.strip().splitlines()) == 1
    )
    assert (
        sorted(p.name for p in run.parent.iterdir()) == before
    )  # nothing prepared, nothing launched

    # lab finds this reference in its runs root (same manifest id): it says so instead of loading it
    proc = cli(
        "lab", DEFAULT, *SHORT, "--fault", "bitflip-grad", "--step", 3, "--rank", 1, "--out", root
    )
    assert (
        proc.returncode == 2 and meta.search(_one_line(proc)) and "posix.system" in _one_line(proc)
    ), proc.stderr
    assert sorted(p.name for p in run.parent.iterdir()) == before
    assert not marker.exists()


def test_our_loader_refuses_the_payload_without_the_scan(ref, tmp_path):
    """The runtime guard alone (no INDEX check, no opcode scan): the allowlisting unpickler names the global."""
    from disttrace.errors import BadInput
    from disttrace.run.job import safeload

    marker = tmp_path / "MARKER"
    run = _crafted_metadata_store(ref, tmp_path / "runs", marker)
    ckpt = run / "checkpoints" / "step-000004"
    with pytest.raises(BadInput, match=r"\.metadata: names the global posix\.system"):
        safeload.read_metadata_file(ckpt / ".metadata")
    with pytest.raises(BadInput, match=r"posix\.system"):
        safeload.load({"progress": {"step": 0}}, ckpt, no_dist=True)
    assert not marker.exists()


def _dcp_items_store(tmp_path: Path, value) -> Path:
    """A DCP checkpoint holding one non-tensor item, saved by DCP itself."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "items"
    dcp.save({"progress": {"step": value}}, checkpoint_id=str(ckpt), no_dist=True)
    return ckpt


def test_a_crafted_non_tensor_item_is_read_weights_only(tmp_path):
    from disttrace.errors import BadInput
    from disttrace.run.job import safeload
    from disttrace.store.pickles import scan_checkpoint

    marker = tmp_path / "MARKER"
    ckpt = _dcp_items_store(tmp_path, _Payload(marker))
    finding = scan_checkpoint(ckpt)
    assert (
        finding is not None
        and finding.file.name.endswith(".distcp")
        and "posix.system" in finding.reason
    )
    with pytest.raises(BadInput, match=r"progress\.step"):
        safeload.load({"progress": {"step": 0}}, ckpt, no_dist=True)
    assert not marker.exists()
    ok = _dcp_items_store(tmp_path / "ok", 7)  # plain values still load
    state = {"progress": {"step": 0}}
    safeload.load(state, ok, no_dist=True)
    assert state["progress"]["step"] == 7 and scan_checkpoint(ok) is None


@pytest.fixture(scope="module")
def zero1_ref(runs) -> Path:
    return runs.reference(*ZERO1)


def test_a_crafted_optimizer_blob_is_refused(zero1_ref, tmp_path):
    """ZeRO-1 keeps each rank's optimizer partition as a blob (bytes of torch.save). A writer replaces rank 0's
    blob with a payload, re-saves the checkpoint with DCP and rewrites every hash."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from disttrace.run.parallel.common import load_optimizer_bytes

    marker = tmp_path / "MARKER"
    run = _copy(zero1_ref, tmp_path / "runs")
    buf = __import__("io").BytesIO()
    torch.save(_Payload(marker), buf)
    evil = buf.getvalue()
    for ckpt in sorted((run / "checkpoints").iterdir()):
        state: dict = {}  # our own reference, read with torch's full loader in this test only
        _load_state_dict(
            state,
            storage_reader=dcp.FileSystemReader(str(ckpt)),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        assert isinstance(state["optim"]["rank-00000"], bytes), state.get(
            "optim"
        )  # the format under test
        state["optim"]["rank-00000"] = evil
        for p in ckpt.iterdir():
            p.unlink()
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
        index = orjson.loads((zero1_ref / "checkpoints" / ckpt.name / "INDEX.json").read_bytes())
        (ckpt / "INDEX.json").write_bytes(orjson.dumps(index))
        _rewrite_hashes(run, ckpt)

    proc = cli("recover", run)
    line = _one_line(proc)
    assert (
        proc.returncode == 2
        and ".distcp" in line
        and "optim.rank-00000" in line
        and "posix.system" in line
    ), line
    proc = cli("verify", run)
    assert proc.returncode == 1 and "optim.rank-00000" in _one_line(proc), proc.stderr
    # the runtime guard alone: the blob loads weights_only, which refuses the global
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system"):
        load_optimizer_bytes(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1), evil)
    assert not marker.exists()


# ---------------------------------------------------------------- paths stay inside the store


def _prepared(tmp_path: Path) -> Path:
    proc = cli("run", DEFAULT, *SHORT, "--prepare-only", "--out", tmp_path / "runs", check=0)
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["absolute", "climbs-out"])
def test_a_resume_path_outside_the_runs_root_is_refused(ref, tmp_path, where):
    run_dir = _prepared(tmp_path)
    elsewhere = _copy(
        ref, tmp_path / "elsewhere"
    )  # a real, valid checkpoint, but in another runs root
    target = elsewhere / "checkpoints" / "step-000002"
    rel = os.path.relpath(target, run_dir.parent)
    assert rel.startswith("..")
    info = orjson.loads((run_dir / "run.json").read_bytes())
    info["resume"] = {"checkpoint": str(target) if where == "absolute" else rel, "step": 2}
    (run_dir / "run.json").write_bytes(orjson.dumps(info))

    from disttrace.errors import BadInput
    from disttrace.run.job.launch import launch

    with pytest.raises(BadInput, match="resume.checkpoint"):
        launch(run_dir)  # before any rank starts
    # a worker started by hand (torchrun ... -m disttrace.worker) refuses too, before any process group
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace.worker", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "run.json" in _one_line(proc) and "resume.checkpoint" in _one_line(proc)
    assert not (run_dir / "COMPLETE").exists() and not (run_dir / "trajectory").exists()


def test_recover_into_another_runs_root_copies_only_a_checkpoint_that_verifies(ref, tmp_path):
    """Into another root the checkpoint is copied (a worker loads only from its own runs root): one whose
    bytes differ from its INDEX is refused before anything is copied or launched, naming the file."""
    run = _copy(ref, tmp_path / "runs")
    shard = sorted((run / "checkpoints" / "step-000004").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    proc = cli("recover", run, "--from-step", "4", "--out", tmp_path / "other")
    assert proc.returncode == 2 and shard.name in _one_line(proc), proc.stderr[-2000:]
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").rglob("*.json"))


def test_a_checkpoint_linked_out_of_the_run_is_refused(ref, tmp_path):
    run = _copy(ref, tmp_path / "runs")
    outside = tmp_path / "outside" / "step-000004"
    shutil.move(run / "checkpoints" / "step-000004", outside)
    (run / "checkpoints" / "step-000004").symlink_to(outside, target_is_directory=True)
    proc = cli("recover", run)
    assert (
        proc.returncode == 2 and "step-000004" in _one_line(proc) and "outside" in _one_line(proc)
    ), proc.stderr
    proc = cli("verify", run)
    assert proc.returncode == 1 and "checkpoints/step-000004" in _one_line(proc), proc.stderr


# ---------------------------------------------------------------- the package never unpickles freely


# Calls that unpickle whatever bytes they are given, by fully qualified name (aliases and `from` imports
# resolved). torch.load is allowed only with weights_only=True; DCP's load only in run/job/safeload.py, with our
# reader and planner; an Unpickler subclass only with its own find_class.
FREE_UNPICKLERS = {
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "_pickle.load",
    "_pickle.loads",
    "dill.load",
    "dill.loads",
    "cloudpickle.load",
    "cloudpickle.loads",
    "joblib.load",
    "marshal.load",
    "marshal.loads",
    "shelve.open",
    "pandas.read_pickle",
    "torch.distributed.checkpoint.format_utils.dcp_to_torch_save",
}
DCP_LOADS = {
    "torch.distributed.checkpoint.load",
    "torch.distributed.checkpoint.state_dict_loader.load",
}
# unpickling of bytes that never come from a run store: (the unpickling call, what it unpickles)
IN_PROCESS_PICKLES = {
    ("pickle.loads", "torch._C._distributed_c10d._dump_fr_trace")
}  # torch's own FR dump


def _imports(tree: ast.AST) -> dict[str, str]:
    """Local name -> the fully qualified name it is bound to, from every import in the file."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _qualified(expr: ast.AST, names: dict[str, str]) -> str | None:
    if isinstance(expr, ast.Name):
        return names.get(expr.id)
    if isinstance(expr, ast.Attribute):
        base = _qualified(expr.value, names)
        return f"{base}.{expr.attr}" if base else None
    return None


def unpickling_offenders(source: str, rel: str) -> list[str]:
    """Every call in `source` that could unpickle a run store's bytes freely, as 'file:line: why'."""
    tree = ast.parse(source)
    names = _imports(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {_qualified(b, names) for b in node.bases}
            own = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if bases & {"pickle.Unpickler", "_pickle.Unpickler"} and "find_class" not in own:
                out.append(f"{rel}:{node.lineno}: {node.name} unpickles without its own find_class")
            continue
        if not isinstance(node, ast.Call):
            continue
        called = _qualified(node.func, names)
        keywords = {k.arg: k.value for k in node.keywords}
        if called in FREE_UNPICKLERS:
            arg = (
                _qualified(node.args[0].func, names)
                if node.args and isinstance(node.args[0], ast.Call)
                else None
            )
            if (called, arg) not in IN_PROCESS_PICKLES:
                out.append(f"{rel}:{node.lineno}: {called}")
        elif called == "torch.load":
            wo = keywords.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                out.append(f"{rel}:{node.lineno}: torch.load without weights_only=True")
        elif called in DCP_LOADS and (
            rel != "disttrace/run/job/safeload.py"
            or not {"storage_reader", "planner"} <= set(keywords)
        ):
            out.append(f"{rel}:{node.lineno}: {called} outside safeload's reader and planner")
        elif (
            called == "numpy.load"
            and isinstance(keywords.get("allow_pickle"), ast.Constant)
            and keywords["allow_pickle"].value is not False
        ):
            out.append(f"{rel}:{node.lineno}: numpy.load(allow_pickle=...)")
    return out


def test_the_unpickling_check_sees_through_aliases_and_ignores_text():
    planted = {
        "import pickle as p\nx = p.loads(b)": "pickle.loads",
        "from pickle import load\nload(f)": "pickle.load",
        "import torch\ntorch.load(f)": "weights_only=True",
        "import torch\ntorch.load(f, weights_only=False)": "weights_only=True",
        "from torch import load as tl\ntl(f, weights_only=flag)": "weights_only=True",
        "import torch.distributed.checkpoint as dcp\ndcp.load(state, checkpoint_id=p)": "safeload",
        "from torch.distributed import checkpoint\ncheckpoint.load(state)": "safeload",
        "import pickle\nclass U(pickle.Unpickler):\n    pass": "find_class",
        "import pickle\npickle.loads(read_bytes())": "pickle.loads",
    }
    for source, why in planted.items():
        found = unpickling_offenders(source, "x.py")
        assert len(found) == 1 and why in found[0], (source, found)
    inert = (
        '# pickle.loads(data)\ns = "torch.load(f, weights_only=False)"\n'
        "import torch\ntorch.load(f, weights_only=True)\n"
        "import pickle\nclass U(pickle.Unpickler):\n    def find_class(self, m, n):\n        raise E\n"
        "from torch._C._distributed_c10d import _dump_fr_trace\npickle.loads(_dump_fr_trace(True))\n"
    )
    assert unpickling_offenders(inert, "x.py") == []


def test_no_full_unpickling_left_in_the_package():
    offenders = []
    for path in sorted((ROOT / "disttrace").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        offenders += unpickling_offenders(path.read_text(encoding="utf-8"), rel)
    assert offenders == []


# ---------------------------------------------------------------- the report stays inert


def test_the_report_escapes_html_names_and_forbids_scripts(ref, tmp_path):
    from disttrace.report import build_report

    tag = '<img src=x onerror="alert(1)">'
    run = _copy(ref, tmp_path / "runs")
    lock = orjson.loads((run / "manifest.lock.json").read_bytes())
    lock["manifest"]["experiment"]["name"] = "<script>alert(2)</script>"
    (run / "manifest.lock.json").write_bytes(orjson.dumps(lock))
    for rank in (
        0,
        1,
    ):  # every tensor named by a tag; diff rebuilds the (removed) step index from the records
        rewrite_trajectory(
            run, rank, [{**r, "tensor": tag + r["tensor"]} for r in raw_records(run, rank)]
        )
    other = _copy(run, tmp_path / "runs2")
    recs = raw_records(other, 1)  # one digest changed: a divergence that names its tensor
    k = next(i for i, r in enumerate(recs) if r["step"] == 3 and r["phase"] == "backward")
    recs[k]["digest"] = "f" * 32
    rewrite_trajectory(other, 1, recs)

    page = build_report([run, other], tmp_path / "r.html").read_text(encoding="utf-8")
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in page  # the names are there, as text
    assert "<img" not in page and "<script" not in page and "&lt;script&gt;alert(2)" in page
    csp = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]+)">', page)
    assert (
        csp
        and page.index(csp.group(0)) < page.index("<style>")
        and page.index(csp.group(0)) < page.index("<body>")
    )
    rules = dict(r.strip().split(" ", 1) for r in csp.group(1).split(";"))
    assert rules["script-src"] == "'none'" and rules["default-src"] == "'none'"
