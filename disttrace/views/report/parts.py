"""What every section of the page uses: escaping, tables, badges, the colours, axis ticks and the
run as the page sees it (`_R`)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrace.report import RunEvidence


PALETTE = ("#1f6fd1", "#d1341f", "#1e9e54", "#8e44ad", "#e08a00", "#7f5539", "#0f9aa8", "#c2185b")


DASHES = ("", "9 5", "2 5", "12 4 2 4", "6 3", "1 3")


WIDTHS = (3.2, 2.2, 2.6, 2.0, 2.0, 2.0)


COORD_COLOURS = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)


EQUAL_COLOUR = "#cfeedd"


WITHIN_COLOUR = "#ffe680"


HARD_COLOUR = "#4a1486"


NODATA_COLOUR = "#eceff3"


# relative error -> colour: 1e-9 (pale) .. 1 (dark red), on -log10(rel)
REL_STOPS = (
    (0.0, (127, 0, 0)),
    (3.0, (215, 48, 31)),
    (6.0, (252, 141, 89)),
    (9.0, (253, 212, 158)),
)


GRID_MAX_STEPS = 120


LOSS_TABLE_MAX_ROWS = 40


NOT_RECORDED = "not recorded"


def e(x: Any) -> str:
    """Escape anything for HTML text or an attribute value."""
    return html.escape("" if x is None else str(x), quote=True)


def _nr(what: str = NOT_RECORDED) -> str:
    return f'<p class="nr">{e(what)}</p>'


def _err(what: str, exc: BaseException) -> str:
    return f'<p class="err">{e(what)}: {e(type(exc).__name__)}: {e(exc)}</p>'


def _guard(what: str, fn: Callable[..., str], *args) -> str:
    """One piece of the page: a piece that cannot be read says so and never takes the page down."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a report shows what it can and names what it could not read
        return _err(f"{what} could not be read", exc)


def _or(value: Any, absent: str) -> Any:
    return absent if value is None else value


def _badge(text: str, kind: str) -> str:
    return f'<span class="badge b-{kind}">{e(text)}</span>'


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.2f} {unit}"
        v /= 1024
    return str(n)


def _table(head: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """head: plain text (escaped); rows: cells already HTML."""
    h = "".join(f"<th>{e(c)}</th>" for c in head)
    body = "".join(
        "<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in r) + "</tr>"
        for r in rows
    )
    return f'<table class="{e(cls)}"><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>'


def _td_num(x: str, title: str | None = None) -> str:
    t = f' title="{e(title)}"' if title else ""
    return f'<td class="num"{t}>{x}</td>'


def _nice_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], float]:
    span = hi - lo
    if not span > 0:
        return [lo], 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = mag
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if raw <= step:
            break
    t = math.ceil(lo / step - 1e-9) * step
    out = []
    while t <= hi + step * 1e-9:
        out.append(round(t, 12))
        t += step
    return out, step


def _tick_label(v: float, step: float) -> str:
    decimals = max(
        0,
        -math.floor(math.log10(step))
        + (1 if round(step / 10 ** math.floor(math.log10(step)), 6) == 2.5 else 0),
    )
    return f"{v:.{decimals}f}"


def _lerp_colour(t: float) -> str:
    """-log10(rel err) -> colour along REL_STOPS."""
    t = min(max(t, REL_STOPS[0][0]), REL_STOPS[-1][0])
    for (a, ca), (b, cb) in zip(REL_STOPS, REL_STOPS[1:]):
        if t <= b:
            f = (t - a) / (b - a)
            rgb = tuple(round(x + (y - x) * f) for x, y in zip(ca, cb))
            return "#{:02x}{:02x}{:02x}".format(*rgb)
    return "#{:02x}{:02x}{:02x}".format(*REL_STOPS[-1][1])


class _R:
    """One run as the page sees it."""

    def __init__(self, path: Path, label: str, colour: str, index: int, evidence: RunEvidence):
        self.evidence = evidence
        self.path = path
        self.label = label
        self.colour = colour
        self.index = index
        state = evidence.state
        self.info, self.info_error = state.info, state.info_error
        self.kind = self.info.path or "?"
        self.complete = state.complete

    def status_badge(self) -> str:
        return _badge("complete", "ok") if self.complete else _badge("INCOMPLETE", "warn")

    def name_html(self) -> str:
        return (
            f'<span class="swatch" style="background:{self.colour}"></span><b>{e(self.label)}</b>'
        )

    def tag_html(self) -> str:
        """The name, marked where the run is incomplete."""
        return self.name_html() + ("" if self.complete else " " + self.status_badge())


def _labels(paths: list[Path]) -> list[str]:
    names = [p.name for p in paths]
    out = []
    for i, p in enumerate(paths):
        lab = names[i] if names.count(names[i]) == 1 else f"{p.parent.name}/{p.name}"
        out.append(lab if out.count(lab) == 0 else f"{lab} ({i + 1})")
    return out


def _dark(fill: str) -> bool:
    """White text on this fill? (relative luminance of a #rrggbb colour)"""
    try:
        r, g, b = (int(fill[i : i + 2], 16) / 255 for i in (1, 3, 5))
    except ValueError:
        return False
    return 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.5
