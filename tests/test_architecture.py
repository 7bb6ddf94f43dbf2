"""The shape of the house, checked: readers run where torch cannot be imported, layers import only
downward, and the contracts live in one place (docs/design.md, "Architecture")."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
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
        or n.startswith(("disttrace.lab", "disttrace.cli"))
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


# ---- the import contract: the layer order of docs/design.md ("Layers"), held over the code's own imports ----
#
# An import is any `import` or `from ... import` statement, at module level or inside a function (a lazy
# import is still a dependency: it only fails later), leaving out `if TYPE_CHECKING:` blocks (annotations,
# never executed). A "package" is a top-level name under disttrace/: a subpackage (`run`, `analysis`, ...)
# or a top-level module (`api`, `report`, ...); `disttrace` is the root's own __init__.


@dataclass(frozen=True)
class Import:
    where: str  # file:line, for the message
    src: str  # the importing module, dotted
    dst: str  # the imported module, dotted
    names: tuple[
        str, ...
    ]  # what the statement or attribute takes from dst (empty for `import dst`)


def _module_names(root: Path) -> dict[str, Path]:
    mods = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _executed_nodes(node: ast.AST):
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for other in child.orelse:
                yield other
                yield from _executed_nodes(other)
            continue
        yield child
        yield from _executed_nodes(child)


def package_imports(root: Path) -> list[Import]:
    """Every import of one module of the package at `root` by another, and every `module._name` attribute
    read through a name an import bound to a module of the package."""
    top = root.name
    mods = _module_names(root)
    found = []
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        where = path.relative_to(root.parent)
        bound: dict[str, str] = {}  # local name -> the package module it names
        for node in _executed_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == top or a.name.startswith(top + "."):
                        found.append(Import(f"{where}:{node.lineno}", mod, a.name, ()))
                        if a.asname:
                            bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target != top and not target.startswith(top + "."):
                    continue
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in mods:  # `from pkg import module`: an import of the module itself
                        found.append(Import(f"{where}:{node.lineno}", mod, sub, ()))
                        bound[a.asname or a.name] = sub
                    else:
                        found.append(Import(f"{where}:{node.lineno}", mod, target, (a.name,)))
            elif (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and _is_private(node.attr)
            ):
                found.append(
                    Import(f"{where}:{node.lineno}", mod, bound[node.value.id], (node.attr,))
                )
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def layers_from_design(text: str) -> list[set[str]]:
    """The numbered list under docs/design.md's "### Layers" heading: each item's `backticked` names are
    one layer, lowest first."""
    section = text.split("### Layers", 1)[1]
    layers = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        item = re.match(r"\d+\. (.*)", line)
        if item:
            layers.append(set(re.findall(r"`([\w.]+)/?`", item.group(1).split(":")[0])))
    return layers


def contract_breaks(imports: list[Import], layers: list[set[str]]) -> dict[str, list[str]]:
    """What breaks the contract: cycles between packages, imports that do not point to a lower layer, and
    another package's underscore names taken."""
    layer_of = {pkg: i for i, names in enumerate(layers) for pkg in names}
    graph: dict[str, set[str]] = defaultdict(set)
    example: dict[tuple[str, str], str] = {}
    layering, private = [], []
    for imp in imports:
        src, dst = package_of(imp.src), package_of(imp.dst)
        if src == dst:
            continue
        graph[src].add(dst)
        example.setdefault((src, dst), imp.where)
        if src not in layer_of or dst not in layer_of:
            unknown = src if src not in layer_of else dst
            layering.append(f"{imp.where}: package {unknown!r} is in no layer of docs/design.md")
        elif layer_of[dst] >= layer_of[src]:
            layering.append(
                f"{imp.where}: {src} (layer {layer_of[src] + 1}) imports {imp.dst} (layer {layer_of[dst] + 1})"
            )
        taken = [n for n in (*imp.dst.split(".")[1:], *imp.names) if _is_private(n)]
        if taken:
            private.append(f"{imp.where}: {src} takes {imp.dst}'s private {', '.join(taken)}")
    cycles = []
    for scc in _strongly_connected(graph):
        if len(scc) > 1:
            edges = sorted(
                f"{a} -> {b} ({example[a, b]})" for a in scc for b in graph[a] if b in scc
            )
            cycles.append(" <-> ".join(sorted(scc)) + ": " + "; ".join(edges))
    return {"cycles": cycles, "layering": layering, "private": private}


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.add(w)
                if w == v:
                    break
            out.append(scc)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_imports_follow_the_layers_of_the_design():
    """No cycle between packages, every import to a lower layer of docs/design.md's list, and no package
    reaching into another's underscore names: a layer can then be read, tested and changed knowing only
    what lies below it."""
    layers = layers_from_design((ROOT / "docs" / "design.md").read_text())
    packages = {package_of(m) for m in _module_names(PKG)}
    assert packages <= set().union(*layers), (
        f"in no layer of docs/design.md: {packages - set().union(*layers)}"
    )
    breaks = contract_breaks(package_imports(PKG), layers)
    assert breaks == {"cycles": [], "layering": [], "private": []}, breaks


def module_circles(imports: list[Import]) -> list[set[str]]:
    """Circles of modules inside one package (each module imports, through the others, itself): a module
    of the circle cannot be read, or imported first, without the rest."""
    graph: dict[str, set[str]] = defaultdict(set)
    for imp in imports:
        if package_of(imp.src) == package_of(imp.dst) and imp.src != imp.dst:
            graph[imp.src].add(imp.dst)
    return sorted((scc for scc in _strongly_connected(graph) if len(scc) > 1), key=sorted)


# circles that predate the check, each to be broken; a new circle, or one of these grown, fails
KNOWN_CIRCLES = (
    {
        "run.attach",
        "run.attach.engine",
        "run.attach.faults",
        "run.attach.manifest",
        "run.attach.replicas",
        "run.attach.run",
        "run.attach.start",
        "run.deepspeed",
        "run.deepspeed.pieces",
        "run.deepspeed.run",
    },
)


def test_modules_inside_a_package_import_one_way():
    """Inside a package too, dependencies point one way: no circle of modules but the known ones."""
    known = [{f"disttrace.{m}" for m in circle} for circle in KNOWN_CIRCLES]
    new = [
        sorted(c) for c in module_circles(package_imports(PKG)) if not any(c <= k for k in known)
    ]
    assert not new, new


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "disttrace"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_import_contract_fails_on_a_planted_upward_import(tmp_path):
    # the oracle for the test above: a lower layer importing a higher one, lazily inside a function,
    # is a layer break and (with the downward import) a cycle; the same import under TYPE_CHECKING is not
    layers = [{"store"}, {"run"}]
    clean = {
        "store/__init__.py": "",
        "store/rundir.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from disttrace.run import job\n",
        "run/__init__.py": "",
        "run/job.py": "from disttrace.store import rundir\nfrom disttrace.store.rundir import event\n",
    }
    assert contract_breaks(package_imports(_tree(tmp_path / "a", clean)), layers) == {
        "cycles": [],
        "layering": [],
        "private": [],
    }
    planted = {**clean, "store/rundir.py": "def f():\n    from disttrace.run.job import launch\n"}
    breaks = contract_breaks(package_imports(_tree(tmp_path / "b", planted)), layers)
    assert breaks["layering"] == [
        "disttrace/store/rundir.py:2: store (layer 1) imports disttrace.run.job (layer 2)"
    ]
    assert len(breaks["cycles"]) == 1 and breaks["cycles"][0].startswith("run <-> store: ")
    assert breaks["private"] == []


def test_the_module_circle_check_fails_on_a_planted_circle(tmp_path):
    # the oracle for the test above: two modules of one package that import each other (one lazily) are a
    # circle; the same pair with the lazy import under TYPE_CHECKING, or across two packages, is not
    files = {
        "config/__init__.py": "",
        "config/identity.py": "def f():\n    from disttrace.config.harness import claim\n",
        "config/harness.py": "from disttrace.config import identity\n",
        "config/manifest.py": "from disttrace.config.identity import f\n",
    }
    circles = module_circles(package_imports(_tree(tmp_path / "a", files)))
    assert circles == [{"disttrace.config.identity", "disttrace.config.harness"}]
    typed = {
        **files,
        "config/identity.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from disttrace.config.harness import claim\n",
    }
    assert module_circles(package_imports(_tree(tmp_path / "b", typed))) == []


def test_the_import_contract_fails_on_another_packages_private_name(tmp_path):
    layers = [{"store"}, {"run"}]
    files = {
        "store/__init__.py": "def _hidden(): pass\n",
        "store/_raw.py": "",
        "run/__init__.py": "from disttrace.store import _hidden\n",
        "run/a.py": "import disttrace.store._raw\n",
        "run/b.py": "from disttrace import store as s\nx = s._hidden\n",
        "run/c.py": "from . import _own\n",  # a package's own underscore names are its business
        "run/_own.py": "",
    }
    breaks = contract_breaks(package_imports(_tree(tmp_path, files)), layers)
    assert breaks["private"] == [
        "disttrace/run/__init__.py:1: run takes disttrace.store's private _hidden",
        "disttrace/run/a.py:1: run takes disttrace.store._raw's private _raw",
        "disttrace/run/b.py:2: run takes disttrace.store's private _hidden",
    ]
    assert breaks["cycles"] == [] and breaks["layering"] == []


def test_the_layers_are_read_from_the_design():
    text = "x\n### Layers\n\nintro\n\n1. `errors`, `fmt`: the base\n2. `run/`: the job, `api` mentioned\n\n## Next\n3. `no`\n"
    assert layers_from_design(text) == [{"errors", "fmt"}, {"run"}]
