"""What the recorder's benches share for in-process timings: each named operation's median CPU time over
interleaved repeats (so machine noise hits every operation alike), and another revision's digest module to
time against this checkout's."""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
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


def digest_at(rev: str):
    """disttrace/run/digest.py as it was at git revision `rev`, loaded as a module of its own."""
    src = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{rev}:disttrace/run/digest.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "digest_at_rev.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location("digest_at_rev", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module
