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


# ---------------------------------------------------------------- recorded with no code change

COMMON = [
    "--module", "llama3", "--config", "llama3_debugmodel",
    "--parallelism.spmd-backend", "partial_dtensor",
    "--hf-assets-path", str(TITAN / "assets" / "tokenizer"),
    "--training.seq-len", "256", "--training.steps", "5",
    "--training.mixed-precision-param", "float32",
    "--validator.no-enable", "--debug.seed", "42",
]  # fmt: skip
TP2 = ["--parallelism.tensor-parallel-degree", "2"]
FSDP2 = ["--parallelism.data-parallel-shard-degree", "2"]


def _disttrace(*args, env=None, check=0) -> subprocess.CompletedProcess:
    """The CLI of the interpreter torchtitan runs in (disttrace is installed there too)."""
    proc = subprocess.run(
        [str(TITAN_PYTHON), "-m", "disttrace", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1", **(env or {})},
    )
    assert proc.returncode == check, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, Path]:
    """torchtitan's own command under `disttrace run -- ...` / `inject -- ...`: dp=1 and TP 2 from one
    seed checkpoint, FSDP 2 on documents of its own per rank, clean and with the local-clip bug planted
    (its clipping engaged throughout: max-norm 1.0)."""
    missing = _titan_missing()
    if missing:
        pytest.skip(f"torchtitan is not installed for these tests: {missing}")
    out = tmp_path_factory.mktemp("titan-recorded")
    runs = out / "runs"
    seed = out / "seed"
    launcher = [str(TITAN_PYTHON), "-m", "torch.distributed.run"]
    same = [*COMMON, "--dataloader.dataset-path", str(TITAN / "assets" / "c4_test")]
    same += ["--training.local-batch-size", "2"]
    subprocess.run(
        [*launcher, "--nproc-per-node", "1", str(TITAN / "titan_train.py"), *same]
        + [
            "--dump-folder",
            str(seed),
            "--checkpoint.enable",
            "--checkpoint.create-seed-checkpoint",
        ],
        check=True,
        capture_output=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    load = ["--checkpoint.enable", "--checkpoint.initial-load-path"]
    load += [str(seed / "checkpoint" / "step-0"), "--checkpoint.load-only"]

    def titan(name: str, nproc: int, *extra, verb=("run",), env=None) -> Path:
        cmd = [*launcher, "--nproc-per-node", str(nproc), str(TITAN / "titan_train.py")]
        cmd += [*extra, "--dump-folder", str(out / name), *load]
        losses = {"TITAN_LOSSES": str(out / f"{name}.jsonl"), **(env or {})}
        proc = _disttrace(*verb, "--quiet", "--out", runs, "--", *cmd, env=losses)
        return Path(proc.stdout.strip().splitlines()[-1])

    distinct = [*COMMON, "--dataloader.dataset-path", str(TITAN / "assets" / "c4_distinct")]
    distinct += ["--training.local-batch-size", "1"]
    # a parameter's exponent bit flipped on rank 1 after step 3's update (FSDP2 offers no backward point:
    # its gradients are reduce-scattered inside its own hooks)
    fault = ("inject", "--fault", "bitflip-param", "--step", "3", "--rank", "1")
    fault += ("--param", "bit=30", "--param", f"tensor={FAULT_TENSOR}")
    return {
        "one": titan("one", 1, *same),
        "tp": titan("tp", 2, *same, *TP2),
        "tp-fault": titan("tp-fault", 2, *same, *TP2, verb=fault),
        "fsdp": titan("fsdp", 2, *distinct, *FSDP2),
        "fsdp-bug": titan("fsdp-bug", 2, *distinct, *FSDP2, env={"TITAN_BUG": "local-clip"}),
        "out": out,
    }


FAULT_TENSOR = "layers.1.feed_forward.w1.weight"


def _lock(run: Path) -> dict:
    return json.loads((run / "manifest.lock.json").read_text())


def test_torchtitan_is_recorded_with_no_code_change(recorded):
    for name in ("one", "tp", "fsdp"):
        lock = _lock(recorded[name])
        assert lock["source"] == "zero-code", name
        assert lock["manifest"]["parallelism"]["engine"] == "FSDP2"  # fully_shard at every layout
        # the optimizer recorded is the AdamW inside torchtitan's OptimizersContainer, stepped once a step
        assert lock["manifest"]["optimizer"]["type"] == "torch.optim.adamw.AdamW"
        assert (recorded[name] / "COMPLETE").exists()
        steps = _disttrace("show", recorded[name], "--json").stdout
        assert json.loads(steps)["ranks"]["0"]["steps"] == 5
    # a tensor's name leaves out the activation-checkpointing wrapper's segment
    names = _lock(recorded["tp"])["manifest"]["model"]["tensors"]
    assert FAULT_TENSOR in names and not any("_checkpoint_wrapped_module" in n for n in names)
    # the loss recorded is what torchtitan logs (its own metric, written by the wrapper), not a chunk's
    logged = [
        json.loads(x)["loss"] for x in (recorded["out"] / "one.jsonl").read_text().splitlines()
    ]
    shown = json.loads(_disttrace("show", recorded["one"], "--json").stdout)["loss"]
    assert [shown[str(s)] for s in range(1, 6)] == pytest.approx(logged, rel=1e-6)


def test_tp_and_dp1_are_numerically_equal(recorded):
    """With clipping engaged: the clip coefficient's difference (the sharded norm's, within its own bound)
    is carried into the bounds of the gradients it scales and the Adam moments they feed
    (docs/tolerance.md); without that this equivalent pair was flagged at step 1's moments."""
    _disttrace("diff", recorded["tp"], recorded["one"], "--mode", "numeric", check=0)


def test_a_fault_injected_into_torchtitan_is_found_at_its_step_and_rank(recorded):
    doc = json.loads(
        _disttrace("diff", recorded["tp"], recorded["tp-fault"], "--json", check=1).stdout
    )
    first = doc["first_divergence"]
    assert (first["step"], first["rank"], first["phase"]) == (3, 1, "optimizer")
    assert first["tensor"] == FAULT_TENSOR


def test_check_passes_fsdp_and_tp_and_fails_the_local_clip_bug(recorded):
    _disttrace("check", recorded["fsdp"], check=0)
    _disttrace("check", recorded["tp"], check=0)
    bug = _disttrace("check", recorded["fsdp-bug"], check=1)
    assert "step 1" in bug.stdout + bug.stderr and "clip" in bug.stdout + bug.stderr
    doc = json.loads(
        _disttrace("diff", recorded["fsdp"], recorded["fsdp-bug"], "--json", check=1).stdout
    )
    assert (doc["first_divergence"]["step"], doc["first_divergence"]["phase"]) == (1, "clip")
    # the bug's effect without disttrace: torchtitan's own logged losses part from step 2
    losses = {
        n: [
            json.loads(x)["loss"] for x in (recorded["out"] / f"{n}.jsonl").read_text().splitlines()
        ]
        for n in ("fsdp", "fsdp-bug")
    }
    assert losses["fsdp"][0] == losses["fsdp-bug"][0] and losses["fsdp"][1] != losses["fsdp-bug"][1]
