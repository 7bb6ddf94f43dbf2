"""`disttrace report`: one self-contained HTML page of real runs (reference, fault, recovered, gate verdict),
checked as text, as parsed HTML and in a real headless browser."""

from __future__ import annotations

import html
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import DEFAULT, SHORT, cli, last_line, tear_trajectory

from disttrace.errors import BadInput
from disttrace.report import build_report

pytestmark = (
    pytest.mark.slow
)  # end-to-end jobs of the full tier (`make test-all`); CI runs `make test`

CHROMIUM = Path("/usr/bin/chromium")
# CI installs it with: apt-get update && apt-get install -y chromium
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Real runs: reference, one bit flipped in rank 1's gradient at step 3, the recovery, the gate."""
    root = tmp_path_factory.mktemp("report_runs")
    ref = last_line(cli("run", DEFAULT, *SHORT, "--out", root, check=0))
    fault = last_line(
        cli(
            "inject",
            DEFAULT,
            *SHORT,
            "--fault",
            "bitflip-grad",
            "--step",
            3,
            "--rank",
            1,
            "--out",
            root,
            check=0,
        )
    )
    rec = last_line(cli("recover", fault, check=0))
    cli(
        "gate", fault, "--reference", ref, check=1
    )  # the gate fails the fault run: a verdict.json to show
    assert (fault / "verdict.json").exists()
    out = root / "out" / "report.html"
    assert build_report([ref, fault, rec], out) == out
    return {
        "ref": ref,
        "fault": fault,
        "rec": rec,
        "report": out,
        "html": out.read_text(encoding="utf-8"),
        "root": root,
    }


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict, tuple]] = []  # (tag, attrs, open svg ancestry)
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs), tuple(self.stack)))
        if tag not in ("circle", "line", "rect", "polyline", "meta", "br", "i"):
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in self.stack:
            while self.stack and self.stack.pop() != tag:
                pass


def _tags(page: str) -> list[tuple[str, dict, tuple]]:
    p = _Tags()
    p.feed(page)
    return p.tags


def test_the_report_is_one_self_contained_file(lab):
    page = lab["html"]
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert "http://" not in page and "https://" not in page
    for tag, attrs, _ in _tags(page):
        for key in ("src", "href"):
            v = attrs.get(key)
            if v is not None:
                assert v.startswith("#"), f"<{tag} {key}={v!r}> points outside the page"
        assert tag not in ("script", "link", "iframe", "img", "object", "embed"), (
            f"<{tag}> in a self-contained page"
        )
    assert "@import" not in page and "url(" not in page and "@font-face" not in page


def test_the_report_shows_the_three_runs_and_their_loss_curves_on_one_plot(lab):
    page = lab["html"]
    for key in ("ref", "fault", "rec"):
        assert html.escape(str(lab[key])) in page
    for label in ("reference", "fault", "recovered"):
        assert f"<b>{label}</b>" in page
    tags = _tags(page)
    lines = [(a, anc) for t, a, anc in tags if t == "polyline" and a.get("class") == "loss-line"]
    assert len(lines) == 3 and all("svg" in anc for _, anc in lines)
    plot = page[page.index('<svg class="plot"') :]
    plot = plot[: plot.index("</svg>")]
    assert plot.count('class="loss-line"') == 3  # one plot, three curves
    assert all(f'class="legend">{label}' in plot for label in ("reference", "fault", "recovered"))
    points = {a["data-run"]: len(a["points"].split()) for a, _ in lines}
    assert points == {"reference": 4, "fault": 4, "recovered": 2}  # recovered resumed at step 2
    assert "the same loss, bit for bit, at steps 3..4" in page  # recovered vs reference
    assert "default-dp2" in page and "manifest id" in page


def test_the_report_names_the_first_divergence_and_the_failed_gate(lab):
    page = lab["html"]
    assert (
        "First divergence: step 3 · micro-batch 1 · backward · rank 1 · tensor layers.0.attention.wq.weight"
        in page
    )
    assert "EQUAL over steps 3..4" in page  # the recovered run rejoined the reference bit for bit
    assert page.count('aria-label="divergence grid, rank by step"') == 2
    assert "<title>first divergence</title>" in page
    gate = page[page.index('id="gate"') :]
    assert 'b-bad">FAIL</span>' in gate
    row = re.search(r"gradient_equivalence</code></td><td>(.*?)</td><td>(.*?)</td>", gate)
    assert row and "FAIL" in row.group(1) and "first divergence at step 3" in row.group(2)
    assert "checkpoint_integrity" in gate and "eval_metric" in gate


def test_the_report_holds_topology_memory_collectives_and_checkpoints(lab):
    page = lab["html"]
    assert 'aria-label="rank topology grid"' in page and "<b>dp</b> groups" in page
    mem = page[page.index('id="memory"') : page.index('id="collectives"')]
    assert mem.count(">1.0000<") == 6  # 3 runs x 2 ranks: measured model state = the ZeRO-0 formula
    assert "step counters" in mem  # the explained gap
    col = page[page.index('id="collectives"') : page.index('id="checkpoints"')]
    assert col.count(">in sync<") == 3 and "DESYNC" not in col
    ck = page[page.index('id="checkpoints"') : page.index('id="gate"')]
    assert (
        ck.count(">verified<") == 5 and ">BAD<" not in ck
    )  # 2 + 2 + 1 (recovered saves step 4 only)
    assert "not recorded" not in page and "INCOMPLETE" not in page and 'class="err"' not in page


def test_an_incomplete_run_with_missing_pieces_still_gets_its_page(lab, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(lab["fault"], broken)
    (broken / "COMPLETE").unlink()
    (broken / "topology.json").unlink()
    (broken / "verdict.json").unlink()
    shutil.rmtree(broken / "memory")
    shutil.rmtree(broken / "collectives")
    data = next((broken / "checkpoints" / "step-000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit in a checkpoint shard
    data.write_bytes(bytes(raw))
    tear_trajectory(broken, 1)  # a torn last step, as a crash leaves it
    out = build_report([lab["ref"], broken], tmp_path / "r.html")
    page = out.read_text(encoding="utf-8")
    assert "Incomplete run(s):" in page and "INCOMPLETE" in page and "broken (incomplete)" in page
    assert "topology.json not recorded" in page
    assert "memory ledger not recorded" in page and "collective trace not recorded" in page
    ck = page[page.index('id="checkpoints"') : page.index('id="gate"')]
    assert ">BAD<" in ck and html.escape(data.name) in ck  # the bad file is named
    assert "torn (incomplete write)" in page  # the torn last step, reported, not fatal
    assert "First divergence: step 3" in page
    # a single incomplete run alone: no diff, still a page
    alone = build_report([broken], tmp_path / "alone.html").read_text(encoding="utf-8")
    assert "nothing to diff" in alone and "INCOMPLETE" in alone


def test_text_from_the_store_is_escaped(lab, tmp_path):
    import orjson

    odd = tmp_path / "odd"
    shutil.copytree(lab["ref"], odd, ignore=shutil.ignore_patterns("checkpoints"))
    lock = orjson.loads((odd / "manifest.lock.json").read_bytes())
    lock["manifest"]["experiment"]["name"] = '<script>alert("x")</script>'
    lock["manifest"]["experiment"]["description"] = "a & b <i>"
    (odd / "manifest.lock.json").write_bytes(orjson.dumps(lock))
    page = build_report([odd], tmp_path / "odd.html").read_text(encoding="utf-8")
    assert "<script" not in page and "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "a &amp; b &lt;i&gt;" in page
    assert "checkpoints not recorded" in page


def test_a_path_that_is_not_a_run_is_bad_input(lab, tmp_path):
    out = tmp_path / "never.html"
    with pytest.raises(BadInput):
        build_report([lab["ref"], tmp_path / "nope"], out)
    with pytest.raises(BadInput):
        build_report([tmp_path], out)  # a directory, but no manifest.lock.json
    with pytest.raises(BadInput):
        build_report([], out)
    assert not out.exists()


def _chromium(args: list[str], tmp: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), *CHROMIUM_FLAGS, f"--user-data-dir={tmp / 'profile'}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _console_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]


@pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="headless browser check needs /usr/bin/chromium "
    "(apt-get update && apt-get install -y chromium)",
)
def test_a_headless_browser_renders_the_report_without_console_errors(lab, tmp_path):
    url = lab["report"].resolve().as_uri()
    assert url.startswith("file://")
    # the console check is not vacuous: a page with a script error is caught
    bad = tmp_path / "bad.html"
    bad.write_text("<html><body><svg></svg><script>undefinedFn();</script></body></html>")
    probe = _chromium(["--dump-dom", bad.as_uri()], tmp_path)
    assert any("Uncaught" in ln for ln in _console_lines(probe.stderr)), probe.stderr[-3000:]

    dom = _chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-3000:]
    assert "<svg" in dom.stdout and dom.stdout.count('class="loss-line"') == 3
    assert "First divergence: step 3" in dom.stdout
    assert _console_lines(dom.stderr) == [], _console_lines(dom.stderr)

    shot = tmp_path / "shot.png"
    proc = _chromium([f"--screenshot={shot}", "--window-size=1280,2000", url], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _console_lines(proc.stderr) == [], _console_lines(proc.stderr)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1280, 2000)
    assert (
        len(data) > 50_000
    )  # a rendered page of tables and plots, not a blank one (blank: a few KB)
