"""torchtitan 0.3.0 as a real client (slow tier): its llama3 debug model trained on CPU/gloo by
tests/scripts/titan/titan_train.py (its `python -m torchtitan.train` with the CPU shims), from one
seed checkpoint, at dp=1, FSDP 2 and TP 2.

torchtitan runs in its own interpreter: its pins (datasets<4.8, so huggingface-hub<2) cannot share
an environment with the hf extra's transformers (huggingface-hub>=2.4). DISTTRACE_TITAN_PYTHON
names that interpreter (default: .venv-titan/bin/python in the repository); the tests skip, saying
so, where it is missing or cannot import torchtitan.

Here only the baseline without disttrace: the three layouts' losses agree. The recorder's
assertions (`disttrace run -- torchrun ...` on the same commands) build on `layouts`.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TITAN = ROOT / "tests" / "scripts" / "titan"
TITAN_PYTHON = Path(
    os.environ.get("DISTTRACE_TITAN_PYTHON", ROOT / ".venv-titan" / "bin" / "python")
)
LAYOUTS = ("one", "fsdp", "tp")

pytestmark = pytest.mark.slow


def _titan_missing() -> str | None:
    if not TITAN_PYTHON.exists():
        return f"{TITAN_PYTHON} does not exist (set DISTTRACE_TITAN_PYTHON)"
    probe = subprocess.run(
        [str(TITAN_PYTHON), "-c", "import torchtitan.train, triton"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if probe.returncode != 0:
        return f"{TITAN_PYTHON} cannot import torchtitan: {probe.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, list[dict]]:
    """One seed checkpoint, then 5 steps at each layout; each layout's logged steps."""
    missing = _titan_missing()
    if missing:
        pytest.skip(f"torchtitan is not installed for these tests: {missing}")
    out = tmp_path_factory.mktemp("titan")
    proc = subprocess.run(
        [str(TITAN / "run_layouts.sh"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PY": str(TITAN_PYTHON), "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        name: [json.loads(line) for line in (out / f"{name}.jsonl").read_text().splitlines()]
        for name in LAYOUTS
    }


def test_layouts_agree(layouts):
    steps = [[row["step"] for row in layouts[name]] for name in LAYOUTS]
    assert steps == [[1, 2, 3, 4, 5]] * 3
    for name in ("fsdp", "tp"):
        for one, other in zip(layouts["one"], layouts[name]):
            assert other["loss"] == pytest.approx(one["loss"], abs=1e-5), (name, one, other)
    assert layouts["one"][-1]["loss"] < layouts["one"][0]["loss"] - 1.0  # it trains
