"""What the recorder's benches share for in-process timings: each named operation's median CPU time over
interleaved repeats (so machine noise hits every operation alike), and another revision's digest module to
time against this checkout's."""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def medians(ops: dict, repeats: int) -> dict[str, float]:
    """{name: median CPU seconds of the thread} of each operation (a function of no argument), the
    operations run in turn `repeats` times."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for k, f in ops.items():
            t = time.thread_time()
            f()
            times[k].append(time.thread_time() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _source_at(rev: str, path: str) -> str | None:
    out = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True
    )
    return out.stdout if out.returncode == 0 else None


def _load(src: str, name: str):
    path = (
        Path(tempfile.mkdtemp()) / f"{name}.py"
    )  # kept: numba's cache of a kernel lives beside it
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digest_at(rev: str):
    """The recorder's digest.py as it was at git revision `rev`, loaded as a module of its own, with that
    revision's compiled pass (fused.py beside it, where it has one and numba is installed): without it the other
    revision would be timed on the numpy path, or with this checkout's kernel. The package the two lived in
    moved (run/ -> run/record/); a revision is read in its own layout."""
    package_name = next(
        name
        for name in ("disttrace.run.record", "disttrace.run")
        if _source_at(rev, name.replace(".", "/") + "/digest.py") is not None
    )
    where = package_name.replace(".", "/")
    module = _load(_source_at(rev, f"{where}/digest.py"), "digest_at_rev")
    src = _source_at(rev, f"{where}/fused.py")
    if src is None or os.environ.get("DISTTRACE_FUSED") == "0":
        return module
    try:
        fused = _load(src, "fused_at_rev")
    except ImportError:  # no numba: both revisions on the numpy path
        return module
    package = importlib.import_module(package_name)
    key = f"{package_name}.fused"

    saved = sys.modules.get(key), getattr(package, "fused", None)
    sys.modules[key] = package.fused = fused
    try:  # the revision's digest.py imports its kernel now, whichever way it names it
        module._fused()
    finally:
        if saved[0] is None:
            sys.modules.pop(key, None)
        else:
            sys.modules[key] = saved[0]
        if saved[1] is None:
            del package.fused
        else:
            package.fused = saved[1]
    return module
