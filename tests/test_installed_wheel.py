"""disttrace installed as a user installs it: the wheel built from this tree, installed into a fresh venv,
run from an empty folder. The checkout's tests never see this layout (the editable install reads the
repository's manifests/), so a manifest, lab or data file the wheel leaves out shows only here."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from conftest import ROOT

from disttrace.config.freezing import freeze
from disttrace.lab.curriculum import list_labs
from disttrace.store.rundir import Run

STEPS = ["training.steps=2", "checkpoint.interval=2"]


def _sh(cmd, cwd, timeout=300, env=None) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", "COLUMNS": "200", **(env or {})}
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=e
    )
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The venv's bin/ folder, the wheel installed there and nothing of the checkout importable."""
    tmp = tmp_path_factory.mktemp("wheel")
    # built from a copy of the tree: the checkout's build/ may hold files of an older tree, and the wheel
    # must hold what the repository holds now
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "_manifests")
    for name in ("disttrace", "manifests"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    # no build isolation and no index: the build needs only the setuptools this interpreter already has
    _sh(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", tmp / "dist", "."],
        cwd=src,
    )  # fmt: skip
    (wheel,) = (tmp / "dist").glob("disttrace-*.whl")
    venv = tmp / "venv"
    _sh([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    # torch and the other dependencies from this interpreter's site-packages, appended after the venv's
    # own: a path line of a .pth adds that folder only, its .pth files (the checkout's editable finder)
    # are not run, so `disttrace` can only come from the wheel
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    (purelib / "outer-site.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _sh(
        [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q",
         "--no-deps", "--no-index", wheel],
        cwd=tmp,
    )  # fmt: skip
    where = _sh([venv / "bin" / "python", "-c", "import disttrace; print(disttrace.__file__)"], tmp)
    assert Path(where.stdout.strip()).is_relative_to(purelib), where.stdout
    return venv / "bin"


@pytest.mark.slow
def test_installed_wheel_runs_the_default_from_an_empty_folder(installed, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    sets = [a for s in STEPS for a in ("--set", s)]
    proc = _sh([installed / "disttrace", "run", *sets], cwd=empty)
    run_dir = empty / proc.stdout.strip().splitlines()[-1]
    run = Run(run_dir)
    assert run.complete and run.ranks() == [0, 1]
    lock = orjson.loads((run_dir / "manifest.lock.json").read_bytes())
    # the data and tokenizer came from the wheel, not from the repository
    packaged = Path(lock["source"]).parent
    assert packaged.name == "_manifests" and not packaged.is_relative_to(ROOT), lock["source"]
    for key in ("data_path", "tokenizer_path"):
        assert Path(lock["resolved"][key]).is_relative_to(packaged), lock["resolved"]
    # the id hashes the manifest's content (the data and tokenizer by their sha256, their paths as the
    # manifest writes them), never where it lies: the checkout's default is the same experiment
    assert lock["manifest_id"] == freeze(ROOT / "manifests" / "default.toml", STEPS).manifest_id
    _sh([installed / "disttrace", "verify", run_dir], cwd=empty)
    assert sorted(p.name for p in empty.iterdir()) == ["runs"]  # nothing written beside it


@pytest.mark.slow
def test_installed_wheel_lists_every_lab(installed, tmp_path):
    proc = _sh([installed / "disttrace", "lab", "--list", "--json"], cwd=tmp_path)
    labs = orjson.loads(proc.stdout)
    # the oracle: the repository's own lab files, counted here, not by disttrace
    assert sorted(lab["lab"] for lab in labs) == sorted(
        p.stem for p in (ROOT / "manifests" / "labs").glob("*.toml")
    )
    # each as runnable as from the checkout (a lab whose data the wheel lacked would not be)
    assert {lab["lab"]: lab["status"] for lab in labs} == {
        lab["lab"]: lab["status"] for lab in list_labs(ROOT / "manifests" / "labs")
    }
    assert all("/_manifests/labs/" in lab["manifest"] for lab in labs)


@pytest.mark.slow
def test_installed_wheel_records_an_unmodified_script_zero_code(installed, tmp_path):
    """The sitecustomize that zero-code recording puts on the command's path ships in the wheel: an
    unmodified DDP script, copied out of the repository, run under the installed CLI."""
    empty = tmp_path / "empty"
    empty.mkdir()
    script = empty / "train.py"
    script.write_bytes((ROOT / "tests" / "scripts" / "plain_ddp.py").read_bytes())
    python = installed / "python"
    launcher = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    proc = _sh([installed / "disttrace", "run", "--", *launcher, script, "--steps", "2"], cwd=empty)
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    lock = orjson.loads((run_dir / "manifest.lock.json").read_bytes())
    assert lock["manifest"]["record"]["source"] == "zero-code"
    assert Run(run_dir).complete
