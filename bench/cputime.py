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


# the digest's modules, in import order: a later one imports the earlier ones (a revision has some of them)
_DIGEST_MODULES = ("fused", "sketchplan", "digest", "seen", "digestmany")


def digest_at(rev: str):
    """The digest of git revision `rev` (digest.py and the modules it was split into, with its compiled pass
    fused.py where numba is installed), loaded beside this checkout's: its `digest_many` and `_fused`. Each
    of the revision's modules is loaded with the revision's others in place of this checkout's, so that it
    imports them (without its kernel the revision would be timed on the numpy path, or with this checkout's
    kernel). The package they live in moved (run/ -> run/record/): a revision is read in its own layout."""
    import types

    package_name = next(
        name
        for name in ("disttrace.run.record", "disttrace.run")
        if _source_at(rev, name.replace(".", "/") + "/digest.py") is not None
    )
    where = package_name.replace(".", "/")
    package = importlib.import_module(package_name)

    names = [n for n in _DIGEST_MODULES if n != "fused" or os.environ.get("DISTTRACE_FUSED") != "0"]
    saved = {n: (sys.modules.get(f"{package_name}.{n}"), getattr(package, n, None)) for n in names}
    loaded: dict = {}
    try:
        for n in names:
            src = _source_at(rev, f"{where}/{n}.py")
            if src is None:
                continue
            try:
                module = _load(src, f"{n}_at_rev")
            except ImportError:  # no numba: both revisions on the numpy path
                continue
            loaded[n] = sys.modules[f"{package_name}.{n}"] = module
            setattr(package, n, module)
        digest = loaded["digest"]
        digest._fused()  # the revision's digest imports its kernel now, whichever way it names it
        many = loaded.get("digestmany", digest)
    finally:
        for n, (module, attr) in saved.items():
            if module is None:
                sys.modules.pop(f"{package_name}.{n}", None)
            else:
                sys.modules[f"{package_name}.{n}"] = module
            if attr is None:
                if hasattr(package, n):
                    delattr(package, n)
            else:
                setattr(package, n, attr)
    return types.SimpleNamespace(digest_many=many.digest_many, _fused=digest._fused)
