"""The optional compiled parts, each imported the first time it is wanted, so a job that never needs one never
pays for it:

- C extensions (`disttrace/native/`, built by setup.py at install where a C compiler is there): the readers'
  block decoder and comparison, and the recorder's update reduction. They load in about a millisecond, so
  any block may take them; DISTTRACE_NATIVE=0 leaves them out (pyarrow, numpy and torch then do the same
  work: the tests' oracle).
- the recorder's numba pass (`run/record/fused.py`, the `fast` extra): DISTTRACE_FUSED=0 leaves it out (numpy)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


def optional(module: str, switch: str) -> ModuleType | None:
    """`module` imported, or None where `switch` is "0" in the environment or the import fails (the extra not
    installed, or what the module checks at import does not hold)."""
    if os.environ.get(switch) == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def native(name: str) -> ModuleType | None:
    """The C extension disttrace.native.<name>, or None where it was not built (no compiler at install), on a
    big-endian machine (the kernels read Arrow's little-endian bytes through native-order views) or where
    DISTTRACE_NATIVE is "0"."""
    if sys.byteorder != "little":
        return None
    return optional(f"disttrace.native.{name}", "DISTTRACE_NATIVE")
