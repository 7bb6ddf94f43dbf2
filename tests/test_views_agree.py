"""The terminal and the HTML report draw one diff result alike: every grid cell in the same class, every
bound kind in the same words. The cells' oracle is what was planted (views/diffparts.py classifies for both
views, so the test holds each view's drawing against the plant, not against the classifier)."""

from __future__ import annotations

import dataclasses
import html
import io
import re

import pytest
from rich.console import Console
from test_diff_synthetic import find, gen_records, manifest, plant, write_run

from disttrace.analysis.diff import diff_runs
from disttrace.analysis.result import BoundKind, Tolerance
from disttrace.report import report_facts
from disttrace.views.diff import render_md, render_rich
from disttrace.views.report import render_html

STEPS = range(1, 7)
# (step, rank) -> the class the grid must draw there; every other cell is bit-identical
PLANTED = {
    (2, 0): "within",  # a backward gradient off by 1e-9 relative: inside the derived bound
    (3, 1): "beyond",  # a forward activation off by 10%
    (4, 0): "hard",  # a record missing on B
    (5, 1): "within",  # other bits, the same statistics (relative error 0)
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    m = manifest()
    a = write_run(tmp / "a", m, gen_records(m, STEPS))
    recs = gen_records(m, STEPS)
    plant(recs, 2, 0, "backward", 0, 1, factor=1 + 1e-9)
    plant(recs, 3, 0, "forward", 1, 0, factor=1.1)
    recs[0].remove(find(recs, 4, 0, "forward", 0, 1))
    plant(recs, 5, 0, "optimizer", 1, 2, salt="other bits")
    return a, write_run(tmp / "b", m, recs)


SGR = re.compile(r"\x1b\[([0-9;]*)m")
COLOUR = {"32": "green", "33": "yellow", "31": "red"}


def _terminal(result) -> str:
    buf = io.StringIO()
    render_rich(result, Console(file=buf, width=400, force_terminal=True, color_system="standard"))
    return buf.getvalue()


def _terminal_cells(out: str) -> dict[tuple[int, int], str]:
    """(step, rank) -> class, read from the grid's characters and their colours."""
    plain = [SGR.sub("", line) for line in out.splitlines()]
    head = next(
        i for i, line in enumerate(plain) if line.startswith("steps ") and "every 10th" in line
    )
    first = int(re.match(r"steps (\d+)", plain[head]).group(1))
    cells = {}
    for line in out.splitlines()[head + 2 :]:
        m = re.match(r"(?:\x1b\[[0-9;]*m)*\s*(\d+)  ", line)
        if not m:
            break
        rank, style, col = int(m.group(1)), set(), 0
        for code, ch in re.findall(r"\x1b\[([0-9;]*)m|(.)", line[m.end() :]):
            if not ch:
                style = set() if code in ("", "0") else style | set(code.split(";"))
                continue
            colour = next((COLOUR[c] for c in style if c in COLOUR), None)
            cls = {
                ("·", "green"): "equal",
                ("■", "red"): "hard",
            }.get((ch, colour)) or {"yellow": "within", "red": "beyond"}[colour]
            assert cls != "hard" or "1" in style, "missing, non-finite or bits only is bold"
            cells[(first + col, rank)] = cls
            col += 1
    return cells


def _html_cells(page: str) -> dict[tuple[int, int], str]:
    return {
        (int(s), int(r)): c
        for s, r, c in re.findall(r'data-step="(\d+)" data-rank="(\d+)" data-cell="(\w+)"', page)
    }


def test_every_cell_class_is_drawn_alike(runs):
    a, b = runs
    result = diff_runs(a, b, mode="numeric")
    expected = {(s, r): PLANTED.get((s, r), "equal") for s in STEPS for r in (0, 1)}
    assert set(expected.values()) == {"equal", "within", "beyond", "hard"}
    assert _terminal_cells(_terminal(result)) == expected
    assert _html_cells(render_html([a, b], report_facts([a, b], {1: result}))) == expected


def _variants(a, b):
    """One result per bound kind; the calibrated one is the derived result relabelled as a calibration
    file would have it (a real one needs `disttrace calibrate` runs: tests/test_calibrate.py)."""
    derived = diff_runs(a, b, mode="numeric")
    cal = dataclasses.replace(
        derived,
        tolerance=Tolerance(
            BoundKind.CALIBRATED,
            file="noise/calibration.json",
            safety=4.0,
            manifest_id=derived.a.manifest_id,
            elsewhere="derived",
            since_step=0,
            derivation=derived.tolerance.derivation,
        ),
        first_divergence=dataclasses.replace(
            derived.first_divergence, bound_kind=BoundKind.CALIBRATED
        ),
    )
    per_step = f"{derived.tolerance.per_step:.2e}"
    return {
        "bitwise": (diff_runs(a, b), ["bit for bit", "vs bound 0 (bitwise)"]),
        "explicit": (
            diff_runs(a, b, rtol=0.05, atol=0.0),
            ["explicit rtol 0.05 atol 0", "vs bound 5.000e-02 (explicit)"],
        ),
        "derived": (
            derived,
            [f"derived bound {per_step} per step", "(derived)"],
        ),
        "calibrated": (
            cal,
            [
                f"calibrated bounds from noise/calibration.json (derived {per_step} per step elsewhere)",
                "(calibrated)",
            ],
        ),
    }


@pytest.mark.parametrize("kind", ["bitwise", "explicit", "derived", "calibrated"])
def test_every_bound_kind_is_worded_alike(runs, kind):
    a, b = runs
    result, words = _variants(a, b)[kind]
    terminal = SGR.sub("", _terminal(result))
    page = render_html([a, b], report_facts([a, b], {1: result}))
    md = render_md(result)
    for w in words:
        assert w in terminal, (kind, w)
        assert html.escape(w) in page, (kind, w)
        assert w in md, (kind, w)


def _md_ab(md: str) -> list[list[str]]:
    lines = md.splitlines()
    at = lines.index("| | A | B |")
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([c.strip().strip("`") for c in line.strip("|").split(" | ")])
    return rows


def _html_ab(page: str) -> list[list[str]]:
    div = page.index('<p class="verdict bad">First divergence:')
    table = re.search(r"<table.*?</table>", page[div:], re.S).group(0)
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]:  # the header row left out
        cells = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr, re.S)
        rows.append([html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells])
    return rows


def _terminal_ab(out: str, rows: list[list[str]]) -> None:
    """The terminal's A/B table holds `rows`, in order, each cell as given (columns padded by spaces)."""
    plain = [SGR.sub("", line).rstrip() for line in out.splitlines()]
    at = next(i for i, line in enumerate(plain) if line.startswith("FIRST DIVERGENCE"))
    for line, (label, a, b) in zip(plain[at + 2 :], rows, strict=False):  # the header row left out
        pattern = rf"\s*{re.escape(label)}\s+{re.escape(a)}\s+{re.escape(b)}"
        assert re.fullmatch(pattern, line), (line, label, a, b)


# (mode, the planted (step, rank) it stops at first, the factor planted on that record's values)
FIRSTS = [("bitwise", (2, 0), 1 + 1e-9), ("numeric", (3, 1), 1.1)]


@pytest.mark.parametrize("mode,planted,factor", FIRSTS, ids=[m for m, _, _ in FIRSTS])
def test_the_first_divergence_is_tabled_alike(runs, mode, planted, factor):
    """The first divergence's A/B table, cell for cell, in the terminal, the markdown and the report, at
    the (step, rank) that was planted (bitwise: the first inexact cell; numeric: the first beyond), its
    sums as planted."""
    a, b = runs
    result = diff_runs(a, b, mode=mode)
    f = result.first_divergence
    assert (f.step, f.rank) == planted
    md = _md_ab(render_md(result))
    assert [r[0] for r in md] == ["digest", "sum", "norm", "non-finite", "dtype, shape"]
    assert md[0][1] != md[0][2]  # the digests differ
    assert float(md[1][2]) == pytest.approx(factor * float(md[1][1]), rel=1e-9)
    assert _html_ab(render_html([a, b], report_facts([a, b], {1: result}))) == md
    _terminal_ab(_terminal(result), md)


def _md_propagation(md: str) -> list[list[str]]:
    lines = md.splitlines()
    at = lines.index("| step | ranks with differences | tensors differing | max rel err |")
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("| "):
            break
        step, ranks, tensors, rel = (c.strip() for c in line.strip("|").split(" | "))
        rows.append([step, ranks, tensors, rel.split(" (bound")[0]])
    return rows


def _html_propagation(page: str) -> list[list[str]]:
    at = page.index("<summary>propagation per step</summary>")
    table = re.search(r"<table.*?</table>", page[at:], re.S).group(0)
    rows = []
    for tr in re.findall(r"<tr>(.*?)</tr>", table, re.S)[1:]:  # the header row left out
        cells = re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)
        rows.append([html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in cells][:4])
    return rows


def test_the_propagation_is_tabled_alike(runs):
    """Each step from the first divergence on, in the markdown and the report alike: the ranks beyond their
    bound where they were planted (a missing record included), and the same largest error, 0 where only
    other bits were planted."""
    a, b = runs
    result = diff_runs(a, b, mode="numeric")
    md = _md_propagation(render_md(result))
    assert md == _html_propagation(render_html([a, b], report_facts([a, b], {1: result})))
    first = result.first_divergence.step
    planted = {
        s: ", ".join(str(r) for (s2, r), c in sorted(PLANTED.items()) if s2 == s and c != "within")
        or "-"
        for s in STEPS
        if s >= first
    }
    assert {int(r[0]): r[1] for r in md} == planted
    assert next(r[3] for r in md if r[0] == "5") == "0.00e+00"  # other bits, equal statistics
