"""The optional compiled parts (the `fast` extra: numba). Each is imported the first time it is wanted, so a
job that never needs it never pays numba's import, and switched off by its environment variable set to 0
(the benches' baseline, the tests' oracle)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def optional(module: str, switch: str) -> ModuleType | None:
    """`module` imported, or None where `switch` is "0" in the environment or the import fails (no numba, or
    what the module checks at import does not hold)."""
    if os.environ.get(switch) == "0":
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
