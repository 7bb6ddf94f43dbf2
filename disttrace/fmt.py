"""Plain-text formatting shared by every layer: analysis messages and all views (terminal, markdown, HTML).

One place for how a number, a digest, a list of steps and a record's coordinates are written, so the
terminal, the markdown summary and the HTML report always say the same thing the same way.
"""

from __future__ import annotations

import math
from typing import Any


def fmt_number(x: Any, spec: str = ".6g") -> str:
    """'-' for a missing value, floats by `spec`, the rest as str."""
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def abbrev(s: Any, n: int = 12) -> str:
    """A digest or id cut to n characters ('-' when missing)."""
    s = "" if s is None else str(s)
    if not s:
        return "-"
    return s if len(s) <= n else s[:n] + "…"


def ranges(xs) -> str:
    """[1, 2, 3, 7, 9, 10] -> '1..3, 7, 9..10'."""
    out, i = [], 0
    xs = sorted(xs)
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}..{xs[j]}")
        i = j + 1
    return ", ".join(out)


def where(f) -> str:
    """A finding's coordinates in the order that defines 'first' (docs/design.md, "Order"): a typed finding
    (a diff's `Divergence`) or a mapping of the same names."""
    g = f.get if isinstance(f, dict) else (lambda k: getattr(f, k, None))
    return (
        f"step {g('step')} · micro-batch {g('micro_batch')} · {g('phase')} · rank {g('rank')}"
        f" · tensor {g('tensor')} (index {g('index')})"
    )


def agreeing_digits(rel: float | None) -> int | None:
    """Decimal digits two values agree to, from their relative error (0 = worst, 9 = at least nine)."""
    if not rel:
        return None
    return min(9, max(0, int(math.floor(-math.log10(rel))))) if rel > 0 else 9
