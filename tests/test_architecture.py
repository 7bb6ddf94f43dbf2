"""The shape of the house, checked: readers run where torch cannot be imported, layers import only
downward, and the contracts live in one place (docs/design.md, "Architecture")."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

PKG = ROOT / "disttrace"

# a meta-path finder that refuses torch: what a laptop without torch installed would see
NO_TORCH = """
import sys, importlib.abc
class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError("No module named 'torch' (blocked by the test)")
sys.meta_path.insert(0, _NoTorch())
from disttrace.cli import main
sys.argv = ["disttrace", *sys.argv[1:]]
main()
"""


def run_without_torch(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )


def test_the_no_torch_guard_really_blocks_torch():
    # the oracle for everything below: a command that needs torch must fail under the guard
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH.replace("from disttrace.cli import main", "import torch")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "blocked by the test" in proc.stderr


def test_readers_run_with_torch_unimportable(runs, tmp_path):
    ref = runs.reference()
    fault = runs.fault("bitflip-grad", 3, 1)
    d = run_without_torch("diff", ref, fault)
    assert d.returncode == 1, (
        d.stderr
    )  # the divergence is found without torch, at the planted coordinates
    first = (d.stdout + d.stderr).split("FIRST DIVERGENCE", 1)[-1].splitlines()[0]
    assert "step 3" in first and "backward" in first and "rank 1" in first, first
    assert run_without_torch("diff", ref, ref).returncode == 0
    # the flip happens before the all-reduce, so every replica gets the same wrong sum: consistent (exit 0)
    c = run_without_torch("check", fault)
    assert c.returncode == 0, c.stderr
    for view in ([], ["topology"], ["checkpoints"], ["memory"], ["collectives"]):
        s = run_without_torch("show", ref, *view)
        assert s.returncode == 0, (view, s.stderr)
    out = tmp_path / "r.html"
    r = run_without_torch("report", ref, fault, "-o", out)
    assert r.returncode == 0 and out.stat().st_size > 1000, r.stderr
    v = run_without_torch("verify", ref)
    assert v.returncode == 0, v.stderr


READER_PACKAGES = ("store", "analysis", "views", "plan")
READER_MODULES = ("gate/verdict.py", "fmt.py", "errors.py")


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _reader_files():
    for pkg in READER_PACKAGES:
        yield from sorted((PKG / pkg).rglob("*.py"))
    for m in READER_MODULES:
        yield PKG / m


@pytest.mark.parametrize("path", list(_reader_files()), ids=lambda p: str(p.relative_to(PKG)))
def test_reader_modules_never_import_torch_or_the_run_side(path):
    """Not even lazily inside a function: a reader that imported torch on some code path would break on a
    laptop only when that path runs. Nor the run side (which imports torch) or anything above the readers."""
    bad = sorted(
        n
        for n in _imports(path)
        if n == "torch"
        or n.startswith("torch.")
        or n.startswith("disttrace.run")
        or n.startswith(("disttrace.lab", "disttrace.cli", "disttrace.gate.evaluate"))
    )
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_model_knows_nothing_of_parallelism():
    names = _imports(PKG / "model" / "llama.py")
    assert not any(n.startswith(("torch.distributed", "disttrace")) for n in names), names


def test_exit_codes_are_written_only_in_errors_py():
    """typer.Exit / sys.exit with a literal number anywhere but errors.py is a second copy of the contract."""
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, int)
                and not isinstance(node.args[0].value, bool)
            ):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                if name in ("Exit", "exit"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_strategies_declare_capabilities_instead_of_being_probed():
    """The loop and the worker never ask `hasattr(strategy, ...)`: the Strategy base class declares them."""
    for path in (PKG / "run").rglob("*.py"):
        src = path.read_text()
        assert "hasattr(strategy" not in src and "hasattr(ctx.strategy" not in src, path
    from disttrace.run.parallel.common import Strategy
    from disttrace.run.parallel.ddp import DataParallel
    from disttrace.run.parallel.fsdp import FullyShardedZero
    from disttrace.run.parallel.pp import PipelineParallel
    from disttrace.run.parallel.ps import ParameterServer
    from disttrace.run.parallel.tp import TensorParallel
    from disttrace.run.parallel.zero import ZeroStage1

    for cls in (
        DataParallel,
        ZeroStage1,
        FullyShardedZero,
        TensorParallel,
        PipelineParallel,
        ParameterServer,
    ):
        assert issubclass(cls, Strategy), cls
        for member in ("replicas", "micro_batch"):
            assert getattr(cls, member) is not getattr(Strategy, member), (cls, member)
    assert PipelineParallel.runs_whole_step and not DataParallel.runs_whole_step


def test_public_entry_names_still_work():
    import disttrace.api as api

    assert callable(api.attach)
    proc = subprocess.run(
        [sys.executable, "-m", "disttrace.worker", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "--run-dir" in proc.stdout
