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


# what a terminal acts on instead of printing: C0 controls (ESC starts CSI/OSC sequences: a screen clear, a
# clipboard write, a cursor move that repaints FAIL as PASS), DEL, C1 controls (U+009B is a one-byte CSI),
# and the bidirectional overrides and isolates that reorder what follows them (U+202E), line and paragraph
# separators, the byte order mark
_INVISIBLE = (
    [*range(0x20), 0x7F, *range(0x80, 0xA0)]
    + [0x061C, 0x200E, 0x200F, 0x2028, 0x2029, 0xFEFF]
    + [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]
)
_ESCAPES = {c: (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}") for c in _INVISIBLE}
_KEEP_NEWLINE = {c: e for c, e in _ESCAPES.items() if c != 0x0A}


def visible(text: Any, keep_newlines: bool = False) -> str:
    """`text` with every control and bidi character written out as an escape (ESC as \\x1b, U+202E as
    \\u202e), so a string from a run store reaches a terminal as characters, never as commands. The one
    escaping function of every human output and --md (views/console.py applies it to everything a console
    prints); --json is left exact. `keep_newlines`: a multi-line text's own line breaks stay."""
    return str(text).translate(_KEEP_NEWLINE if keep_newlines else _ESCAPES)
