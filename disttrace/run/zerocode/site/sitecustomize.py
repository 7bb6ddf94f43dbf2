"""Loaded by every Python process `disttrace run -- CMD` starts (this directory is first on its PYTHONPATH):
arms zero-code recording (disttrace/run/zerocode/recording.py), then runs the sitecustomize this one shadows, if any."""

import os
import sys


def _arm() -> None:
    if not (os.environ.get("DISTTRACE_RUN_DIR") and os.environ.get("DISTTRACE_ZERO_CODE") == "1"):
        return
    try:
        from disttrace.run.zerocode.recording import arm
    except (
        ImportError
    ) as e:  # the command runs a Python without disttrace: nothing is recorded, and why
        sys.stderr.write(f"disttrace: zero-code recording is off in {sys.executable}: {e}\n")
        return
    arm()


def _chain() -> None:
    """The interpreter's own sitecustomize (a distribution's, a venv's) still runs."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_arm()
_chain()
