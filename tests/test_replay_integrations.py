"""`disttrace replay RUN --step S -- CMD` of runs recorded by the Hugging Face Trainer and Lightning callbacks,
from their checkpoints: the framework resumes its own checkpoint (scheduler, generators, data position, loops)
and the callback disttrace's verified one of the same step (`resume=`), written beside each of the
framework's saves (`checkpoints=True`). The oracle is the planted fault's nature: a skipped all-reduce on rank 1
from step 2 on recurs (persistent); the clean run's replay has nothing to attribute (none).
tests/scripts/hf_replay.py and lightning_replay.py, 2 ranks on gloo under torchrun (docs/replay.md)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest
from conftest import ROOT, cli, last_line

from disttrace.errors import BadInput

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
SCRIPTS = {
    "hf": (ROOT / "tests" / "scripts" / "hf_replay.py", "checkpoint-{step}"),
    "lightning": (ROOT / "tests" / "scripts" / "lightning_replay.py", "step={step}.ckpt"),
}


def script(kind: str, framework_out: Path, *resume) -> list[str]:
    path, _ = SCRIPTS[kind]
    return [
        TORCHRUN,
        "--nproc-per-node",
        "2",
        str(path),
        "unused",
        str(framework_out),
        *map(str, resume),
    ]


def framework_checkpoint(kind: str, framework_out: Path, step: int) -> Path:
    return framework_out / SCRIPTS[kind][1].format(step=step)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["hf", "lightning"])
def test_a_framework_run_replayed_from_its_checkpoint(tmp_path, kind):
    pytest.importorskip("transformers" if kind == "hf" else "lightning")
    runs = tmp_path / "runs"
    ref = last_line(
        cli("run", "--out", runs, "--", *script(kind, tmp_path / "ref"), timeout=600, check=0)
    )
    inject = ("inject", "--out", runs, "--fault", "skip-allreduce", "--step", 2, "--rank", 1)
    fault = last_line(cli(*inject, "--", *script(kind, tmp_path / "fault"), timeout=600, check=0))

    def replay(run: Path, name: str) -> dict:
        again = script(
            kind,
            tmp_path / f"replay-{name}",
            framework_checkpoint(kind, tmp_path / name, 1),
            run / "checkpoints" / "step-000001",
        )
        args = ("replay", run, "--step", 2, "--reference", ref, "--json", "--", *again)
        return orjson.loads(cli(*args, timeout=600, check=0).stdout)

    doc = replay(fault, "fault")
    assert doc["attribution"] == "persistent", doc["reason"]
    assert doc["reproduces"] is True and doc["matches_reference"] is False
    assert doc["from_checkpoint"] == 1 and doc["replayed_steps"] == [2]
    assert (doc["stored"]["first"]["step"], doc["stored"]["first"]["rank"]) == (2, 1)
    clean = replay(ref, "ref")
    assert clean["attribution"] == "none", clean["reason"]
    assert clean["reproduces"] is True and clean["from_checkpoint"] == 1


def test_a_trainer_that_resumed_without_the_disttrace_checkpoint_is_refused():
    """Its steps would be numbered from 1: refused at train begin, before anything is attached."""
    pytest.importorskip("transformers")
    from disttrace.integrations.hf import DisttraceCallback

    args = SimpleNamespace(
        gradient_accumulation_steps=1, per_device_train_batch_size=4, max_steps=3
    )
    with pytest.raises(BadInput) as e:
        DisttraceCallback().on_train_begin(args, SimpleNamespace(global_step=2), None)
    assert "step 2" in str(e.value) and "resume=" in str(e.value)


def test_a_lightning_fit_that_resumed_without_the_disttrace_checkpoint_is_refused():
    pytest.importorskip("lightning")
    from disttrace.integrations.lightning import DisttraceCallback

    trainer = SimpleNamespace(
        strategy=SimpleNamespace(model=None),
        accumulate_grad_batches=1,
        gradient_clip_val=None,
        max_epochs=None,
        max_steps=3,
        global_step=2,
    )
    with pytest.raises(BadInput) as e:
        DisttraceCallback().on_train_start(trainer, None)
    assert "step 2" in str(e.value) and "resume=" in str(e.value)
